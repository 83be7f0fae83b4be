"""Where a pretraining step's time goes (profile): torch.profiler over a few training steps of each objective, the
operators with the most self time (device time on a GPU, CPU time otherwise) per step, and the share of the step
spent outside matrix products and attention — what "remove what is not compute" has to shrink (MAE's step on a GPU
ran at 1.10x the supervised step for 0.56x its FLOPs)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from patchplace.research.benchmarks.common import STUDY, device_of, image_setting

# operators that are the step's arithmetic: matrix products, attention kernels, the patch convolution
COMPUTE_OPS = ("mm", "addmm", "bmm", "matmul", "linear", "attention", "sdpa", "flash", "cutlass", "gemm", "conv",
               "_efficient_attention", "cudnn")


def is_compute(name: str) -> bool:
    return any(key in name.lower() for key in COMPUTE_OPS)


def profile_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    """--objectives (default: supervised mae) on --preset (ViT-B/16 224 px on a GPU where the preset is the
    study's), --batch, --amp: --warmup steps, then --repeats steps under torch.profiler; the --profile-top
    operators by self time per step and each objective's non-compute share."""
    from torch.profiler import ProfilerActivity, profile

    from patchplace.research.benchmarks.steps import default_objectives, train_step

    device = torch.device(device_of(args))
    preset = args.preset if (args.preset != STUDY["preset"] or device.type != "cuda") else "vit_base"
    img_size, in_chans, widths = image_setting(preset, args.img_size, args.in_chans, args.widths)
    classes = 1000 if img_size > 32 else 10
    builders = default_objectives(preset, in_chans=in_chans, img_size=img_size, widths=widths, num_classes=classes)
    names = args.objectives or ["supervised", "mae"]
    unknown = sorted(set(names) - set(builders))
    if unknown:
        raise SystemExit(f"--objectives: unknown {unknown}; known: {sorted(builders)}")
    amp = args.amp or ("bf16" if device.type == "cuda" else "no")
    images = torch.randn(args.batch, in_chans, img_size, img_size, device=device)
    labels = torch.randint(0, classes, (args.batch,), device=device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    rows = []
    for name in names:
        torch.manual_seed(0)
        objective = builders[name]().to(device)
        optimizer = torch.optim.AdamW([p for p in objective.parameters() if p.requires_grad], lr=1e-4)
        for _ in range(args.warmup):
            train_step(name, objective, optimizer, (images, labels), amp=amp)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        with profile(activities=activities) as prof:
            for _ in range(args.repeats):
                train_step(name, objective, optimizer, (images, labels), amp=amp)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        events = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
        total = sum(getattr(e, key) for e in events) or 1.0
        other = sum(getattr(e, key) for e in events if not is_compute(e.key))
        top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:args.profile_top]
        for e in top:
            rows.append({"suite": "profile", "name": f"profile/{name}", "op": e.key,
                         "ms_per_step": round(getattr(e, key) / 1e3 / args.repeats, 3),
                         "share": round(getattr(e, key) / total, 3), "calls_per_step": e.count // args.repeats,
                         "compute": is_compute(e.key)})
        rows.append({"suite": "profile", "name": f"profile/{name}", "op": "(all)",
                     "ms_per_step": round(total / 1e3 / args.repeats, 3), "share": 1.0,
                     "non_compute_share": round(other / total, 3), "preset": preset, "batch": args.batch,
                     "amp": amp, "device": str(device), "timed": "device" if device.type == "cuda" else "cpu"})
        print(json.dumps(rows[-1]), flush=True)
        del objective, optimizer
    return rows
