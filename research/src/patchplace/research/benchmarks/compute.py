"""Compute suites: the matmul peak (matmul), every objective's pretraining step against the supervised one
(objectives), mask generation (masks) and MP3's context-only attention block (models)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from patchplace.models import PRESETS
from patchplace.models.benchmark import context_attention, matmul_peak
from patchplace.objectives.benchmark import MP3_ETAS, default_objectives, isolated_step_memory, mask_times, step_times
from patchplace.research.benchmarks.common import STUDY, device_of, image_setting


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
