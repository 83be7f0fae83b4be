"""Benchmarks: speed and memory figures live here, never in timed tests.

    python pipelines/benchmark.py --suite all                  # everything, laptop sizes -> results/benchmark.*
    python pipelines/benchmark.py --suite objectives --preset vit_small --img-size 224 --batch 8 --repeats 3

Writes ``<out>/benchmark.json`` (``meta``: hardware, torch / ONNX Runtime versions, the fp32 matmul peak, seconds per
part; ``results``: one row per measurement) and ``<out>/benchmark.md`` (one table per part, each headed by the
hardware line); ``--suite all`` also draws ``<out>/benchmark_objectives.png``. ``--out`` defaults to ``results``
for ``all`` and ``runs/benchmark`` otherwise. Suites:

  matmul      fp32 GEMM GFLOP/s of a large square matmul (torch threads as configured): the machine's peak, the
              denominator of every "fraction of peak" below.
  objectives  pretraining step (forward + backward + AdamW, EMA update where there is one) of every objective on
              backbone --preset, relative to the supervised step of the same run (rotated round-robin), beside its
              FLOP ratio counted from the shapes; training samples/s; achieved GFLOP/s (FLOPs from the shapes x
              batch / step time) and its fraction of the matmul peak; memory of each objective measured in a fresh
              process (peak RSS, the part of it the steps added, and CUDA max_memory_allocated on a GPU).
              Decoders / predictors: the study configs' sizes (--widths study: 128 x 2, predictor 96 x 4) for the
              32 px presets, the papers' defaults (--widths paper) otherwise. --compile NAME adds NAME+compile
              (torch.compile) rows.
  masks       mask generation per batch: I-JEPA multi-block (batched tensor ops), MJP block-wise (NumPy).
  data        shard read throughput (decode + train transform) with each --workers count; batched augmentation
              (the in-memory path) vs the per-sample timm / PIL transform, and the ways to crop-and-resize a batch
              with per-sample boxes (grid_sample, torchvision roi_align / v2, kornia if installed); MFCC clips/s.
  data_writer the image-folder recipe's writer: images/s and images/s per core with each --writer-workers count
              (outputs compared byte for byte), and JPEG decoding per core, Pillow vs torchvision.io.decode_jpeg,
              and the reader's decode path before (Pillow) and after (decode_jpeg where its pixels are Pillow's),
              with each pair's largest pixel difference, on --writer-images generated JPEGs of 64 px to 640 x 480.
  loader_vs_step  does the streaming loader keep up? On --loader-images generated JPEGs (64 px to 640 x 480)
              written to shards by the image-folder recipe, the train loader as the pipelines build it from
              --loader-config (DeiT's: RandomResizedCrop 224 + flip + RandAugment + random erasing), images/s (best
              of --loader-repeats epochs) per --loader-workers count and --loader-decoders (pillow: Pillow only;
              fast), against the supervised training step of --step-preset (vit_tiny) at 224 px and the same batch
              (--loader-step-batch) on the same machine: ratio = loader / step (>= 1: keeps up), workers needed =
              step / one worker's rate.
  probe_memory  peak anonymous memory (RssAnon) of evaluate.py's streamed probes over the whole train split at
              each --probe-sizes size (generated 16 px shards; 4-block vit_micro; a fresh process each, no loader
              worker): the feature store, the linear probes (last layer, last 4), StoP's 1% logistic regression,
              the layer-wise kNN; flat = independent of the split's size. Also the store's size on disk and time.
  models      one Transformer block's forward + backward with MP3 context-only keys/values vs full attention.
  onnx        inference latency (p50 / p95) and images/s of a randomly initialised --onnx-preset classifier at each
              --onnx-batches size: PyTorch eager, the plain ONNX graph on a default ONNX Runtime session (before),
              ONNX Runtime's optimized graph and its int8 variant (after; patchplace.export), speed-ups over
              PyTorch from the same run; every runner uses --threads threads (ONNX Runtime intra-op too).
  pipelines   end-to-end samples/s of the Fashion-MNIST pretraining configs (--methods; default supervised mp3
              droppos mae) through pretrain.py on each data path — in memory (batched augmentation on the
              device), streaming (--pipelines-workers), and the same loop on one repeated batch (pure step) —
              and end_to_end_ratio = path / pure step, alternated --pipelines-repeats times (medians); startup
              (reading, workers, first step) apart. Needs the shards.
  mp3_table2  MP3 Table 2 on a GPU: ViT-B/16 at 224 px (--preset / --img-size to change), --amp bf16, MP3 at
              --mp3-etas (0.3 0.5 0.75 0.9), MAE at --mae-ratios (0.5 0.75 0.9) and --table2-others (DropPos,
              I-JEPA, StoP, RandSAC, MJP; paper widths) against the supervised ViT-B step, once per attention
              kernel of --kernels (sdpa: fused; math: the materialised softmax of the paper's time): time and peak
              CUDA memory as ratios to supervised beside the FLOP ratio, time / FLOP ratio (whether it is within
              10% of 1) and the paper's ratios (one A100). Writes <out>/benchmark_mp3_table2.{json,md} and
              splices its tables into <out>/benchmark.md as the "GPU" section (kept when --suite all rewrites
              that file).
  saved_bytes MP3 Table 2's memory column on any machine: activation bytes saved for backward per sample
              (saved-tensor hooks, GPU autocast dtypes) of MP3 at --mp3-etas vs the supervised step, ViT-B/16 at
              224 px (--preset), with each attention kernel (--kernels sdpa math). Writes
              <out>/benchmark_saved_bytes.{json,md}. About a minute on a CPU.
  ddp         pretrain.py on 1 process vs 2 (gloo, the README's accelerate command, global batch 128 split
              between them, cores split too) for --methods (supervised mp3 mjp), and the step-time cost of DDP's
              find_unused_parameters (2 processes, off vs on; MJP with its jigsaw on every step so that it can run
              off). Writes <out>/benchmark_ddp.{json,md}; needs the shards.
  anchor      the supervised baseline (finetune.py from scratch) vs a plain timm ViT training loop of the same size,
              data, epochs (--anchor-epochs) and recipe: test top-1 and samples/s per --anchor-seeds.
  speed       the study ViT at GPU speed: images/s of every --speed-methods' training through pretrain.py
              (finetune: finetune.py's supervised recipe), a process per run on the in-memory path, at each rung
              of a ladder: before (study_gpu.yaml's batch 256, foreach AdamW, eager) -> fused (AdamW's fused
              kernel) -> lazy (run.finite_check=lazy: no host sync per step) -> batch (--speed-batch, peak lr
              scaled linearly from 256) -> compile (run.compile=--speed-compile) -> processes
              (--speed-processes such runs at once, summed): each rate over the
              first rung's and as a fraction of the matmul peak (bf16 on a GPU). Writes
              <out>/benchmark_speed.{json,md}; needs the shards. A GPU suite: every rung on a CPU takes minutes.
  cpu_speed   the CPU ladder: images/s of --cpu-speed-methods (study ViT) and --cpu-speed-vits-methods (ViT-S,
              224 px, batch 8) through pretrain.py / finetune.py, a process per run on the in-memory path, at each
              rung: fp32 eager -> bf16 autocast -> compiled blocks (inductor) -> both -> 1 thread -> 2 one-thread
              processes at once (summed); each over the fp32 rung's and as a fraction of the fp32 and bf16 matmul
              peaks of the same run, headed by the CPU's name and bf16-relevant flags. On a CPU without bf16 units
              the bf16 rungs run --cpu-speed-slow-steps steps, for --cpu-speed-slow-methods only. Writes
              <out>/benchmark_cpu_speed.{json,md} (--update: replace the measured methods' rows); needs the shards.
  cpu_equivalence  bf16 vs fp32 training through the study's own stages (study_fashion_mnist.yaml +
              --equivalence-study): --equivalence-methods x --equivalence-seeds, both precisions from the same
              seed, the 1% linear probe and the fine-tuned top-1 on the validation split; a seed-paired TOST at
              alpha 0.05, margin +-1 pt, per method and measure. bf16 runs natively on a CPU with bf16 units,
              else with emulated bf16 matmuls (patchplace.research.emulated_bf16). Resumable runs below
              --equivalence-runs; writes <out>/benchmark_cpu_equivalence.{json,md}.
  profile     where a step's time goes: torch.profiler over --repeats training steps of each --objectives
              (default supervised mae; ViT-B/16 224 px on a GPU unless --preset says otherwise, the study ViT on a
              CPU), the --profile-top operators by self time per step (device time on a GPU) and the share of the
              step outside matrix products and attention. Writes <out>/benchmark_profile.{json,md}.
  all         matmul; objectives for the study ViT (vit_cpu_narrow, 1 x 32 px, batch 128) and for ViT-S/16
              at 224 px (3 channels, batch --vits-batch, paper widths, without stop_noema); masks; data (+ loader
              samples/s vs the study ViT's training consumption); models; onnx; pipelines (on the study ViT).
              Roughly 20 minutes on an idle 2-core CPU.

--update: replace only this suite's rows (and its seconds) in <out>/benchmark.json / .md, keeping the others
(e.g. ``--suite pipelines --out results --update`` refreshes that table of results/); with ``--suite speed``, only
the rows of the methods measured in <out>/benchmark_speed.json (a GPU study measured over several calls).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from patchplace.models import ATTENTION_KERNELS, set_attention_kernel
from patchplace.pipelines.config import HelpFormatter
from patchplace.pipelines.stages import hardware_line
from patchplace.research.benchmarks.common import STUDY
from patchplace.research.benchmarks.mp3 import TABLE2_OTHERS
from patchplace.research.benchmarks.report import gpu_section, plot_objectives, splice_gpu_section, to_markdown
from patchplace.research.benchmarks.speed import SPEED_METHODS
from patchplace.research.benchmarks.suites import SUITES

# The suites live in benchmarks/ (one module per family, benchmarks/suites.py: the registry); this file: the
# command line, and the JSON / markdown / figure it writes.


# ---------------------------------------------------------------------------------------------- main
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
    g.add_argument("--table2-others", nargs="*", default=list(TABLE2_OTHERS), metavar="OBJECTIVE",
                   help="mp3_table2: the other objectives timed beside MP3 and MAE (default: %(default)s; "
                   "none: only MP3 and MAE)")
    g.add_argument("--table2-compile", action="store_true",
                   help="mp3_table2: also time torch.compile'd copies (ratios to the compiled supervised step)")


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
                   help="overrides of study_fashion_mnist.yaml for these runs (default: none: the study's budget)")
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
    _masks_options,
    _data_options,
    _probe_memory_options,
    _data_writer_options,
    _loader_vs_step_options,
    _onnx_options,
    _pipelines_options,
    _profile_options,
    _speed_options,
    _cpu_speed_options,
    _cpu_equivalence_options,
)


def build_parser() -> argparse.ArgumentParser:
    """The command line: the general options, then one argument group per suite (``OPTION_GROUPS``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    _general_options(parser)
    for add in OPTION_GROUPS:
        add(parser)
    return parser


def updated(path: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> tuple[list[dict[str, Any]], dict]:
    """--update: the rows of ``path`` (benchmark.json, or a suite's own file) that this run did not measure, kept
    beside its rows — in benchmark.json the other suites' rows and seconds, in a suite's own file (speed) the
    rows of the other names (methods measured in other calls)."""
    if not path.is_file():
        return rows, meta
    old, suite = json.loads(path.read_text()), meta["suite"]
    if path.name == "benchmark.json":
        kept = [r for r in old["results"] if r.get("suite") != suite]
        seconds = {k: v for k, v in {**old["meta"].get("seconds", {}), suite: meta["seconds"]["total"]}.items()
                   if k != "total"}
        merged = {**old["meta"], "seconds": {**seconds, "total": round(sum(seconds.values()), 1)}}
        return kept + rows, {**merged, "updated": {suite: meta}}
    names = {r["name"] for r in rows}
    kept = [r for r in old["results"] if r["name"] not in names]
    return kept + rows, {**old["meta"], "updated": {**old["meta"].get("updated", {}), ",".join(sorted(names)): meta}}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    set_attention_kernel(args.attention)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.max_samples == 0:
        args.max_samples = None
    study = args.suite == "all"  # all: the study's model and loader (pipelines/configs/study_fashion_mnist.yaml)
    if study:
        args.pipelines_preset = args.pipelines_preset or STUDY["preset"]
    if args.pipelines_batch is None:
        args.pipelines_batch = STUDY["batch"] if study or args.suite in ("ddp", "anchor") else 64
    out = args.out or Path("results" if args.suite == "all" else "runs/benchmark")
    state: dict[str, Any] = {}
    start = time.perf_counter()
    rows = SUITES[args.suite](args, state)
    meta = {"suite": args.suite, "hardware": hardware_line(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "machine": platform.machine(),
            "python": platform.python_version(), "matmul_peak": state.get("matmul_peak"),
            **{k: state[k] for k in ("bf16_matmul_peak", "cpu", "equivalent") if k in state},
            "attention": ",".join(args.kernels) if args.suite in ("mp3_table2", "saved_bytes") else args.attention,
            "seconds": {**state.get("seconds", {}), "total": round(time.perf_counter() - start, 1)},
            "argv": argv if argv is not None else sys.argv[1:]}
    try:
        import onnxruntime

        meta["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    out.mkdir(parents=True, exist_ok=True)
    own_file = ("mp3_table2", "ddp", "saved_bytes", "speed", "cpu_speed", "cpu_equivalence",
                "profile")  # suites with a file of their own
    stem = f"benchmark_{args.suite}" if args.suite in own_file else "benchmark"
    if args.update and args.suite != "all" and (args.suite not in own_file or args.suite in ("speed", "cpu_speed")):
        rows, meta = updated(out / f"{stem}.json", rows, meta)
    markdown = to_markdown(rows, meta)
    files = {f"{stem}.json": json.dumps({"meta": meta, "results": rows}, indent=2) + "\n", f"{stem}.md": markdown}
    existing = (out / "benchmark.md").read_text() if (out / "benchmark.md").is_file() else ""
    if args.suite == "mp3_table2":  # also the GPU section of benchmark.md
        files["benchmark.md"] = splice_gpu_section(existing or "# Benchmarks\n", markdown)
    elif existing and stem == "benchmark":  # keep the GPU section a GPU run wrote
        files["benchmark.md"] = splice_gpu_section(markdown, gpu_section(existing))
    for name, text in files.items():
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)
    if plot_objectives(rows, out / "benchmark_objectives.png"):
        print(f"wrote {out / 'benchmark_objectives.png'}")
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
