"""The study ViT at GPU speed (speed): images/s of every method's training through pretrain.py (and of the
supervised fine-tuning through finetune.py) at a ladder of settings, each a step from the one before — the study's
setting as it ran, AdamW's fused kernel, no host sync per step, a larger batch (peak lr scaled linearly, recorded),
compiled Transformer blocks, several runs sharing the device — with each rate over the first setting's and as a
fraction of the matmul peak (bf16 on a GPU: FLOPs per image counted on a step x images/s / peak).

A 1.2M-parameter ViT on 32 x 32 images cannot fill a large GPU one small step at a time: its step is a few hundred
small kernels, so the rate is set by launches and host syncs, not FLOPs. Each run is its own process (compiled
code, CUDA graphs and allocator state do not leak between settings; the processes setting needs them anyway), on
the in-memory path (the split decoded once onto the training device, batched augmentation there) and reads the
rate pretrain.py / finetune.py log over their steady steps (startup and the first, compiling, step excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from patchplace.models import load_pretrained
from patchplace.objectives import Supervised, get_method
from patchplace.pipelines import CONFIGS
from patchplace.research.benchmarks.common import STUDY, device_of
from patchplace.research.benchmarks.compute import peak_of
from patchplace.research.benchmarks.flops import train_flops_or_none
from patchplace.research.benchmarks.options import SPEED_METHODS  # (the command line lists them, without torch)

STUDY_GPU_BATCH = 256  # the batch of a GPU study process: the setting the ladder starts from


@dataclass(frozen=True)
class Setting:
    """One rung of the ladder: pretrain.py / finetune.py overrides, the per-process batch and how many processes
    share the device (the rate of ``processes`` > 1 is their summed rate)."""

    name: str
    batch: int
    overrides: tuple[str, ...]
    processes: int = 1


def ladder(args: argparse.Namespace) -> list[Setting]:
    """before -> fused AdamW -> no per-step host sync (run.finite_check=lazy) -> batch --speed-batch (lr x batch /
    256) -> + compiled blocks -> x --speed-processes."""
    scaled = ("optim.lr_scaling=linear", f"optim.lr_base_batch={STUDY_GPU_BATCH}")
    lazy = ("optim.fused=true", "run.finite_check=lazy")
    compiled = (*lazy, *scaled, f"run.compile={args.speed_compile}")
    rungs = [Setting("before", STUDY_GPU_BATCH, ("optim.fused=false", "run.finite_check=step", "run.compile=no")),
             Setting("fused", STUDY_GPU_BATCH, ("optim.fused=true", "run.finite_check=step", "run.compile=no")),
             Setting("lazy", STUDY_GPU_BATCH, (*lazy, "run.compile=no")),
             Setting("batch", args.speed_batch, (*lazy, *scaled, "run.compile=no")),
             Setting("compile", args.speed_batch, compiled),
             Setting("processes", args.speed_batch, compiled, args.speed_processes)]
    wanted = args.speed_settings or [r.name for r in rungs]
    unknown = sorted(set(wanted) - {r.name for r in rungs})
    if unknown:
        raise SystemExit(f"--speed-settings: unknown {unknown}; known: {[r.name for r in rungs]}")
    return [r for r in rungs if r.name in wanted]


def command(method: str, setting: Setting, args: argparse.Namespace, out: Path) -> list[str]:
    """The pretrain.py (finetune.py for ``finetune``: the supervised fine-tuning recipe from scratch) command of
    one run: the study ViT, the in-memory path, ``--speed-steps`` optimizer steps, the rate logged once at the
    end."""
    script, config = (("finetune.py", "finetune_fashion_mnist.yaml") if method == "finetune" else
                      ("pretrain.py", f"{method}_fashion_mnist.yaml"))
    val = args.shards.parent / "test" if (args.shards.parent / "test" / "manifest.json").is_file() else args.shards
    gpu = device_of(args) == "cuda"
    amp = args.amp or ("bf16" if gpu else "no")
    extra = [o for o in args.pipelines_overrides if method != "finetune" or not o.startswith("objective.")]
    decoders = min(8, (os.cpu_count() or 2) // 2) if gpu else 0  # processes decoding the split (startup only)
    val_limit = min(512, json.loads((val / "manifest.json").read_text())["num_samples"])  # the closing validation
    return [sys.executable, "-m", f"patchplace.pipelines.{Path(script).stem}", "--config", str(CONFIGS / config),
            f"data.train={args.shards}", f"data.val={val}", f"data.val_limit={val_limit}",
            f"model.preset={STUDY['preset']}", f"data.batch_size={setting.batch}", "data.in_memory=true",
            f"data.num_workers={decoders}",
            f"optim.max_steps={args.speed_steps}", f"run.log_every={args.speed_steps}", "run.checkpoint_every=0",
            "run.eval_every=0", "run.tensorboard=false", f"run.mixed_precision={amp}", f"run.output={out}",
            *setting.overrides, *extra]


def flops_per_sample(out: Path, method: str) -> float | None:
    """FLOPs of one training step per sample of the run in ``out`` (:func:`.flops.train_flops`, counted on a step):
    its objective rebuilt from the checkpoint it saved at its end — the backbone, and pretrain.py's recorded method
    and objective fields (finetune: the supervised classifier). None where it cannot step on a random batch."""
    backbone, metadata = load_pretrained(out / "checkpoint")
    objective = Supervised(backbone) if method == "finetune" else \
        get_method(metadata["method"]).build(backbone, metadata.get("objective") or {})
    return train_flops_or_none(objective, 64)


def rate_of(out: Path, method: str) -> tuple[float, float]:
    """(samples/s, achieved TFLOP/s) of a run: the rate of its last training-step log record (steady steps: startup
    and the first step apart) x its FLOPs per sample (0 where the FLOP model has none)."""
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    rate = float([r for r in records if "samples_per_s" in r][-1]["samples_per_s"])
    return rate, rate * (flops_per_sample(out, method) or 0.0) / 1e12


def measure(method: str, setting: Setting, args: argparse.Namespace) -> dict[str, Any]:
    """Run ``setting.processes`` copies of one run at once (each its own seed and directory); their summed
    rate."""
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"p{i}" for i in range(setting.processes)]
        procs = [subprocess.Popen([*command(method, setting, args, out), f"run.seed={i}"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i, out in enumerate(outs)]
        logs = [p.communicate()[0] for p in procs]
        failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
        if failed:
            i, code = failed[0]
            raise SystemExit(f"speed: {method} ({setting.name}) exited {code}; its output ends:\n{logs[i][-2000:]}")
        measured = [rate_of(out, method) for out in outs]
    rates = [r for r, _ in measured]
    return {"rates": rates, "images_per_s": round(sum(rates), 1), "tflops": sum(t for _, t in measured)}


def speed_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    """Images/s of every --speed-methods' training at every rung of :func:`ladder`, with the gain over the first
    rung and the fraction of the matmul peak; the fastest rung per method is marked."""
    if not (args.shards / "manifest.json").is_file():
        print(f"speed: no shards at {args.shards}: skipped", flush=True)
        return []
    args.amp = args.amp or ("bf16" if device_of(args) == "cuda" else "no")
    peak = peak_of(args, state)
    settings, rows = ladder(args), []
    for method in args.speed_methods:
        if method not in SPEED_METHODS:
            raise SystemExit(f"--speed-methods: unknown {method!r}; known: {list(SPEED_METHODS)}")
        first = None
        for setting in settings:
            measured = measure(method, setting, args)
            rate = measured["images_per_s"]
            first = first or rate
            row = {"suite": "speed", "name": f"speed/{method}", "setting": setting.name, "batch": setting.batch,
                   "processes": setting.processes, "images_per_s": rate, "vs_first": round(rate / first, 2),
                   "process_rates": measured["rates"],
                   "gflops_per_image": round(measured["tflops"] * 1e3 / rate, 4) if rate else None,
                   "peak_fraction": round(measured["tflops"] * 1e3 / peak["gflops"], 4), "steps": args.speed_steps,
                   "amp": args.amp, "device": device_of(args), "preset": STUDY["preset"],
                   "overrides": " ".join(setting.overrides)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        mine = [r for r in rows if r["name"] == f"speed/{method}"]
        max(mine, key=lambda r: r["images_per_s"])["fastest"] = True
    return rows
