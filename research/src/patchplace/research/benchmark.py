"""Benchmarks: speed and memory figures live here, never in timed tests.

    python pipelines/benchmark.py --suite all                  # everything, laptop sizes -> results/benchmark.*
    python pipelines/benchmark.py --suite objectives --preset vit_small --img-size 224 --batch 8 --repeats 3
    python pipelines/benchmark.py --suite gpu                  # any CUDA machine -> results/benchmark_gpu.*

Writes ``<out>/benchmark.json`` (``meta``: hardware, torch / ONNX Runtime versions, the fp32 matmul peak, seconds per
part; ``results``: one row per measurement) and ``<out>/benchmark.md`` (one table per part, each headed by the
hardware line); ``--suite all`` also draws ``<out>/benchmark_objectives.png``. ``--out`` defaults to ``results``
for ``all`` and ``gpu``, ``runs/benchmark`` otherwise. Suites:

  matmul      fp32 GEMM GFLOP/s of a large square matmul (torch threads as configured): the machine's peak, the
              denominator of every "fraction of peak" below.
  objectives  pretraining step (forward + backward + AdamW, EMA update where there is one) of every objective on
              backbone --preset, relative to the supervised step of the same run (rotated round-robin), beside its
              FLOP ratio (FLOPs counted on the step: torch's FlopCounterMode); training samples/s; achieved
              GFLOP/s (FLOPs / step time) and its fraction of the matmul peak; ATen ops and host syncs of one
              step (forward, backward, EMA update: patchplace.objectives.audit.count_step); memory of each
              objective measured in a fresh process (peak RSS, the part of it the steps added, and CUDA
              max_memory_allocated on a GPU).
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
              --mp3-etas (0.3 0.5 0.75 0.9) and MAE at --mae-ratios (0.5 0.75 0.9) against the supervised ViT-B
              step, once per attention kernel of --kernels (sdpa: fused; math: the materialised softmax of the
              paper's time): time and peak CUDA memory as ratios to supervised beside the FLOP ratio, time / FLOP
              ratio (whether it is within 10% of 1) and the paper's ratios (one A100). Writes
              <out>/benchmark_mp3_table2.{json,md} and splices its tables into <out>/benchmark.md as the "GPU"
              section (kept when --suite all rewrites that file).
  gpu         every registered objective's step on any CUDA machine (supervised, MP3 at eta 0.75, MAE, DropPos,
              I-JEPA, StoP, RandSAC, MJP): ViT-B/16 at 224 px, batch 128 (--batch), bf16 autocast, eager and
              torch.compile'd (--gpu-modes), each row in a process of its own: step time, GPU busy time per step
              (torch.profiler: a launch-bound step is busy a small share of its wall time), peak CUDA memory,
              FLOPs counted on the step, achieved TFLOP/s and its fraction of the bf16 matmul peak, ATen ops /
              host syncs / host copies of one eager step, compile time, graph breaks and recompiles; ratios to the
              supervised step of the same mode beside the FLOP ratio and MP3 Table 2's. Within --gpu-budget
              seconds (540; rows past it are skipped with a note), each row written to
              <out>/benchmark_gpu.json (default out: results) as it lands; a second call keeps the rows there
              and measures the rest. Without CUDA: one line, exit 2.
  saved_bytes MP3 Table 2's memory column on any machine: activation bytes saved for backward per sample
              (saved-tensor hooks, GPU autocast dtypes) of MP3 at --mp3-etas vs the supervised step, ViT-B/16 at
              224 px (--preset), with each attention kernel (--kernels sdpa math). Writes
              <out>/benchmark_saved_bytes.{json,md}. About a minute on a CPU.
  activation_memory  run.activation_checkpointing on any machine: per image method (--methods) at ViT-B and
              ViT-L widths (--memory-widths), --memory-depth 4 blocks, --memory-batch 8 images of 224 px, the tensor
              bytes a step holds for its backward and its peak of live tensor bytes, without and with every block
              recomputing its activations (fp32; --amp bf16). Writes <out>/benchmark_activation_memory.{json,md}.
  fsdp_memory  run.fsdp and run.activation_checkpointing per rank on 2 CPU processes (gloo): the peak resident
              memory of one step (forward, backward, AdamW) as DDP, with checkpointing, with FSDP2's fully_shard
              (as run.fsdp=full_shard shards), with both; --methods (supervised mae ijepa) at --memory-widths,
              --memory-depth blocks, --memory-batch images of 224 px per rank, fp32. Writes
              <out>/benchmark_fsdp_memory.{json,md}.
  ddp         pretrain.py on 1 process vs 2 (gloo, the README's accelerate command, global batch 128 split
              between them, cores split too) for --methods (supervised mp3 mjp), and the step-time cost of DDP's
              find_unused_parameters (2 processes, off vs on; MJP with its jigsaw on every step so that it can run
              off). Writes <out>/benchmark_ddp.{json,md}; needs the shards.
  anchor      the supervised baseline (finetune.py from scratch) vs a plain timm ViT training loop of the same size,
              data, epochs (--anchor-epochs) and recipe: test top-1 and samples/s per --anchor-seeds.
  speed       the study ViT at GPU speed: images/s of every --speed-methods' training through pretrain.py
              (finetune: finetune.py's supervised recipe), a process per run on the in-memory path, at each rung
              of a ladder: before (a GPU study's batch 256, foreach AdamW, eager) -> fused (AdamW's fused
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
  cpu_equivalence  bf16 vs fp32 training through the study's own stages (StudyConfig's defaults +
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

import sys

if __name__ == "__main__":  # `python -m patchplace.research.benchmark`, before the imports below load torch: the
    # arguments parse without it (--help, a usage error), then this module runs imported by its name
    from patchplace.research import cli

    sys.exit(cli.main("benchmark"))

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from patchplace.models import set_attention_kernel
from patchplace.pipelines.stages import hardware_line
from patchplace.research.benchmarks.common import STUDY
from patchplace.research.benchmarks.options import OPTION_GROUPS as OPTION_GROUPS  # the command line, without torch
from patchplace.research.benchmarks.options import build_parser
from patchplace.research.benchmarks.report import gpu_section, plot_objectives, splice_gpu_section, to_markdown
from patchplace.research.benchmarks.suites import SUITES

# The suites live in benchmarks/ (one module per family, benchmarks/suites.py: the registry; benchmarks/options.py:
# the command line, without torch); this file: the run, and the JSON / markdown / figure it writes.


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
    key = ",".join(sorted(names))
    before = old["meta"].get("seconds", {})  # a first call's {"total": s} reads as the earlier calls'
    earlier = {k: v for k, v in before.items() if k != "total"} or (
        {"earlier calls": before["total"]} if "total" in before else {})
    seconds = {**earlier, key: meta.get("seconds", {}).get("total", 0.0)}
    return kept + rows, {**old["meta"], "seconds": {**seconds, "total": round(sum(seconds.values()), 1)},
                         "updated": {**old["meta"].get("updated", {}), key: meta}}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    set_attention_kernel(args.attention)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.max_samples == 0:
        args.max_samples = None
    study = args.suite == "all"  # all: the study's model and loader (its defaults, reproduction/plan.py)
    if study:
        args.pipelines_preset = args.pipelines_preset or STUDY["preset"]
    if args.pipelines_batch is None:
        args.pipelines_batch = STUDY["batch"] if study or args.suite in ("ddp", "anchor") else 64
    out = args.out or Path("results" if args.suite in ("all", "gpu") else "runs/benchmark")
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
    own_file = ("mp3_table2", "gpu", "ddp", "saved_bytes", "speed", "cpu_speed", "cpu_equivalence",
                "profile", "activation_memory", "fsdp_memory")  # suites with a file of their own
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
