"""Compute suites: the matmul peak (matmul), every objective's pretraining step against the supervised one
(objectives), mask generation (masks) and MP3's context-only attention block (models).

:func:`context_attention`: forward + backward time of one Transformer block with context-only keys/values at masking
ratio eta (MP3) vs full attention, measured interleaved in the same run, with the FLOP ratio counted from the shapes
beside it (only the K/V projections and the attention matrix shrink, so the bound at eta = 0.75, N = 64, D = 192 is
~0.84). :func:`matmul_peak`: GEMM GFLOP/s of a large square matmul with torch's threads as configured — the
denominator of "achieved FLOP/s as a fraction of the machine's peak"."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from patchplace.models import PRESETS
from patchplace.models.backbone import Block
from patchplace.research.benchmarks.common import STUDY, device_of, image_setting
from patchplace.research.benchmarks.flops import block_flops
from patchplace.research.benchmarks.steps import (
    MP3_ETAS,
    default_objectives,
    isolated_step_memory,
    mask_times,
    step_times,
)


def context_attention(*, batch: int = 128, num_tokens: int = 64, dim: int = 192, num_heads: int = 3,
                      eta: float = 0.75, repeats: int = 15, warmup: int = 3, threads: int | None = None,
                      seed: int = 0) -> dict[str, Any]:
    """Median fwd+bwd seconds per step of a block, full vs context-only K/V; ratio and FLOP ratio."""
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    block = Block(dim, num_heads, 4.0, True, 0.0, 0.0, 0.0, 1e-6)
    x = torch.randn(batch, num_tokens, dim, requires_grad=True)
    m = round((1 - eta) * num_tokens)
    context = torch.rand(batch, num_tokens).argsort(dim=1)[:, :m]

    def step(ctx: torch.Tensor | None) -> float:
        start = time.perf_counter()
        block(x, context_index=ctx).sum().backward()
        seconds = time.perf_counter() - start
        block.zero_grad(set_to_none=True)
        x.grad = None
        return seconds

    for _ in range(warmup):
        step(None), step(context)
    full, ctx_times = [], []
    for _ in range(repeats):  # interleaved, so machine noise hits both alike
        full.append(step(None))
        ctx_times.append(step(context))
    t_full, t_ctx = statistics.median(full), statistics.median(ctx_times)
    return {"name": f"block_fwd_bwd/eta={eta}", "batch": batch, "tokens": num_tokens, "context_tokens": m,
            "dim": dim, "full_ms": round(t_full * 1e3, 2), "context_ms": round(t_ctx * 1e3, 2),
            "time_vs_full": round(t_ctx / t_full, 3),
            "flop_ratio": round(block_flops(num_tokens, m, dim) / block_flops(num_tokens, num_tokens, dim), 3),
            "threads": torch.get_num_threads()}


def matmul_peak(*, size: int = 2048, repeats: int = 5, warmup: int = 2, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, Any]:
    """Best and median GFLOP/s of ``size`` x ``size`` @ ``size`` x ``size`` (2 size^3 FLOPs) over ``repeats`` runs."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    out = torch.empty(size, size, device=device, dtype=dtype)

    def run() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    for _ in range(warmup):
        run()
    rates = [2 * size**3 / run() / 1e9 for _ in range(repeats)]
    return {"name": f"matmul_peak/{str(dtype).removeprefix('torch.')}/{size}", "size": size,
            "gflops": round(max(rates), 1), "median_gflops": round(statistics.median(rates), 1),
            "repeats": repeats, "threads": torch.get_num_threads(), "device": str(device)}


def peak_of(args: argparse.Namespace, state: dict[str, Any]) -> dict[str, Any]:
    """The matmul peak of this run, measured once: the best GEMM rate over a few sizes and repeats (one 2048 GEMM
    x 5 on this shared 2-core machine read ~118 GFLOP/s, below what a ViT-S training step then achieved)."""
    if "matmul_peak" not in state:
        device = device_of(args)
        sizes = args.matmul_size or ([4096, 8192] if device == "cuda" else [1024, 2048, 3072])
        dtype = torch.bfloat16 if args.amp == "bf16" else torch.float32  # the peak of the precision measured
        rows = [matmul_peak(size=n, repeats=args.matmul_repeats, device=device, dtype=dtype) for n in sizes]
        best = max(rows, key=lambda r: r["gflops"])
        state["matmul_peak"] = {**best, "gflops_per_size": {r["size"]: r["gflops"] for r in rows}}
        print(json.dumps(state["matmul_peak"]))
    return state["matmul_peak"]


def run_objectives(args: argparse.Namespace, state: dict[str, Any], *, preset: str, img_size: int | None,
                   in_chans: int | None, widths: str | None, batch: int, repeats: int, warmup: int,
                   memory_steps: int, compile_names: list[str],
                   exclude: tuple[str, ...] = (), amp: str = "no", num_classes: int = 10,
                   mp3_etas: tuple[float, ...] = MP3_ETAS, mae_ratios: tuple[float, ...] = (),
                   only: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    img_size, in_chans, widths = image_setting(preset, img_size, in_chans, widths)
    device = device_of(args)
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
                      peak_gflops=peak_of(args, state)["gflops"], amp=amp, num_classes=num_classes)
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


def matmul_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**peak_of(args, state), "suite": "matmul"}]


def objectives_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    rows = run_objectives(args, state, preset=args.preset, img_size=args.img_size, in_chans=args.in_chans,
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
