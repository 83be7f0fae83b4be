"""The benchmark's command line without torch: one argument group per suite, with the defaults the suites share
(``python pipelines/benchmark.py --help`` and its usage errors answer in a fraction of a second). The registered
methods are their torch-free declarations (:mod:`patchplace.objectives.configs`); the suites' names, registered
beside torch, are stated here and tests/test_help_without_torch.py holds them equal to the registry's."""

from __future__ import annotations

import argparse
from pathlib import Path

from patchplace.objectives.declarations import known_methods
from patchplace.pipelines import CONFIGS
from patchplace.pipelines.cli import description
from patchplace.pipelines.help import HelpFormatter
from patchplace.pipelines.sections import ATTENTION_KERNELS

STUDY = dict(preset="vit_cpu_narrow", img_size=32, in_chans=1, batch=128)  # the study's defaults (reproduction/plan.py)
# benchmarks/suites.py's SUITES, in its order
SUITES = ("matmul", "objectives", "masks", "data", "models", "onnx", "pipelines", "mp3_table2", "gpu", "ddp",
          "anchor", "saved_bytes", "speed", "cpu_speed", "cpu_equivalence", "profile", "data_writer",
          "loader_vs_step", "probe_memory", "activation_memory", "fsdp_memory", "all")
# the registered image methods (their declarations, read without importing torch)
IMAGE_METHODS = tuple(name for name, m in known_methods().items() if m.modality == "image")
# the speed ladders' methods: those with a Fashion-MNIST config, then the supervised fine-tuning
SPEED_METHODS = (*(name for name in IMAGE_METHODS if (CONFIGS / f"{name}_fashion_mnist.yaml").is_file()), "finetune")


def _general_options(parser: argparse.ArgumentParser) -> None:
    """The options of every suite: which suite, where its results go, threads, kernel, device."""
    parser.add_argument("--suite", choices=list(SUITES), default="data", metavar="SUITE",
                        help=f"what to measure: {', '.join(SUITES)} (default: data)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: results for --suite all, else runs/benchmark)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--attention", choices=list(ATTENTION_KERNELS), default="sdpa",
                        help="attention kernel of every model: sdpa (fused, default) or math (the materialised "
                             "softmax of the papers' time), e.g. for MP3 Table 2 in its setting")
    parser.add_argument("--update", action="store_true",
                        help="replace this suite's rows in <out>/benchmark.json, keep the other suites' rows (speed, "
                        "cpu_speed: the measured methods' rows in <out>/benchmark_<suite>.json, keep the others')")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="objectives / matmul device (default: cuda when available)")


def _matmul_options(parser: argparse.ArgumentParser) -> None:
    """--suite matmul: the GEMM peak."""
    g = parser.add_argument_group("matmul")
    g.add_argument("--matmul-size", type=int, nargs="+", default=None,
                   help="square GEMM sizes; the best rate is the peak (default 1024 2048 3072 CPU, 4096 8192 CUDA)")
    g.add_argument("--matmul-repeats", type=int, default=10, help="timed GEMMs per size (default: %(default)s)")


def _objectives_options(parser: argparse.ArgumentParser) -> None:
    """--suite objectives: the objectives' steps, the models suite and MP3 Table 2."""
    g = parser.add_argument_group("objectives (and models)")
    g.add_argument("--preset", default=STUDY["preset"], help="backbone preset (default: %(default)s, the study ViT)")
    g.add_argument("--img-size", type=int, default=None, help="image size (default: the preset's)")
    g.add_argument("--in-chans", type=int, default=None,
                   help="input channels (default: 1 for the 32 px presets, Fashion-MNIST; else the preset's)")
    g.add_argument("--widths", choices=["study", "paper"], default=None,
                   help="decoder / predictor sizes (default: study for 32 px presets, paper otherwise)")
    g.add_argument("--batch", type=int, default=STUDY["batch"], help="batch size (default: %(default)s)")
    g.add_argument("--repeats", type=int, default=10, help="timed steps per objective (default: %(default)s)")
    g.add_argument("--warmup", type=int, default=2, help="untimed steps per objective first (default: %(default)s)")
    g.add_argument("--objectives", nargs="+", default=None, help="only these (supervised is always included)")
    g.add_argument("--compile", nargs="+", default=[], metavar="NAME",
                   help="also time torch.compile'd copies of these objectives (slow to compile on a CPU)")
    g.add_argument("--memory-steps", type=int, default=2,
                   help="steps per objective in the fresh memory process (0: skip memory; default: %(default)s)")
    g.add_argument("--vits-batch", type=int, default=8, help="all / masks: ViT-S/16 224 px batch (default: 8)")
    g.add_argument("--vits-repeats", type=int, default=3, help="all: ViT-S timed steps per objective (default: 3)")
    g.add_argument("--etas", type=float, nargs="+", default=[0.5, 0.75], help="models suite: masking ratios")
    g.add_argument("--amp", choices=["no", "bf16"], default=None,
                   help="forward autocast of the objectives / mp3_table2 suites (default: no; bf16 in mp3_table2)")
    g.add_argument("--mp3-etas", type=float, nargs="+", default=[0.3, 0.5, 0.75, 0.9],
                   help="mp3_table2: MP3 masking ratios (default: %(default)s)")
    g.add_argument("--mae-ratios", type=float, nargs="*", default=[0.5, 0.75, 0.9],
                   help="mp3_table2: MAE masking ratios (default: %(default)s)")
    g.add_argument("--kernels", nargs="+", choices=list(ATTENTION_KERNELS), default=list(ATTENTION_KERNELS),
                   help="saved_bytes / mp3_table2: attention kernels to measure, each in turn (default: both; "
                   "overrides --attention there)")


def _gpu_options(parser: argparse.ArgumentParser) -> None:
    """--suite gpu: every objective's step on a CUDA machine, eager and compiled, a process per row."""
    g = parser.add_argument_group("gpu")
    g.add_argument("--gpu-budget", type=float, default=540,
                   help="seconds for the whole suite; rows that would start later are skipped with a note and run "
                   "by the next call, which keeps the rows already in <out>/benchmark_gpu.json (default: 540)")
    g.add_argument("--gpu-row-seconds", type=float, default=90,
                   help="limit of one eager row's process (default: %(default)s)")
    g.add_argument("--gpu-compile-seconds", type=float, default=240,
                   help="limit of one torch.compile'd row's process, compilation included (default: %(default)s)")
    g.add_argument("--gpu-modes", nargs="+", choices=["eager", "compile"], default=["eager", "compile"],
                   help="eager and / or torch.compile'd rows (default: both, every eager row first)")
    g.add_argument("--gpu-profile-steps", type=int, default=3,
                   help="steps under torch.profiler for the GPU's busy time (default: %(default)s)")
    g.add_argument("--gpu-backend", default="inductor", help="torch.compile backend (default: %(default)s)")


def _masks_options(parser: argparse.ArgumentParser) -> None:
    """--suite masks: the mask generators."""
    g = parser.add_argument_group("masks")
    g.add_argument("--mask-repeats", type=int, default=20, help="timed batches per generator (default: 20)")


def _data_options(parser: argparse.ArgumentParser) -> None:
    """--suite data: shard reads, batched augmentation and MFCC."""
    g = parser.add_argument_group("data")
    g.add_argument("--shards", type=Path, default=Path("shards/fashion_mnist/train"),
                   help="split read by the data and pipelines suites (default: %(default)s)")
    g.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2], help="DataLoader worker counts")
    g.add_argument("--loader-batch", type=int, default=STUDY["batch"], help="loader batch size (default: 128)")
    g.add_argument("--max-samples", type=int, default=15360, help="stop each read after this many samples "
                   "(default: %(default)s; 0: the whole split)")
    g.add_argument("--pad-to", type=int, default=32, help="image padding used by the transform")
    g.add_argument("--mfcc-batches", type=int, default=20, help="timed MFCC batches of 64 clips")


def _probe_memory_options(parser: argparse.ArgumentParser) -> None:
    """--suite probe_memory: the streamed probes' memory."""
    g = parser.add_argument_group("probe_memory")
    g.add_argument("--probe-sizes", type=int, nargs="+", default=[2000, 8000, 32000],
                   help="train split sizes (default: 2000 8000 32000)")
    g.add_argument("--probe-epochs", type=int, default=2, help="epochs of each linear probe (default: %(default)s)")
    g.add_argument("--feature-dims", type=int, nargs="*", default=[],
                   help="feature widths probed from a store alone, e.g. 768 3072 5120 (default: none)")
    g.add_argument("--width-samples", type=int, default=8000,
                   help="train samples of each --feature-dims store (default: %(default)s)")


def _data_writer_options(parser: argparse.ArgumentParser) -> None:
    """--suite data_writer: the image-folder recipe's writer."""
    g = parser.add_argument_group("data_writer")
    g.add_argument("--writer-images", type=int, default=480, help="generated JPEGs written (default: %(default)s)")
    g.add_argument("--writer-workers", type=int, nargs="+", default=[1, 2], help="writer process counts (default: 1 2)")


def _loader_vs_step_options(parser: argparse.ArgumentParser) -> None:
    """--suite loader_vs_step: the streaming loader against the training step."""
    g = parser.add_argument_group("loader_vs_step")
    g.add_argument("--loader-config", default="imagenet_supervised_deitb_train",
                   help="pipelines config whose data section builds the loader (default: %(default)s)")
    g.add_argument("--loader-images", type=int, default=384, help="generated JPEGs read (default: %(default)s)")
    g.add_argument("--loader-workers", type=int, nargs="+", default=[0, 1, 2],
                   help="DataLoader worker counts (default: 0 1 2)")
    g.add_argument("--loader-decoders", nargs="+", choices=["pillow", "fast"], default=["pillow", "fast"],
                   help="JPEG decoders of the reader (default: both)")
    g.add_argument("--loader-step-batch", type=int, default=32,
                   help="batch of the loader and of the step (default: %(default)s)")
    g.add_argument("--loader-repeats", type=int, default=2,
                   help="epochs per loader setting, decoders alternated; the fastest is kept (default: %(default)s)")
    g.add_argument("--step-preset", default="vit_tiny", help="the ViT whose step is timed (default: %(default)s)")
    g.add_argument("--step-repeats", type=int, default=3, help="timed steps (default: %(default)s)")


def _activation_memory_options(parser: argparse.ArgumentParser) -> None:
    """--suite activation_memory: run.activation_checkpointing's memory per method (--methods, --amp)."""
    g = parser.add_argument_group("activation_memory")
    g.add_argument("--memory-widths", nargs="+", choices=["vit_b", "vit_l"], default=["vit_b", "vit_l"],
                   help="backbone widths (ViT-B: 768 x 12 heads, ViT-L: 1024 x 16; default: both)")
    g.add_argument("--memory-depth", type=int, default=4, help="backbone blocks (default: %(default)s)")
    g.add_argument("--memory-batch", type=int, default=8, help="batch of 224 px images (default: %(default)s)")


def _onnx_options(parser: argparse.ArgumentParser) -> None:
    """--suite onnx: the exported classifier's latency."""
    g = parser.add_argument_group("onnx")
    g.add_argument("--onnx-preset", default=STUDY["preset"], help="classifier to export (default: %(default)s)")
    g.add_argument("--onnx-batches", type=int, nargs="+", default=[1, 8, 64], help="batch sizes")
    g.add_argument("--onnx-repeats", type=int, default=20, help="timed runs per batch size (default: 20)")


def _pipelines_options(parser: argparse.ArgumentParser) -> None:
    """--suite pipelines: pretrain.py end to end, and the anchor suite."""
    g = parser.add_argument_group("pipelines")
    g.add_argument("--steps", type=int, default=20, help="optimizer steps per config (default: %(default)s)")
    g.add_argument("--methods", nargs="+", default=None,
                   help="only these configs (e.g. supervised mp3; default: every one, or supervised + mp3 in all)")
    g.add_argument("--pipelines-preset", default=None,
                   help="model.preset override (default: the configs' own; vit_cpu_narrow in all)")
    g.add_argument("--pipelines-batch", type=int, default=None,
                   help="data.batch_size (default: 64; the study's 128 in all, ddp, anchor)")
    g.add_argument("--pipelines-workers", type=int, default=2,
                   help="data.num_workers of the streaming path (default: %(default)s, the configs')")
    g.add_argument("--pipelines-overrides", nargs="*", default=[], metavar="KEY=VALUE",
                   help="more pretrain.py overrides, e.g. run.mixed_precision=bf16 on a GPU")
    g.add_argument("--pipelines-repeats", type=int, default=2,
                   help="pipelines: alternated runs of every path, medians reported (default: %(default)s)")
    g.add_argument("--anchor-epochs", type=float, default=1.0,
                   help="anchor: training epochs of both loops (default: %(default)s)")
    g.add_argument("--anchor-seeds", type=int, nargs="+", default=[0], help="anchor: seeds (default: 0)")


def _profile_options(parser: argparse.ArgumentParser) -> None:
    """--suite profile: torch.profiler over the steps."""
    g = parser.add_argument_group("profile")
    g.add_argument("--profile-top", type=int, default=12, help="operators listed per objective (default: 12)")


def _speed_options(parser: argparse.ArgumentParser) -> None:
    """--suite speed: the GPU speed ladder."""
    g = parser.add_argument_group("speed")
    g.add_argument("--speed-methods", nargs="+", default=list(SPEED_METHODS), metavar="METHOD",
                   help="methods to time (finetune: the supervised fine-tuning; default: %(default)s)")
    g.add_argument("--speed-settings", nargs="+", default=None, metavar="RUNG",
                   help="only these rungs of before fused lazy batch compile processes (default: all)")
    g.add_argument("--speed-batch", type=int, default=1024,
                   help="the per-process batch of the batch / compile / processes rungs (default: %(default)s)")
    g.add_argument("--speed-processes", type=int, default=4,
                   help="runs sharing the device in the processes rung (default: %(default)s)")
    g.add_argument("--speed-steps", type=int, default=100,
                   help="optimizer steps per run; the rate is over all but the first (default: %(default)s)")
    g.add_argument("--speed-compile", default="default",
                   help="run.compile of the compile / processes rungs: default | reduce-overhead | max-autotune | "
                   "aot_eager (default: %(default)s)")


def _cpu_speed_options(parser: argparse.ArgumentParser) -> None:
    """--suite cpu_speed: the CPU speed ladder."""
    g = parser.add_argument_group("cpu_speed")
    g.add_argument("--cpu-speed-methods", nargs="+", default=list(SPEED_METHODS), metavar="METHOD",
                   help="methods laddered on the study ViT (finetune: the supervised fine-tuning; default: all)")
    g.add_argument("--cpu-speed-vits-methods", nargs="+", default=["supervised", "mp3"],
                   metavar="METHOD", help="methods laddered on ViT-S at 224 px, batch 8 (default: %(default)s)")
    g.add_argument("--cpu-speed-rungs", nargs="+", default=None, metavar="RUNG",
                   help="only these rungs of: fp32, bf16, compile, bf16+compile, '1 thread', '2 x 1 thread' "
                   "(default: all)")
    g.add_argument("--cpu-speed-steps", type=int, default=6,
                   help="optimizer steps per run; the rate is over all but the first (default: %(default)s)")
    g.add_argument("--cpu-speed-slow-methods", nargs="+", default=["supervised", "mp3"], metavar="METHOD",
                   help="on a CPU without bf16 units, the bf16 rungs only for these methods (each such step runs "
                   "through a scalar fallback; default: %(default)s)")
    g.add_argument("--cpu-speed-slow-steps", type=int, default=3,
                   help="steps of a bf16 rung on a CPU without bf16 units (default: %(default)s)")


def _cpu_equivalence_options(parser: argparse.ArgumentParser) -> None:
    """--suite cpu_equivalence: bf16 vs fp32 training, and the ddp suite."""
    g = parser.add_argument_group("cpu_equivalence")
    g.add_argument("--equivalence-methods", nargs="+", default=["mp3", "droppos"], metavar="METHOD",
                   help="study rows trained in float32 and bf16 (default: %(default)s)")
    g.add_argument("--equivalence-seeds", type=int, nargs="+", default=[0, 1, 2],
                   help="seeds of each pair (default: 0 1 2)")
    g.add_argument("--equivalence-study", nargs="+", default=[], metavar="KEY=VALUE",
                   help="overrides of the study's defaults (StudyConfig) for these runs (default: none)")
    g.add_argument("--equivalence-finetune", nargs="*", default=None, metavar="METHOD",
                   help="methods also fine-tuned and compared on fine-tuned top-1 (default: every method; none: "
                   "probes only)")
    g.add_argument("--equivalence-precisions", nargs="+", choices=["fp32", "bf16"], default=None,
                   help="train only these (e.g. one per process, then a call with both reads them and tests; "
                   "default: both)")
    g.add_argument("--equivalence-runs", type=Path, default=Path("runs/cpu_equivalence"),
                   help="run directories: <runs>/<fp32|bf16>/seed<k>/<method>/ (resumable; default: %(default)s)")
    g.add_argument("--ddp-repeats", type=int, default=2,
                   help="ddp: alternated runs of every setting, medians reported (default: %(default)s)")


# the option groups, in the order --help lists them (one argument group per suite)
OPTION_GROUPS = (
    _matmul_options,
    _objectives_options,
    _gpu_options,
    _masks_options,
    _data_options,
    _probe_memory_options,
    _data_writer_options,
    _loader_vs_step_options,
    _activation_memory_options,
    _onnx_options,
    _pipelines_options,
    _profile_options,
    _speed_options,
    _cpu_speed_options,
    _cpu_equivalence_options,
)


def build_parser() -> argparse.ArgumentParser:
    """The command line: the general options, then one argument group per suite (``OPTION_GROUPS``)."""
    parser = argparse.ArgumentParser(description=description("patchplace.research.benchmark"),
                                     formatter_class=HelpFormatter)
    _general_options(parser)
    for add in OPTION_GROUPS:
        add(parser)
    return parser
