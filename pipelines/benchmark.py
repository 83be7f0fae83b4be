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
              (torch.compile) rows. (The before / after rows of the mask-generator optimization are kept in
              results/; the old code is in git history.)
  masks       mask generation per batch: I-JEPA multi-block (batched tensor ops), MJP block-wise (NumPy).
  data        shard read throughput (decode + train transform) with each --workers count; batched augmentation
              (the in-memory path) vs the per-sample timm / PIL transform, and the ways to crop-and-resize a batch
              with per-sample boxes (grid_sample, torchvision roi_align / v2, kornia if installed); MFCC clips/s.
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
              step: time and peak CUDA memory as ratios to supervised beside the FLOP ratio and the paper's
              ratios (one A100). Writes <out>/benchmark_mp3_table2.{json,md} and splices its tables into
              <out>/benchmark.md as the "GPU" section (kept when --suite all rewrites that file).
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
  all         matmul; objectives for the study ViT (vit_cpu_narrow, 1 x 32 px, batch 128) and for ViT-S/16
              at 224 px (3 channels, batch --vits-batch, paper widths, without stop_noema); masks; data (+ loader
              samples/s vs the study ViT's training consumption); models; onnx; pipelines (on the study ViT).
              Roughly 20 minutes on an idle 2-core CPU.

--update: replace only this suite's rows (and its seconds) in <out>/benchmark.json / .md, keeping the others
(e.g. ``--suite pipelines --out results --update`` refreshes that table of results/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))  # pretrain.py / engine.py / config.py

from config import HelpFormatter, load
from stages import hardware_line

from patchplace.data.benchmark import augment_throughput, mfcc_throughput, shard_read_throughput
from patchplace.models import ATTENTION_KERNELS, PRESETS, set_attention_kernel
from patchplace.models.benchmark import context_attention, matmul_peak
from patchplace.objectives.benchmark import MP3_ETAS, default_objectives, isolated_step_memory, mask_times, step_times

STUDY = dict(preset="vit_cpu_narrow", img_size=32, in_chans=1, batch=128)  # pipelines/configs/study_fashion_mnist.yaml
# MP3 Table 2 (ViT-B on ImageNet-1K, one A100): seconds / iteration and GB / batch per masking ratio; the ViT-B
# baseline is 0.67 s and 33.5 GB (MAE at 0.3 ran out of memory). Ratios = value / the baseline's.
MP3_TABLE2 = {"vit_b": {"time": 0.67, "memory": 33.5},
              "mp3": {0.3: (0.52, 30.0), 0.5: (0.51, 27.4), 0.75: (0.46, 24.2), 0.9: (0.44, 22.3)},
              "mae": {0.3: None, 0.5: (0.57, 35.1), 0.75: (0.47, 28.0), 0.9: (0.41, 24.4)}}
MP3_PAPER = {"eta": 0.75, "time_ratio": round(MP3_TABLE2["mp3"][0.75][0] / MP3_TABLE2["vit_b"]["time"], 2),
             "flop_bound": 0.84}  # the headline of Table 2, and docs/design.md's FLOP bound
GPU_SECTION = ("<!-- gpu section: written by benchmark.py --suite mp3_table2 -->", "<!-- end of gpu section -->")


# ---------------------------------------------------------------------------------------------- helpers
def _device(args: argparse.Namespace) -> str:
    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def _peak(args: argparse.Namespace, state: dict[str, Any]) -> dict[str, Any]:
    """The matmul peak of this run, measured once: the best GEMM rate over a few sizes and repeats (one 2048 GEMM
    x 5 on this shared 2-core machine read ~118 GFLOP/s, below what a ViT-S training step then achieved)."""
    if "matmul_peak" not in state:
        device = _device(args)
        sizes = args.matmul_size or ([4096, 8192] if device == "cuda" else [1024, 2048, 3072])
        dtype = torch.bfloat16 if args.amp == "bf16" else torch.float32  # the peak of the precision measured
        rows = [matmul_peak(size=n, repeats=args.matmul_repeats, device=device, dtype=dtype) for n in sizes]
        best = max(rows, key=lambda r: r["gflops"])
        state["matmul_peak"] = {**best, "gflops_per_size": {r["size"]: r["gflops"] for r in rows}}
        print(json.dumps(state["matmul_peak"]))
    return state["matmul_peak"]


def _setting(preset: str, img_size: int | None, in_chans: int | None, widths: str | None
             ) -> tuple[int, int, str]:
    """Image size, channels and decoder widths: the 32 px presets default to the study (1 channel, study widths),
    others to their own size and channels with the papers' widths."""
    config = PRESETS[preset]
    small = (img_size or config.img_size) <= 32
    return (img_size or config.img_size, in_chans or (1 if small else config.in_chans),
            widths or ("study" if small else "paper"))


def _run_objectives(args: argparse.Namespace, state: dict[str, Any], *, preset: str, img_size: int | None,
                    in_chans: int | None, widths: str | None, batch: int, repeats: int, warmup: int,
                    memory_steps: int, compile_names: list[str],
                    exclude: tuple[str, ...] = (), amp: str = "no", num_classes: int = 10,
                    mp3_etas: tuple[float, ...] = MP3_ETAS, mae_ratios: tuple[float, ...] = (),
                    only: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    img_size, in_chans, widths = _setting(preset, img_size, in_chans, widths)
    device = _device(args)
    variants = dict(mp3_etas=mp3_etas, mae_ratios=mae_ratios)
    builders = default_objectives(preset, in_chans=in_chans, img_size=img_size, widths=widths,
                                  num_classes=num_classes, **variants)
    builders = {k: v for k, v in builders.items() if k not in exclude and (not only or k in only)}
    if args.objectives:
        unknown = sorted(set(args.objectives) - set(builders))
        if unknown:
            raise SystemExit(f"--objectives: unknown {unknown}; known: {sorted(builders)}")
        builders = {k: v for k, v in builders.items() if k == "supervised" or k in args.objectives}
    for name in compile_names:
        if name not in builders:
            raise SystemExit(f"--compile: unknown objective {name!r}; known: {sorted(builders)}")
        builders[f"{name}+compile"] = lambda build=builders[name]: torch.compile(build())
    setting = f"{preset}, {in_chans} x {img_size} px, batch {batch}, {widths} widths" + (
        f", {amp} autocast" if amp != "no" else "")
    print(f"objectives: {setting}", flush=True)
    rows = step_times(builders, batch=batch, repeats=repeats, warmup=warmup, device=device,
                      peak_gflops=_peak(args, state)["gflops"], amp=amp, num_classes=num_classes)
    for row in rows:
        name = row["name"].split("/", 1)[1]
        row.update(setting=setting, preset=preset, img_size=img_size, in_chans=in_chans, widths=widths)
        if memory_steps and not name.endswith("+compile"):  # the same shapes as their eager rows
            memory = isolated_step_memory(name, preset=preset, in_chans=in_chans, img_size=img_size,
                                          widths=widths, batch=batch, steps=memory_steps, device=device,
                                          amp=amp, num_classes=num_classes, **variants)
            row.update({k: v for k, v in memory.items() if k.endswith("_mb")})
        print(json.dumps(row), flush=True)
    return rows


# ---------------------------------------------------------------------------------------------- suites
def mp3_table2_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    """MP3 Table 2: the supervised ViT-B step vs MP3 at each eta and MAE at each ratio, same run, same batch.
    Memory: CUDA ``max_memory_allocated`` of a fresh process per objective (the RSS the steps added on a CPU)."""
    preset = args.preset if args.preset != STUDY["preset"] else "vit_base"
    args.amp = args.amp or "bf16"
    etas, ratios = tuple(args.mp3_etas), tuple(args.mae_ratios)
    only = ("supervised", *(f"mp3_eta{e:g}" for e in etas), *(f"mae_ratio{r:g}" for r in ratios))
    rows = _run_objectives(args, state, preset=preset, img_size=args.img_size, in_chans=args.in_chans,
                           widths=args.widths, batch=args.batch, repeats=args.repeats, warmup=args.warmup,
                           memory_steps=args.memory_steps,
                           compile_names=list(only) if args.table2_compile else [], amp=args.amp,
                           num_classes=1000, mp3_etas=etas, mae_ratios=ratios, only=only)
    compiled = {r["name"]: r for r in rows if r["name"].endswith("+compile")}
    if compiled:  # torch.compile'd rows against the compiled supervised step (same run)
        base_ms = compiled["pretrain_step/supervised+compile"]["step_ms"]
        for row in compiled.values():
            row["time_vs_supervised"] = round(row["step_ms"] / base_ms, 3)
    memory_key = "cuda_peak_mb" if any("cuda_peak_mb" in r for r in rows) else "step_rss_mb"
    base = next(r for r in rows if r["name"].endswith("/supervised"))
    vit_b = MP3_TABLE2["vit_b"]
    for row in rows:
        name = row["name"].split("/", 1)[1].removesuffix("+compile")
        method, _, value = name.partition("_eta") if name.startswith("mp3") else name.partition("_ratio")
        ratio = float(value) if value else None
        row.update(suite="mp3_table2", masking_ratio=ratio if ratio is not None else "-", memory_basis=memory_key)
        if memory_key in row and base.get(memory_key):
            row["memory_vs_supervised"] = round(row[memory_key] / base[memory_key], 3)
        if ratio is None:  # the baseline
            row["paper_time_ratio"] = row["paper_memory_ratio"] = 1.0
        elif ratio in MP3_TABLE2.get(method, {}):
            paper = MP3_TABLE2[method][ratio]
            row["paper_time_ratio"] = round(paper[0] / vit_b["time"], 2) if paper else "OOM"
            row["paper_memory_ratio"] = round(paper[1] / vit_b["memory"], 2) if paper else "OOM"
    return rows


def saved_bytes_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    """MP3 Table 2's memory column without a GPU: activation bytes saved for backward per sample (saved-tensor
    hooks, GPU autocast dtypes under --amp bf16) of MP3 at --mp3-etas vs the supervised step, ViT-B/16 at 224 px
    (--preset to change), with each attention kernel (--kernels)."""
    from patchplace.objectives.benchmark import saved_bytes_table

    preset = args.preset if args.preset != STUDY["preset"] else "vit_base"
    rows = saved_bytes_table(preset, tuple(args.mp3_etas), kernels=tuple(args.kernels), amp=args.amp or "bf16",
                             in_chans=args.in_chans or (1 if preset.startswith("vit_cpu") else 3),
                             num_classes=1000, device=args.device or "cpu")
    for row in rows:
        paper = MP3_TABLE2["mp3"].get(row["eta"]) if row["eta"] is not None else None
        row.update(suite="saved_bytes", preset=preset, amp=args.amp or "bf16",
                   paper_memory_ratio=round(paper[1] / MP3_TABLE2["vit_b"]["memory"], 2) if paper else
                   (1.0 if row["eta"] is None else "-"), eta=row["eta"] if row["eta"] is not None else "-")
        print(json.dumps(row), flush=True)
    return rows


def matmul_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**_peak(args, state), "suite": "matmul"}]


def objectives_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    rows = _run_objectives(args, state, preset=args.preset, img_size=args.img_size, in_chans=args.in_chans,
                           widths=args.widths, batch=args.batch, repeats=args.repeats, warmup=args.warmup,
                           memory_steps=args.memory_steps, compile_names=args.compile,
                           amp=args.amp or "no")
    return [{**row, "suite": "objectives"} for row in rows]


def masks_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for preset, batch in ((STUDY["preset"], STUDY["batch"]), ("vit_small", args.vits_batch)):
        side = PRESETS[preset].img_size // PRESETS[preset].patch_size  # 8 x 8 (32 px), 14 x 14 (224 px)
        for row in mask_times((side, side), batch, repeats=args.mask_repeats):
            rows.append({**row, "preset": preset, "suite": "masks"})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _kornia_crop() -> dict[str, Any]:
    """kornia's batched crop-and-resize as an augment_throughput candidate, when kornia is installed (it is not a
    dependency: it was measured to choose the in-memory path's sampler)."""
    try:
        from kornia.geometry.transform import crop_and_resize
    except ImportError:
        return {}

    def build(padded, top, left, h, w):
        corners = torch.stack([torch.stack([left, top], 1), torch.stack([left + w - 1, top], 1),
                               torch.stack([left + w - 1, top + h - 1], 1), torch.stack([left, top + h - 1], 1)],
                              1).float()
        side = padded.shape[-1]
        return lambda: crop_and_resize(padded, corners, (side, side))

    return {"kornia crop_and_resize (bilinear)": build}


def data_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    if not (args.shards / "manifest.json").is_file():
        print(f"data: no shards at {args.shards} (python data/fashion_mnist.py --out shards/fashion_mnist): "
              "shard reads skipped", flush=True)
    else:
        for workers in args.workers:
            rows.append(shard_read_throughput(args.shards, num_workers=workers, batch_size=args.loader_batch,
                                              max_samples=args.max_samples, pad_to=args.pad_to))
            print(json.dumps(rows[-1]), flush=True)
    for row in augment_throughput(batch_size=args.loader_batch, pad_to=args.pad_to, device=_device(args),
                                  extra=_kornia_crop()):
        rows.append(row)
        print(json.dumps(row), flush=True)
    rows.append(mfcc_throughput(batch_size=64, batches=args.mfcc_batches))
    print(json.dumps(rows[-1]), flush=True)
    return [{**row, "suite": "data"} for row in rows]


def models_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    presets = [(args.preset, args.batch)] if args.suite != "all" else [(STUDY["preset"], STUDY["batch"]),
                                                                         ("vit_small", args.vits_batch)]
    for preset, batch in presets:
        c = PRESETS[preset]
        img = args.img_size if (args.suite != "all" and args.img_size) else c.img_size
        for eta in args.etas:
            row = context_attention(eta=eta, batch=batch, num_tokens=(img // c.patch_size) ** 2, dim=c.embed_dim,
                                    num_heads=c.num_heads)
            rows.append({**row, "preset": preset, "suite": "models"})
            print(json.dumps(rows[-1]), flush=True)
    return rows


ONNX_GRAPHS = ("plain", "optimized", "int8")  # before: the plain graph on a default session; after: the other two


def _onnx_sessions(checkpoint: Path, out: Path, threads: int) -> tuple[dict[str, Any], dict[str, Any], float]:
    """Sessions on the plain graph (a default ONNX Runtime session, as before this optimization), the optimized
    graph and its int8 variant (both through ``onnx_session``), with ``threads`` intra-op threads each; -> (sessions,
    the optimized export's ``graph`` record, its export seconds)."""
    import onnxruntime as ort

    from patchplace.export import export_checkpoint, onnx_session
    from patchplace.export.exporter import quantize_int8

    export_checkpoint(checkpoint, out / "plain.onnx", optimize=False)
    start = time.perf_counter()
    graph = export_checkpoint(checkpoint, out / "optimized.onnx")["graph"]
    export_s = time.perf_counter() - start
    sessions = {"optimized": onnx_session(out / "optimized.onnx", threads=threads),
                "int8": onnx_session(quantize_int8(out / "optimized.onnx"), threads=threads)}
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    sessions["plain"] = ort.InferenceSession(str(out / "plain.onnx"), options,
                                             providers=sessions["optimized"].get_providers())
    return sessions, graph, export_s


def onnx_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    """Export a randomly initialised classifier (weights do not change the latency) and time PyTorch eager, the plain
    ONNX graph (before), ONNX Runtime's optimized graph and its int8 variant (after) in one run, same threads."""
    import onnxruntime as ort

    from patchplace.export.evaluate import time_runners
    from patchplace.export.exporter import Classifier
    from patchplace.models import create_model, save_pretrained

    img_size, in_chans, _ = _setting(args.onnx_preset, None, None, None)
    torch.manual_seed(0)
    backbone = create_model(args.onnx_preset, in_chans=in_chans, img_size=img_size, num_classes=10,
                            pos_embed="learned").eval()
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = save_pretrained(backbone, Path(tmp) / "checkpoint", metadata={"method": "random-init"})
        sessions, graph, export_s = _onnx_sessions(checkpoint, Path(tmp), threads)
        runners = {"pytorch": Classifier(backbone), **{
            name: (lambda x, s=sessions[name]: s.run(None, {"pixels": x.numpy()})) for name in ONNX_GRAPHS}}
        timings = time_runners(runners, (in_chans, img_size, img_size), tuple(args.onnx_batches), args.onnx_repeats)
    fused = ", ".join(f"{op} x{n}" for op, n in graph.get("fused", {}).items()) or f"none ({graph.get('reason')})"
    rows = []
    for bs in args.onnx_batches:
        t = {name: timings[f"{name}/batch{bs}"] for name in ("pytorch", *ONNX_GRAPHS)}
        row = {"name": f"inference/{args.onnx_preset}/batch{bs}", "batch": bs,
               "torch_p50_ms": t["pytorch"]["p50_ms"], "torch_p95_ms": t["pytorch"]["p95_ms"],
               "torch_images_per_s": t["pytorch"]["images_per_s"]}
        for name in ONNX_GRAPHS:
            row.update({f"{name}_p50_ms": t[name]["p50_ms"], f"{name}_p95_ms": t[name]["p95_ms"],
                        f"{name}_images_per_s": t[name]["images_per_s"],
                        f"{name}_speedup": round(t["pytorch"]["p50_ms"] / t[name]["p50_ms"], 2)})
        rows.append({**row, "optimized_vs_plain": round(t["plain"]["p50_ms"] / t["optimized"]["p50_ms"], 2),
                     "fused": fused, "threads": threads, "input": f"{in_chans} x {img_size} px",
                     "export_s": round(export_s, 1), "onnxruntime": ort.__version__,
                     "providers": sessions["optimized"].get_providers()[0], "repeats": args.onnx_repeats,
                     "suite": "onnx"})
        print(json.dumps(rows[-1]), flush=True)
    return rows


PIPELINE_PATHS = ("pure_step", "memory", "streaming")


class RepeatedBatch:
    """The pipelines suite's "pure step" data source: the first batch of a reader, on the training device, served
    again and again. The training loop (Accelerate, optimizer, schedule, EMA, logging) with the data path taken out,
    so end-to-end samples/s over these samples/s is what the data path costs."""

    def __init__(self, reader: Any, batch_size: int, device: torch.device) -> None:
        self.reader = reader
        first = next(iter(reader.batches(batch_size, epoch=0)))
        self.batch = [t.to(device) if torch.is_tensor(t) else t for t in first]

    def __getattr__(self, name: str) -> Any:  # manifest, transform, skipped, num_batches, ... of the real reader
        return getattr(self.reader, name)

    def __len__(self) -> int:
        return len(self.reader)

    def batches(self, batch_size: int, epoch: int, skip: int = 0):
        for _ in range(skip, self.reader.num_batches(batch_size)):
            yield self.batch


def _pure_step_data(build_data):
    """``engine.build_data`` whose train reader is a :class:`RepeatedBatch` (a streaming reader without workers
    underneath, so that it starts at once)."""
    def build(cfg, accelerator, seed, augment=True, split_train=True):
        data = build_data(cfg, accelerator, seed, augment=augment, split_train=split_train)
        data.train = RepeatedBatch(data.train, cfg.batch_size, accelerator.device)
        data.path = {**data.path, "train": "pure_step"}
        return data
    return build


def pipelines_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    """End-to-end samples/s of the Fashion-MNIST pretraining configs through pretrain.py, per data path: in memory
    (batched augmentation on the training device), streaming (shards + DataLoader workers + timm's per-sample
    transform), and the same training loop fed one repeated on-device batch (pure step). ``end_to_end_ratio`` =
    a path's samples/s / the pure step's, from the same run; the three are alternated ``--pipelines-repeats`` times
    and medians reported. Rates exclude startup (reading the split, spawning workers, the first step: logged as
    startup_s, reported apart)."""
    import statistics

    import engine
    import pretrain

    if not (args.shards / "manifest.json").is_file():
        print(f"pipelines: no shards at {args.shards}: skipped", flush=True)
        return []
    configs = Path(__file__).parent / "configs"
    val = args.shards.parent / "test" if (args.shards.parent / "test" / "manifest.json").is_file() else args.shards
    methods = args.methods or ["supervised", "mp3", "droppos", "mae"]
    preset = args.pipelines_preset
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    build_data = engine.build_data
    for _ in range(args.pipelines_repeats):
        for method in methods:
            for path in PIPELINE_PATHS:
                overrides = [f"data.train={args.shards}", f"data.val={val}", f"optim.max_steps={args.steps}",
                             f"data.batch_size={args.pipelines_batch}", "run.tensorboard=false",
                             f"run.log_every={args.steps}", "run.checkpoint_every=0",
                             f"data.in_memory={'true' if path == 'memory' else 'false'}",
                             f"data.num_workers={0 if path == 'pure_step' else args.pipelines_workers}",
                             *([f"model.preset={preset}"] if preset else []), *args.pipelines_overrides]
                engine.build_data = _pure_step_data(build_data) if path == "pure_step" else build_data
                try:
                    with tempfile.TemporaryDirectory() as tmp:
                        code = pretrain.main(["--config", str(configs / f"{method}_fashion_mnist.yaml"),
                                              f"run.output={tmp}", *overrides])
                        if code != 0:
                            raise SystemExit(f"pipelines: {method} ({path}) failed")
                        last = [r for r in map(json.loads, (Path(tmp) / "log.jsonl").read_text().splitlines())
                                if "loss" in r][-1]  # the last training step (pretraining then logs its validation)
                finally:
                    engine.build_data = build_data
                assert last["data"]["train"] == path, last["data"]
                runs.setdefault((method, path), []).append(last)
                print(json.dumps({"method": method, "path": path, "samples_per_s": last["samples_per_s"],
                                  "startup_s": last["startup_s"], "data_share": last["data_share"]}), flush=True)
    rows = []
    for method in methods:
        pure = statistics.median(r["samples_per_s"] for r in runs[(method, "pure_step")])
        for path in PIPELINE_PATHS:
            logs = runs[(method, path)]
            rate = statistics.median(r["samples_per_s"] for r in logs)
            rows.append({"name": f"train/{method}", "path": path, "samples_per_s": round(rate, 1),
                         "runs": [r["samples_per_s"] for r in logs],
                         "end_to_end_ratio": round(rate / pure, 3),
                         "startup_s": round(statistics.median(r["startup_s"] for r in logs), 1),
                         "data_share": round(statistics.median(r["data_share"] for r in logs), 4),
                         "steps": args.steps, "batch": args.pipelines_batch,
                         "num_workers": args.pipelines_workers if path == "streaming" else 0,
                         "preset": preset or "config's", "threads": torch.get_num_threads(), "suite": "pipelines"})
    return rows


ANCHOR_RECIPE = ["finetune.mixup=0.0", "finetune.cutmix=0.0", "optim.layer_decay=null", "data.scale=[0.8, 1.0]"]


def _plain_timm_loop(cfg: Any, epochs: float, seed: int) -> dict[str, Any]:
    """A plain timm training loop: timm's VisionTransformer built from the preset's config, timm's AdamW (no weight
    decay on biases / norms) and label-smoothing loss, linear warm-up + cosine, fed the same in-memory split and
    batched augmentation as ours. -> test top-1 and training samples/s."""
    import math

    from timm.loss import LabelSmoothingCrossEntropy
    from timm.models.vision_transformer import VisionTransformer
    from timm.optim import create_optimizer_v2

    from patchplace.data.batched import build_batched_transform
    from patchplace.data.memory import InMemorySplit, MemoryReader
    from patchplace.models import create_model
    from patchplace.models.timm_interop import timm_kwargs

    torch.manual_seed(seed)
    d, o, f = cfg.data, cfg.optim, cfg.finetune
    train_split, test_split = InMemorySplit.load(d.train, num_workers=d.num_workers), InMemorySplit.load(d.val)
    options = dict(pad_to=d.pad_to, img_size=d.img_size, scale=d.scale, hflip=d.hflip, re_prob=d.re_prob)
    train = MemoryReader(train_split, build_batched_transform(train_split.manifest, True, **options), seed=seed)
    test = MemoryReader(test_split, build_batched_transform(test_split.manifest, False, pad_to=d.pad_to,
                                                           img_size=d.img_size), shuffle=False)
    config = create_model(cfg.model.preset, in_chans=int(train_split.manifest.info.get("channels", 1)),
                          num_classes=train_split.manifest.num_classes).config
    model = VisionTransformer(**timm_kwargs(config), drop_path_rate=f.drop_path)
    optimizer = create_optimizer_v2(model, "adamw", lr=o.lr, weight_decay=o.weight_decay, betas=o.betas)
    per_epoch = train.num_batches(d.batch_size)
    total = max(1, round(epochs * per_epoch))
    warmup = round(o.warmup_fraction * total)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / warmup if s < warmup else (
        o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total - warmup)))))
    criterion = LabelSmoothingCrossEntropy(f.label_smoothing)
    step, start, epoch = 0, time.perf_counter(), 0
    model.train()
    while step < total:
        for x, y in train.batches(d.batch_size, epoch):
            loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if o.clip_grad:
                torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad)
            optimizer.step()
            schedule.step()
            step += 1
            if step >= total:
                break
        epoch += 1
    seconds = time.perf_counter() - start
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in test.batches(256, epoch=0):
            correct += int((model(x).argmax(1) == y).sum())
    return {"top1": correct / len(test), "samples_per_s": round(total * d.batch_size / seconds, 1), "steps": total}


def anchor_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    """The supervised baseline (finetune.py from scratch: Accelerate, our backbone, parameter groups, schedule,
    checkpoints, evaluation) against a plain timm ViT loop of the same size on the same data, epochs and recipe
    (:func:`_plain_timm_loop`), per --anchor-seeds. Ours must be at least as accurate."""
    import finetune

    if not (args.shards / "manifest.json").is_file():
        print(f"anchor: no shards at {args.shards}: skipped", flush=True)
        return []
    val = args.shards.parent / "test" if (args.shards.parent / "test" / "manifest.json").is_file() else args.shards
    config = str(Path(__file__).parent / "configs" / "finetune_fashion_mnist.yaml")
    preset, batch = args.pipelines_preset or STUDY["preset"], args.pipelines_batch
    rows = []
    for seed in args.anchor_seeds:
        overrides = [f"data.train={args.shards}", f"data.val={val}", f"model.preset={preset}",
                     f"optim.epochs={args.anchor_epochs}", f"data.batch_size={batch}",
                     f"run.seed={seed}", "run.tensorboard=false", "run.checkpoint_every=0", *ANCHOR_RECIPE,
                     *args.pipelines_overrides]
        with tempfile.TemporaryDirectory() as tmp:
            if finetune.main(["--config", config, f"run.output={tmp}", *overrides]) != 0:
                raise SystemExit("anchor: finetune.py failed")
            log = [json.loads(line) for line in (Path(tmp) / "log.jsonl").read_text().splitlines()]
            cfg = load(finetune.FinetuneConfig, config, overrides)
        ours = {"top1": [r for r in log if "eval" in r][-1]["eval"]["top1"],
                "samples_per_s": [r for r in log if "samples_per_s" in r][-1]["samples_per_s"]}
        plain = _plain_timm_loop(cfg, args.anchor_epochs, seed)
        for name, result in (("patchplace supervised (finetune.py)", ours), ("plain timm loop", plain)):
            rows.append({"name": f"anchor/{name}", "top1": round(result["top1"], 4),
                         "samples_per_s": result["samples_per_s"], "epochs": args.anchor_epochs, "seed": seed,
                         "preset": preset, "batch": batch, "suite": "anchor"})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def anchor_summary(rows: list[dict[str, Any]]) -> str:
    """Mean top-1 of both loops and their seed-paired difference (ours - plain), in points."""
    ours = {r["seed"]: r["top1"] for r in rows if r["name"].startswith("anchor/patchplace")}
    plain = {r["seed"]: r["top1"] for r in rows if r["name"] == "anchor/plain timm loop"}
    seeds = sorted(set(ours) & set(plain))
    if not seeds:
        return "No seed has both loops."
    diff = [100 * (ours[s] - plain[s]) for s in seeds]
    spread = f" ± {statistics.stdev(diff):.1f}" if len(diff) > 1 else ""
    mean_ours, mean_plain = (100 * statistics.mean(d[s] for s in seeds) for d in (ours, plain))
    return (f"Seeds {', '.join(map(str, seeds))}: ours {mean_ours:.2f}%, plain timm loop {mean_plain:.2f}%; "
            "ours - plain "
            f"{statistics.mean(diff):+.2f}{spread} pt (seed-paired). Both: the study's supervised recipe "
            "(AdamW without decay on biases / norms, label smoothing, warm-up + cosine, no Mixup / CutMix / layer "
            "decay, crops of area [0.8, 1]) on the same in-memory split and batched augmentation; top-1 on the "
            "whole test split.")


DDP_SETTINGS = (("1 process", 1, None), ("2 processes", 2, False), ("2 processes, find_unused", 2, True))
# MJP with the jigsaw on every step, so that DDP can run it without find_unused_parameters (the cost baseline).
MJP_EVERY_STEP = ["objective.apply_prob=1.0", "objective.warmup_fraction=0.0"]


def _pretrain_command(processes: int) -> tuple[list[str], dict[str, str]]:
    """The README's commands: plain python for one process, ``accelerate launch --multi_gpu`` (gloo on CPU) for
    more; the cores are shared out between the processes."""
    script = str(Path(__file__).parent / "pretrain.py")
    threads = max(1, (os.cpu_count() or 1) // processes)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if processes == 1:
        return [sys.executable, script], env
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    return [accelerate, "launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0", script], \
        {**env, "ACCELERATE_USE_CPU": "true"}


def ddp_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    """Samples/s of pretrain.py with one process vs two (gloo, same global batch, the cores split between them),
    and what DDP's ``find_unused_parameters`` costs: two processes with it off vs on, same run, alternated
    ``--ddp-repeats`` times (medians). MJP runs its jigsaw on every step here, so that it can run with it off."""
    import statistics

    if not (args.shards / "manifest.json").is_file():
        print(f"ddp: no shards at {args.shards}: skipped", flush=True)
        return []
    preset = args.pipelines_preset or STUDY["preset"]
    batch = args.pipelines_batch or STUDY["batch"]
    configs = Path(__file__).parent / "configs"
    rates: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.ddp_repeats):
        for method in args.methods or ["supervised", "mp3", "mjp"]:
            for label, processes, find_unused in DDP_SETTINGS:
                command, env = _pretrain_command(processes)
                with tempfile.TemporaryDirectory() as tmp:
                    overrides = [f"data.train={args.shards}", f"model.preset={preset}",
                                 f"data.batch_size={batch // processes}", f"optim.max_steps={args.steps}",
                                 "data.num_workers=0", "run.tensorboard=false", f"run.log_every={args.steps}",
                                 f"run.output={tmp}", *(MJP_EVERY_STEP if method == "mjp" else []),
                                 *([f"run.find_unused_parameters={str(find_unused).lower()}"]
                                   if find_unused is not None else [])]
                    done = subprocess.run([*command, "--config", str(configs / f"{method}_fashion_mnist.yaml"),
                                           *overrides], env=env, capture_output=True, text=True)
                    if done.returncode != 0:
                        raise SystemExit(f"ddp: {method} ({label}) failed:\n{done.stderr[-3000:]}")
                    last = [r for r in map(json.loads, (Path(tmp) / "log.jsonl").read_text().splitlines())
                            if "loss" in r][-1]  # the last training step
                assert last["world_size"] == processes
                rates.setdefault((method, label), []).append(last["samples_per_s"])
                print(json.dumps({"method": method, "setting": label, "samples_per_s": last["samples_per_s"]}),
                      flush=True)
    rows = []
    for (method, label), values in rates.items():
        rows.append({"name": f"ddp/{method}", "ddp_setting": label,
                     "samples_per_s": round(statistics.median(values), 1), "runs": values, "global_batch": batch,
                     "steps": args.steps, "preset": preset, "suite": "ddp"})
    for row in rows:
        one = rates[(row["name"][4:], DDP_SETTINGS[0][0])]
        off = rates[(row["name"][4:], DDP_SETTINGS[1][0])]
        row["vs_one_process"] = round(row["samples_per_s"] / statistics.median(one), 3)
        if row["ddp_setting"] == DDP_SETTINGS[2][0]:
            row["vs_find_unused_off"] = round(row["samples_per_s"] / statistics.median(off), 3)
    return rows


def data_vs_training(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Loader samples/s (each worker count) against the samples/s the study ViT's training consumes: supervised,
    and the fastest objective (the hardest to feed). Headroom = loader / consumption (> 1: the loader keeps up when
    it has cores of its own; in training both share them, see the pipelines suite's data-wait share)."""
    loaders = [r for r in rows if r.get("suite") == "data" and r["name"].startswith("shard_read")]
    training = {r["name"].split("/", 1)[1]: r["samples_per_s"] for r in rows if r.get("suite") == "objectives"
                and r.get("preset") == STUDY["preset"] and not r["name"].endswith(("_before", "+compile"))}
    if not loaders or "supervised" not in training:
        return []
    fastest = max(training, key=training.get)
    return [{"name": f"data_vs_training/workers={loader['num_workers']}", "num_workers": loader["num_workers"],
             "loader_samples_per_s": loader["samples_per_s"], "supervised_samples_per_s": training["supervised"],
             "headroom_supervised": round(loader["samples_per_s"] / training["supervised"], 2),
             "fastest_objective": fastest, "fastest_samples_per_s": training[fastest],
             "headroom_fastest": round(loader["samples_per_s"] / training[fastest], 2), "suite": "data_vs_training"}
            for loader in loaders]


def all_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    seconds = state.setdefault("seconds", {})

    def part(name: str, fn) -> None:
        start = time.perf_counter()
        rows.extend(fn())
        seconds[name] = round(time.perf_counter() - start, 1)
        print(f"== {name}: {seconds[name]} s", flush=True)

    part("matmul", lambda: matmul_suite(args, state))
    part("objectives/study_vit", lambda: [{**r, "suite": "objectives"} for r in _run_objectives(
        args, state, **STUDY, widths="study", repeats=args.repeats, warmup=args.warmup,
        memory_steps=args.memory_steps, compile_names=args.compile)])
    part("objectives/vit_small", lambda: [{**r, "suite": "objectives"} for r in _run_objectives(
        args, state, preset="vit_small", img_size=224, in_chans=3, widths="paper", batch=args.vits_batch,
        repeats=args.vits_repeats, warmup=1, memory_steps=args.memory_steps, compile_names=[],
        exclude=("stop_noema",))])  # the EMA's cost is shown on the study ViT; saves ~1 min here
    part("masks", lambda: masks_suite(args, state))
    part("data", lambda: data_suite(args, state))
    rows.extend(data_vs_training(rows))
    part("models", lambda: models_suite(args, state))
    part("onnx", lambda: onnx_suite(args, state))
    part("pipelines", lambda: pipelines_suite(args, state))
    return rows


SUITES = {"matmul": matmul_suite, "objectives": objectives_suite, "masks": masks_suite, "data": data_suite,
          "models": models_suite, "onnx": onnx_suite, "pipelines": pipelines_suite, "mp3_table2": mp3_table2_suite,
          "ddp": ddp_suite, "anchor": anchor_suite, "saved_bytes": saved_bytes_suite, "all": all_suite}


# ---------------------------------------------------------------------------------------------- markdown + figure
TABLES = {  # suite -> (title, [(column header, row key)])
    "matmul": ("fp32 matmul peak", [("benchmark", "name"), ("best GFLOP/s", "gflops"),
                                    ("median GFLOP/s", "median_gflops"), ("device", "device")]),
    "objectives": ("Pretraining step per objective (forward + backward + AdamW), relative to supervised", [
        ("objective", "name"), ("step ms", "step_ms"), ("time ratio", "time_vs_supervised"),
        ("FLOP ratio", "flop_ratio"), ("samples/s", "samples_per_s"), ("GFLOP/sample", "gflops_per_sample"),
        ("achieved GFLOP/s", "achieved_gflops"), ("of peak", "peak_fraction"), ("peak RSS MB", "peak_rss_mb"),
        ("steps' RSS MB", "step_rss_mb"), ("CUDA peak MB", "cuda_peak_mb")]),
    "masks": ("Mask generation per batch (before / after: the optimization's one-run comparison, kept from the run "
              "that made it)", [("generator", "name"), ("ms", "ms"), ("before ms", "before_ms"),
                                ("after ms", "after_ms"), ("speed-up", "speedup")]),
    "data": ("Data path", [("benchmark", "name"), ("samples/s", "samples_per_s"), ("clips/s", "clips_per_s"),
                           ("batch", "batch_size"), ("samples", "samples"), ("seconds", "seconds")]),
    "data_vs_training": ("Data loader samples/s vs what training consumes (study ViT; measured apart — in training "
                         "both share the cores)", [
                             ("loader workers", "num_workers"), ("loader samples/s", "loader_samples_per_s"),
                             ("supervised training samples/s", "supervised_samples_per_s"),
                             ("headroom", "headroom_supervised"), ("fastest objective", "fastest_objective"),
                             ("its samples/s", "fastest_samples_per_s"), ("headroom ", "headroom_fastest")]),
    "models": ("One block fwd + bwd: MP3 context-only K/V vs full attention", [
        ("benchmark", "name"), ("preset", "preset"), ("batch", "batch"), ("tokens", "tokens"),
        ("full ms", "full_ms"), ("context ms", "context_ms"), ("time ratio", "time_vs_full"),
        ("FLOP ratio", "flop_ratio")]),
    "onnx": ("Inference: PyTorch eager vs ONNX Runtime — plain graph (before) vs optimized graph and its int8 "
             "variant (after), same run and threads", [
        ("model / batch", "name"), ("PyTorch p50 ms", "torch_p50_ms"), ("plain p50 ms", "plain_p50_ms"),
        ("optimized p50 ms", "optimized_p50_ms"), ("int8 p50 ms", "int8_p50_ms"),
        ("plain speed-up", "plain_speedup"), ("optimized speed-up", "optimized_speedup"),
        ("int8 speed-up", "int8_speedup"), ("optimized / plain", "optimized_vs_plain"),
        ("optimized images/s", "optimized_images_per_s"), ("threads", "threads"), ("fused", "fused"),
        ("ORT provider", "providers")]),
    "mp3_table2": ("GPU: MP3 Table 2 (step time and peak memory vs the supervised ViT, same run)", [
        ("objective", "name"), ("masking ratio", "masking_ratio"), ("step ms", "step_ms"),
        ("time ratio", "time_vs_supervised"), ("paper time ratio", "paper_time_ratio"),
        ("CUDA peak MB", "cuda_peak_mb"), ("memory ratio", "memory_vs_supervised"),
        ("paper memory ratio", "paper_memory_ratio"), ("FLOP ratio", "flop_ratio"),
        ("samples/s", "samples_per_s"), ("achieved GFLOP/s", "achieved_gflops"), ("device", "device")]),
    "saved_bytes": ("MP3 Table 2's memory, device-independent: activation bytes saved for backward per sample", [
        ("objective", "name"), ("attention kernel", "kernel"), ("eta", "eta"), ("MiB / sample", "mib_per_sample"),
        ("vs supervised", "vs_supervised"), ("paper memory ratio", "paper_memory_ratio"), ("preset", "preset"),
        ("autocast", "amp")]),
    "ddp": ("pretrain.py on one process vs two (gloo, same global batch), and DDP's find_unused_parameters", [
        ("method", "name"), ("setting", "ddp_setting"), ("samples/s (median)", "samples_per_s"), ("runs", "runs"),
        ("vs 1 process", "vs_one_process"), ("vs find_unused off", "vs_find_unused_off"),
        ("global batch", "global_batch"), ("steps", "steps"), ("preset", "preset")]),
    "anchor": ("Anchor: our supervised baseline vs a plain timm ViT loop (same size, data, epochs, recipe)", [
        ("training", "name"), ("test top-1", "top1"), ("samples/s", "samples_per_s"), ("epochs", "epochs"),
        ("seed", "seed"), ("preset", "preset"), ("batch", "batch")]),
    "pipelines": ("End-to-end pretraining through pretrain.py per data path, vs the same loop on one repeated "
                  "batch (pure step; medians of alternated runs, startup excluded)", [
        ("method", "name"), ("data path", "path"), ("samples/s", "samples_per_s"),
        ("end-to-end ratio", "end_to_end_ratio"), ("runs", "runs"), ("data-wait share", "data_share"),
        ("startup s", "startup_s"), ("batch", "batch"), ("workers", "num_workers"), ("steps", "steps"),
        ("preset", "preset")]),
}


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> list[str]:
    columns = [(h, k) for h, k in columns if any(k in r for r in rows)]
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + " --- |" * len(columns)]
    for r in rows:
        cells = []
        for _, key in columns:
            value = r.get(key, "")
            cells.append(value.split("/", 1)[1] if key == "name" and isinstance(value, str) and "/" in value
                         else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def to_markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    hardware = f"_Hardware: {meta['hardware']}"
    if meta.get("matmul_peak"):
        dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(meta["matmul_peak"].get("name", "/float32").split("/")[1])
        hardware += f"; {dtype} matmul peak {meta['matmul_peak']['gflops']} GFLOP/s_"
    else:
        hardware += "_"
    lines = [f"# Benchmarks (`--suite {meta['suite']}`)", ""]
    for suite, (title, columns) in TABLES.items():
        chunk = [r for r in rows if r.get("suite") == suite]
        if not chunk:
            continue
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in chunk:
            groups.setdefault(r.get("setting", ""), []).append(r)
        for setting, group in groups.items():
            lines += [f"## {title}" + (f" — {setting}" if setting else ""), "", hardware, ""]
            lines += _table(group, columns)
            lines.append("")
            if suite == "objectives":
                lines += ["Time ratio: median step time / the supervised step's in the same rotated round-robin "
                          "run. FLOP ratio: matmul FLOPs counted from the shapes (3x forward for what gets "
                          "gradients, 1x for no-grad passes). Achieved GFLOP/s = FLOP/sample x batch / step time; "
                          "'of peak' divides by the fp32 matmul peak. Peak RSS: the high-water mark of a fresh "
                          "process that builds only this objective and runs its steps; steps' RSS: what the steps "
                          "added to the RSS of the built model (activations, gradients, AdamW state, allocator "
                          f"caches). MP3 paper (ViT-B): wall-clock ratio {MP3_PAPER['time_ratio']} at eta = "
                          f"{MP3_PAPER['eta']}, FLOP bound ~{MP3_PAPER['flop_bound']}.", ""]
            if suite == "onnx":
                lines += ["plain: the standard-ONNX graph of the training model's attention (`python -m "
                          "patchplace.export --no-optimize`) on a default ONNX Runtime session, as exported before "
                          "the optimizer; optimized: the default export (ONNX Runtime's fused Attention / BiasGelu, "
                          "SkipLayerNormalization split back into Add + LayerNormalization) through `onnx_session`; "
                          "int8: its dynamic-quantized variant (`--quantize`). Speed-up: PyTorch p50 / this p50 in "
                          "the same run; every runner on the same number of threads.", ""]
            if suite == "anchor":
                lines += [anchor_summary(group), ""]
            if suite == "ddp":
                lines += ["samples/s: the last log line of pretrain.py (every step; process start-up excluded), "
                          "median of the alternated runs listed. On one machine the 2 processes share its cores, "
                          "so 2 vs 1 process measures DDP's overhead, not a speed-up. 'vs find_unused off': what "
                          "DDP's find_unused_parameters costs (MJP needs it; here MJP shuffles every step so that "
                          "it can run without). Differences smaller than the spread of the runs are noise.", ""]
            if suite == "saved_bytes":
                lines += ["Bytes of the distinct storages autograd saves for backward in one training forward "
                          "(torch.autograd.graph.saved_tensors_hooks; parameters excluded), batch 2 minus batch 1: "
                          "the activations a step keeps, whatever the device and its allocator. Autocast dtypes "
                          "are GPU autocast's for these ops (LayerNorm fp32, projections bf16, the math kernel's "
                          "softmax fp32). sdpa: the fused kernel (saves q, k, v, output, log-sum-exp); math: the "
                          "materialised softmax of the paper's time (also saves the N x K probabilities). Paper: "
                          "MP3 Table 2's GB per batch over the ViT-B baseline's (A100, batch not stated).", ""]
            if suite == "mp3_table2":
                lines += ["Time / memory ratio: this objective's median step time / peak CUDA memory (a fresh "
                          "process per objective: weights, AdamW state, activations) over the supervised ViT's, "
                          "same run and batch; the forward runs under the stated autocast, AdamW in fp32. Paper: "
                          "MP3 Table 2, seconds per iteration and GB per batch on one A100 over the ViT-B "
                          f"baseline's ({MP3_TABLE2['vit_b']['time']} s, {MP3_TABLE2['vit_b']['memory']} GB; "
                          "its batch size is not stated). FLOP ratio: from the shapes. `+compile` rows: "
                          "torch.compile'd objectives, their time ratio over the compiled supervised step.", ""]
    if meta.get("seconds"):
        lines += ["Seconds per part: " + ", ".join(f"{k} {v}" for k, v in meta["seconds"].items()), ""]
    return "\n".join(lines)


def gpu_section(text: str) -> str:
    """The GPU section (between the :data:`GPU_SECTION` markers) of markdown ``text``; "" if none."""
    start, end = GPU_SECTION
    if start not in text or end not in text:
        return ""
    return text[text.index(start) + len(start): text.index(end)].strip("\n")


def splice_gpu_section(text: str, section_markdown: str) -> str:
    """Markdown ``text`` with its GPU section replaced by ``section_markdown`` (appended when it has none; dropped
    when ``section_markdown`` is empty). Its ``# title`` line is left out of the section."""
    start, end = GPU_SECTION
    if start in text and end in text:
        text = text[: text.index(start)].rstrip("\n") + "\n" + text[text.index(end) + len(end):].lstrip("\n")
    body = "\n".join(line for line in section_markdown.strip("\n").splitlines() if not line.startswith("# "))
    if not body.strip():
        return text
    return text.rstrip("\n") + f"\n\n{start}\n{body.strip()}\n{end}\n"


def plot_objectives(rows: list[dict[str, Any]], path: Path) -> bool:
    """Time ratio vs FLOP ratio per objective, one panel per backbone setting; False when there is nothing."""
    chunk = [r for r in rows if r.get("suite") == "objectives"]
    settings = list(dict.fromkeys(r["setting"] for r in chunk))
    if not settings:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 5), squeeze=False)
    for ax, setting in zip(axes[0], settings, strict=True):
        group = [r for r in chunk if r["setting"] == setting]
        xs, ys = [r["flop_ratio"] for r in group], [r["time_vs_supervised"] for r in group]
        ax.scatter(xs, ys, zorder=3)
        for r, x, y in zip(group, xs, ys, strict=True):
            ax.annotate(r["name"].split("/", 1)[1], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.scatter([MP3_PAPER["flop_bound"]], [MP3_PAPER["time_ratio"]], marker="*", s=120, color="tab:red",
                   zorder=3, label="MP3 paper, eta 0.75 (ViT-B)")
        top = max(xs + ys + [1.0]) * 1.08
        ax.plot([0, top], [0, top], color="gray", lw=0.8, ls="--", label="time ratio = FLOP ratio")
        ax.set(xlim=(0, top), ylim=(0, top), xlabel="FLOP ratio vs supervised (from shapes)",
               ylabel="step time ratio vs supervised (same run)", title=setting)
        ax.title.set_fontsize(9)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--suite", choices=list(SUITES), default="data", metavar="SUITE",
                        help=f"what to measure: {', '.join(SUITES)} (default: data)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: results for --suite all, else runs/benchmark)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--attention", choices=list(ATTENTION_KERNELS), default="sdpa",
                        help="attention kernel of every model: sdpa (fused, default) or math (the materialised "
                             "softmax of the papers' time), e.g. for MP3 Table 2 in its setting")
    parser.add_argument("--update", action="store_true",
                        help="replace this suite's rows in <out>/benchmark.json, keep the other suites' rows")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="objectives / matmul device (default: cuda when available)")
    g = parser.add_argument_group("matmul")
    g.add_argument("--matmul-size", type=int, nargs="+", default=None,
                   help="square GEMM sizes; the best rate is the peak (default 1024 2048 3072 CPU, 4096 8192 CUDA)")
    g.add_argument("--matmul-repeats", type=int, default=10, help="timed GEMMs per size (default: %(default)s)")
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
                   help="saved_bytes: attention kernels to measure (default: both)")
    g.add_argument("--table2-compile", action="store_true",
                   help="mp3_table2: also time torch.compile'd copies (ratios to the compiled supervised step)")
    g = parser.add_argument_group("masks")
    g.add_argument("--mask-repeats", type=int, default=20, help="timed batches per generator (default: 20)")
    g = parser.add_argument_group("data")
    g.add_argument("--shards", type=Path, default=Path("shards/fashion_mnist/train"),
                   help="split read by the data and pipelines suites (default: %(default)s)")
    g.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2], help="DataLoader worker counts")
    g.add_argument("--loader-batch", type=int, default=STUDY["batch"], help="loader batch size (default: 128)")
    g.add_argument("--max-samples", type=int, default=15360, help="stop each read after this many samples "
                   "(default: %(default)s; 0: the whole split)")
    g.add_argument("--pad-to", type=int, default=32, help="image padding used by the transform")
    g.add_argument("--mfcc-batches", type=int, default=20, help="timed MFCC batches of 64 clips")
    g = parser.add_argument_group("onnx")
    g.add_argument("--onnx-preset", default=STUDY["preset"], help="classifier to export (default: %(default)s)")
    g.add_argument("--onnx-batches", type=int, nargs="+", default=[1, 8, 64], help="batch sizes")
    g.add_argument("--onnx-repeats", type=int, default=20, help="timed runs per batch size (default: 20)")
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
    g.add_argument("--ddp-repeats", type=int, default=2,
                   help="ddp: alternated runs of every setting, medians reported (default: %(default)s)")
    return parser


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
            "attention": args.attention,
            "seconds": {**state.get("seconds", {}), "total": round(time.perf_counter() - start, 1)},
            "argv": argv if argv is not None else sys.argv[1:]}
    try:
        import onnxruntime

        meta["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    out.mkdir(parents=True, exist_ok=True)
    if args.update and (out / "benchmark.json").is_file() and args.suite not in ("all", "mp3_table2", "ddp",
                                                                                   "saved_bytes"):
        old = json.loads((out / "benchmark.json").read_text())
        rows = [r for r in old["results"] if r.get("suite") != args.suite] + rows
        seconds = {k: v for k, v in {**old["meta"].get("seconds", {}), args.suite: meta["seconds"]["total"]}.items()
                   if k != "total"}
        meta = {**old["meta"], "seconds": {**seconds, "total": round(sum(seconds.values()), 1)},
                "updated": {args.suite: meta}}
    markdown = to_markdown(rows, meta)
    stem = f"benchmark_{args.suite}" if args.suite in ("mp3_table2", "ddp", "saved_bytes") else "benchmark"
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
