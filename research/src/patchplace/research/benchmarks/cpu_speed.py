"""The CPU speed ladder (cpu_speed): images/s of every method's training through pretrain.py (and of the supervised
fine-tuning through finetune.py), the study ViT and ViT-S, at each rung — float32 eager, bf16 autocast, compiled
Transformer blocks (inductor), both, one thread, two one-thread processes at once (the study's setting) — with each
rate over the float32 rung's and as a fraction of the float32 and the bf16 matmul peaks measured in the same run,
headed by the CPU's name and its bf16-relevant flags.

Each run is a process of its own on the in-memory path, and its rate is the one pretrain.py / finetune.py log over
their steady steps (startup and the first step, which compiles, excluded; a recompilation for a new shape in a
later step is counted: a run pays it too). On a CPU without bf16 units the bf16 rungs take few steps: each of
them runs through a scalar fallback (the rung is measured, not extrapolated).
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

import torch

from patchplace.pipelines import CONFIGS
from patchplace.pipelines.engine.hardware import cpu_info
from patchplace.research.benchmarks.compute import matmul_peak
from patchplace.research.benchmarks.speed import SPEED_METHODS, flops_per_sample


@dataclass(frozen=True)
class Rung:
    """pretrain.py / finetune.py overrides, torch threads per process (0: torch's default) and how many such
    processes run at once (their rates summed)."""

    name: str
    overrides: tuple[str, ...]
    threads: int = 0
    processes: int = 1

    @property
    def bf16(self) -> bool:
        return "run.mixed_precision=bf16" in self.overrides


FP32 = ("run.mixed_precision=no", "run.compile=no")
RUNGS = (Rung("fp32", FP32),
         Rung("bf16", ("run.mixed_precision=bf16", "run.compile=no")),
         Rung("compile", ("run.mixed_precision=no", "run.compile=default")),
         Rung("bf16+compile", ("run.mixed_precision=bf16", "run.compile=default")),
         Rung("1 thread", FP32, threads=1),
         Rung("2 x 1 thread", FP32, threads=1, processes=2))


@dataclass(frozen=True)
class Model:
    """A backbone of the ladder: its preset, per-process batch and data overrides."""

    name: str
    preset: str
    batch: int
    overrides: tuple[str, ...] = ()


MODELS = {"study_vit": Model("study_vit", "vit_cpu_narrow", 128),
          "vit_small": Model("vit_small", "vit_small", 8, ("data.pad_to=null", "data.img_size=224"))}


def command(method: str, model: Model, rung: Rung, steps: int, shards: Path, out: Path) -> list[str]:
    script, config = (("finetune", "finetune_fashion_mnist.yaml") if method == "finetune" else
                      ("pretrain", f"{method}_fashion_mnist.yaml"))
    return [sys.executable, "-m", f"patchplace.pipelines.{script}", "--config", str(CONFIGS / config),
            f"data.train={shards}", "data.val=holdout", "data.holdout=256", "data.val_limit=64",
            f"model.preset={model.preset}", f"data.batch_size={model.batch}", "data.in_memory=true",
            "data.num_workers=0", f"optim.max_steps={steps}", f"run.log_every={steps}", "run.checkpoint_every=0",
            "run.eval_every=0", "run.tensorboard=false", f"run.output={out}", *model.overrides, *rung.overrides]


def measure(method: str, model: Model, rung: Rung, steps: int, shards: Path) -> dict[str, Any]:
    """Run ``rung.processes`` copies at once (seeds 0, 1, ...); their summed images/s and FLOPs per image."""
    env = {**os.environ, **({"OMP_NUM_THREADS": str(rung.threads)} if rung.threads else {})}
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"p{i}" for i in range(rung.processes)]
        procs = [subprocess.Popen([*command(method, model, rung, steps, shards, out), f"run.seed={i}"], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i, out in enumerate(outs)]
        logs = [p.communicate()[0] for p in procs]
        for p, log in zip(procs, logs, strict=True):
            if p.returncode != 0:
                raise SystemExit(f"cpu_speed: {method} / {model.name} ({rung.name}) exited {p.returncode}; its "
                                 f"output ends:\n{log[-2000:]}")
        rates = []
        for out in outs:
            records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
            rates.append(float([r for r in records if "samples_per_s" in r][-1]["samples_per_s"]))
        flops = flops_per_sample(outs[0], method)
    return {"rates": rates, "images_per_s": round(sum(rates), 2), "gflops_per_image": flops and flops / 1e9}


def peaks(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The float32 and bf16 matmul peaks of this run (the best over a few sizes; bf16 at small sizes only where
    the CPU has no bf16 units, whose fallback takes minutes per large matmul)."""
    fast_bf16 = cpu_info().onednn_bf16
    found = {}
    for label, dtype, sizes in (("fp32", torch.float32, [1024, 2048, 3072]),
                                ("bf16", torch.bfloat16, [1024, 2048, 3072] if fast_bf16 else [256, 512])):
        rows = [matmul_peak(size=n, repeats=args.matmul_repeats, dtype=dtype) for n in sizes]
        found[label] = max(rows, key=lambda r: r["gflops"])
        print(json.dumps({"peak": label, **found[label]}), flush=True)
    return found


def cpu_speed_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    """Images/s of --cpu-speed-methods (study ViT) and --cpu-speed-vits-methods (ViT-S) at every rung of
    --cpu-speed-rungs, each over the float32 rung's, beside the fraction of both matmul peaks."""
    if not (args.shards / "manifest.json").is_file():
        print(f"cpu_speed: no shards at {args.shards}: skipped", flush=True)
        return []
    cpu = cpu_info()
    state["cpu"] = {"name": cpu.name, "flags": list(cpu.flags), "bf16_units": cpu.bf16_units,
                    "onednn_bf16": cpu.onednn_bf16}
    print(f"cpu_speed: {cpu.line()}", flush=True)
    found = peaks(args)
    state["matmul_peak"] = found["fp32"]
    state["bf16_matmul_peak"] = found["bf16"]
    wanted = args.cpu_speed_rungs or [r.name for r in RUNGS]
    unknown = sorted(set(wanted) - {r.name for r in RUNGS})
    if unknown:
        raise SystemExit(f"--cpu-speed-rungs: unknown {unknown}; known: {[r.name for r in RUNGS]}")
    rows = []
    for model, methods in ((MODELS["study_vit"], args.cpu_speed_methods),
                           (MODELS["vit_small"], args.cpu_speed_vits_methods)):
        for method in methods:
            if method not in SPEED_METHODS:
                raise SystemExit(f"cpu_speed: unknown method {method!r}; known: {list(SPEED_METHODS)}")
            first = None
            slow = not cpu.onednn_bf16 and method not in args.cpu_speed_slow_methods
            for rung in (r for r in RUNGS if r.name in wanted and not (r.bf16 and slow)):
                steps = args.cpu_speed_steps if not rung.bf16 or cpu.onednn_bf16 else args.cpu_speed_slow_steps
                measured = measure(method, model, rung, steps, args.shards)
                rate, flops = measured["images_per_s"], measured["gflops_per_image"]
                first = first or rate
                achieved = rate * flops if flops else None
                row = {"suite": "cpu_speed", "name": f"cpu_speed/{model.name}/{method}", "rung": rung.name,
                       "images_per_s": rate, "vs_fp32": round(rate / first, 3), "process_rates": measured["rates"],
                       "threads": rung.threads or torch.get_num_threads(), "processes": rung.processes,
                       "gflops_per_image": flops and round(flops, 4),
                       "achieved_gflops": achieved and round(achieved, 2),
                       "of_fp32_peak": achieved and round(achieved / found["fp32"]["gflops"], 4),
                       "of_bf16_peak": achieved and round(achieved / found["bf16"]["gflops"], 4),
                       "steps": steps, "batch": model.batch, "preset": model.preset,
                       "overrides": " ".join(rung.overrides)}
                rows.append(row)
                print(json.dumps(row), flush=True)
            mine = [r for r in rows if r["name"] == f"cpu_speed/{model.name}/{method}"]
            max(mine, key=lambda r: r["images_per_s"])["fastest"] = True
    return rows
