"""MP3 Table 2: step time and peak memory of MP3 (and MAE) against the supervised ViT-B on a GPU (mp3_table2),
its memory column on any machine as the bytes a step saves for backward (saved_bytes), and the paper's ratios the
gpu suite sets beside every objective's (:func:`paper_ratios`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from patchplace.research.benchmarks.common import STUDY
from patchplace.research.benchmarks.compute import run_objectives

# MP3 Table 2 (ViT-B on ImageNet-1K, one A100): seconds / iteration and GB / batch per masking ratio; the ViT-B
# baseline is 0.67 s and 33.5 GB (MAE at 0.3 ran out of memory). Ratios = value / the baseline's.
MP3_TABLE2 = {"vit_b": {"time": 0.67, "memory": 33.5},
              "mp3": {0.3: (0.52, 30.0), 0.5: (0.51, 27.4), 0.75: (0.46, 24.2), 0.9: (0.44, 22.3)},
              "mae": {0.3: None, 0.5: (0.57, 35.1), 0.75: (0.47, 28.0), 0.9: (0.41, 24.4)}}
MP3_PAPER = {"eta": 0.75, "time_ratio": round(MP3_TABLE2["mp3"][0.75][0] / MP3_TABLE2["vit_b"]["time"], 2),
             "flop_bound": 0.84}  # the headline of Table 2, and docs/design.md's FLOP bound


FLOP_TRACKING = 0.10  # the tolerance of "time ratio within 10% of the FLOP ratio"


def mp3_table2_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    """MP3 Table 2: the supervised ViT-B step vs MP3 at each eta and MAE at each ratio, same run, same batch, once
    per attention kernel of --kernels (sdpa: fused; math: the materialised softmax of the paper's time). Memory:
    CUDA ``max_memory_allocated`` of a fresh process per objective (the RSS the steps added on a CPU).
    ``time_per_flop``: time ratio / FLOP ratio (1.0: the step costs what its FLOPs say); ``tracks_flops``: within
    FLOP_TRACKING of 1. Every other objective, eager and compiled: the gpu suite (:mod:`.gpu`)."""
    from patchplace.models import get_attention_kernel, set_attention_kernel

    preset = args.preset if args.preset != STUDY["preset"] else "vit_base"
    args.amp = args.amp or "bf16"
    etas, ratios = tuple(args.mp3_etas), tuple(args.mae_ratios)
    only = ("supervised", *(f"mp3_eta{e:g}" for e in etas), *(f"mae_ratio{r:g}" for r in ratios))
    kernels, rows, before = list(dict.fromkeys(args.kernels)), [], get_attention_kernel()
    try:
        for kernel in kernels:
            set_attention_kernel(kernel)
            print(f"mp3_table2: attention kernel {kernel}", flush=True)
            measured = run_objectives(args, state, preset=preset, img_size=args.img_size, in_chans=args.in_chans,
                                      widths=args.widths, batch=args.batch, repeats=args.repeats,
                                      warmup=args.warmup, memory_steps=args.memory_steps, compile_names=[],
                                      amp=args.amp, num_classes=1000, mp3_etas=etas, mae_ratios=ratios, only=only)
            rows += table2_rows(measured, kernel)
    finally:
        set_attention_kernel(before)
    return rows


def paper_ratios(name: str) -> tuple[float | str, float | str]:
    """MP3 Table 2's (time, memory) ratios to the ViT-B baseline for objective label ``name`` (``mp3_eta0.75``,
    ``mae_ratio0.9``; the default ``mae`` is its 0.75): 1.0 for supervised, "OOM" where the paper ran out of
    memory, "-" where the table has no such row."""
    if name == "supervised":
        return 1.0, 1.0
    method, _, value = name.partition("_eta") if name.startswith("mp3") else name.partition("_ratio")
    ratio = float(value) if value else (0.75 if name == "mae" else None)
    if ratio is None or ratio not in MP3_TABLE2.get(method, {}):
        return "-", "-"
    paper, vit_b = MP3_TABLE2[method][ratio], MP3_TABLE2["vit_b"]
    if paper is None:
        return "OOM", "OOM"
    return round(paper[0] / vit_b["time"], 2), round(paper[1] / vit_b["memory"], 2)


def table2_rows(rows: list[dict[str, Any]], kernel: str) -> list[dict[str, Any]]:
    """One kernel's objective rows with their memory ratios to the supervised step of the same run, the paper's
    ratios where Table 2 has them, and time / FLOP ratio."""
    memory_key = "cuda_peak_mb" if any("cuda_peak_mb" in r for r in rows) else "step_rss_mb"
    base = next(r for r in rows if r["name"].endswith("/supervised"))
    for row in rows:
        name = row["name"].split("/", 1)[1]
        _, _, value = name.partition("_eta") if name.startswith("mp3") else name.partition("_ratio")
        row.update(suite="mp3_table2", kernel=kernel, masking_ratio=float(value) if value else "-",
                   memory_basis=memory_key)
        row["time_per_flop"] = round(row["time_vs_supervised"] / row["flop_ratio"], 3)
        row["tracks_flops"] = abs(row["time_per_flop"] - 1) <= FLOP_TRACKING
        if memory_key in row and base.get(memory_key):
            row["memory_vs_supervised"] = round(row[memory_key] / base[memory_key], 3)
        row["paper_time_ratio"], row["paper_memory_ratio"] = paper_ratios(name)
    return rows


def saved_bytes_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    """MP3 Table 2's memory column without a GPU: activation bytes saved for backward per sample (saved-tensor
    hooks, GPU autocast dtypes under --amp bf16) of MP3 at --mp3-etas vs the supervised step, ViT-B/16 at 224 px
    (--preset to change), with each attention kernel (--kernels)."""
    from patchplace.research.benchmarks.steps import saved_bytes_table

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
