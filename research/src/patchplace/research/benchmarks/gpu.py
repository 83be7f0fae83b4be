"""The GPU suite (``python pipelines/benchmark.py --suite gpu``): every registered objective's training step at
ViT-B/16, 224 px, batch 128, bf16 autocast, eager and torch.compile'd, on any CUDA machine; each row in a fresh
process (:func:`measure`: its own shapes, allocator and compile caches; a high-water mark of its own).

Per row: wall time per step (a run of steps, synchronised at its ends), the GPU's busy time per step (the union of
the kernels' intervals in torch.profiler over a few steps: a launch-bound step is busy for a small share of its
wall time), peak CUDA memory, FLOPs counted on the step (:mod:`.flops`), achieved TFLOP/s and its fraction of the
bf16 matmul peak, ATen ops / host syncs / host-to-device copies of one eager step (:func:`.steps.step_counts`),
and for compiled rows the compile time, graph breaks and recompiles over the timed steps. Ratios to the supervised
step of the same mode sit beside the FLOP ratio and, where MP3 Table 2 has them, the paper's.

Bounded: ``--gpu-budget`` seconds in all, each row its own limit (``--gpu-row-seconds``, compiled rows
``--gpu-compile-seconds``); a row that would start past the budget is written as skipped with a note. Resumable:
each row lands in ``<out>/benchmark_gpu.json`` as it finishes, and the rows measured there before in the same
setting are kept, not run again. Without CUDA: one line, exit 2.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # a row's process: `python -m patchplace.research.benchmarks.gpu SPEC_JSON`
    from patchplace.research.benchmarks.gpu import _row_main

    sys.exit(_row_main(sys.argv[1:]))

import argparse
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from patchplace.research.benchmarks.common import STUDY
from patchplace.research.benchmarks.compute import peak_of
from patchplace.research.benchmarks.flops import example_batch, step_flops
from patchplace.research.benchmarks.mp3 import FLOP_TRACKING, paper_ratios
from patchplace.research.benchmarks.steps import default_objectives, step_counts, train_step

PRESET, IMG_SIZE, NUM_CLASSES, MP3_ETA = "vit_base", 224, 1000, 0.75
MODES = ("eager", "compile")
FILE = "benchmark_gpu.json"


@dataclass(frozen=True)
class Row:
    """One measurement: an objective (a label of :func:`.steps.default_objectives`) in a mode."""

    objective: str
    mode: str

    @property
    def name(self) -> str:
        return f"gpu_step/{self.objective}" + ("+compile" if self.mode == "compile" else "")


def builders(preset: str = PRESET, img_size: int = IMG_SIZE) -> dict[str, Any]:
    """Every registered image method at the papers' widths (MP3 at eta 0.75), supervised first."""
    return default_objectives(preset, in_chans=3, img_size=img_size, widths="paper", num_classes=NUM_CLASSES,
                              mp3_etas=(MP3_ETA,))


def plan_rows(objectives: list[str] | None = None, modes: tuple[str, ...] = MODES, preset: str = PRESET
              ) -> list[Row]:
    """The rows in the order they run: every objective eager, then every one compiled; supervised first in each
    mode (the ratios' base). ``objectives``: only these (supervised always)."""
    names = [n for n in builders(preset) if n != "stop_noema"]
    if objectives:
        unknown = sorted(set(objectives) - set(names))
        if unknown:
            raise SystemExit(f"--objectives: unknown {unknown}; known: {names}")
        names = [n for n in names if n == "supervised" or n in objectives]
    return [Row(name, mode) for mode in modes for name in names]


# ---------------------------------------------------------------------------------------------- one row
def busy_us(events: Any) -> float | None:
    """Microseconds the GPU ran anything: the union of the device events' intervals (overlapping kernels on
    several streams count once); None when the profile holds no device event."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if getattr(e, "device_type", None) == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return None
    total, (start, end) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > end:
            total, start, end = total + end - start, s, e
        else:
            end = max(end, e)
    return total + end - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _dynamo_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far in this process."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _profiled(step: Any, steps: int, device: torch.device) -> dict[str, Any]:
    """Wall and GPU busy milliseconds per step over ``steps`` steps under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        _sync(device)
        wall = time.perf_counter() - start
    busy = busy_us(prof.events())
    return {"profiled_ms": round(wall * 1e3 / steps, 2),
            "gpu_busy_ms": None if busy is None else round(busy / 1e3 / steps, 2)}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One row, in this process: ``spec`` = objective, mode, preset, img_size, batch, warmup, repeats,
    profile_steps, attention, device (cuda; cpu for a test), backend (torch.compile's)."""
    from patchplace.models import set_attention_kernel

    set_attention_kernel(spec["attention"])
    device, name, compiled = torch.device(spec["device"]), spec["objective"], spec["mode"] == "compile"
    torch.manual_seed(0)
    objective = builders(spec["preset"], spec["img_size"])[name]().to(device)
    data = example_batch(objective, spec["batch"])
    row: dict[str, Any] = {"flops_per_step": step_flops(objective, data, amp=torch.bfloat16)}
    if not compiled:
        row.update(step_counts(name, objective, data, "bf16"))
    model = torch.compile(objective, backend=spec["backend"]) if compiled else objective
    optimizer = torch.optim.AdamW([p for p in objective.parameters() if p.requires_grad], lr=1e-4,
                                  fused=device.type == "cuda")

    def step() -> None:
        train_step(name, model, optimizer, data, amp="bf16")

    start = time.perf_counter()
    step()
    _sync(device)
    row["first_step_s"] = round(time.perf_counter() - start, 2)
    for _ in range(max(spec["warmup"], 2 if compiled else 1) - 1):
        step()
    _sync(device)
    graphs, _ = _dynamo_counts()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(spec["repeats"]):
        step()
    _sync(device)
    row["step_ms"] = round((time.perf_counter() - start) * 1e3 / spec["repeats"], 2)
    if device.type == "cuda":
        row["cuda_peak_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    if compiled:
        after = _dynamo_counts()
        row.update(graphs=graphs, recompiles=after[0] - graphs, graph_breaks=after[1])
    row.update(_profiled(step, spec["profile_steps"], device))
    if row["gpu_busy_ms"] is not None:
        row["busy_share"] = round(row["gpu_busy_ms"] / row["profiled_ms"], 3)
    row["tflops_per_step"] = round(row["flops_per_step"] / 1e12, 4)
    row["achieved_tflops"] = round(row["flops_per_step"] / 1e12 / (row["step_ms"] / 1e3), 1)
    return row


def _row_main(argv: list[str]) -> int:
    """A row's process (:func:`run_row`): its JSON spec in, its row as the last line out."""
    if len(argv) != 1:
        print("usage: python -m patchplace.research.benchmarks.gpu SPEC_JSON (one row of --suite gpu)",
              file=sys.stderr)
        return 2
    print(json.dumps(measure(json.loads(argv[0]))), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------- the suite
def run_row(row: Row, spec: dict[str, Any], seconds: float) -> dict[str, Any]:
    """:func:`measure` of ``row`` in a fresh process, at most ``seconds``; a row with a note when it ran out of
    time or failed."""
    cmd = [sys.executable, "-m", "patchplace.research.benchmarks.gpu",
           json.dumps({**spec, "objective": row.objective, "mode": row.mode})]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return {"note": f"ran past its {seconds:.0f} s: not measured"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"note": f"failed (exit {done.returncode}): {tail[:300]}"}
    return json.loads(lines[-1])


def with_ratios(rows: list[dict[str, Any]], peak_tflops: float | None) -> list[dict[str, Any]]:
    """Each measured row against the supervised row of its mode (time, memory, FLOPs; time / FLOP ratio and
    whether it is within FLOP_TRACKING of 1), its fraction of the bf16 matmul peak, and MP3 Table 2's ratios."""
    base = {r["mode"]: r for r in rows if r["objective"] == "supervised" and "step_ms" in r}
    for row in rows:
        b = base.get(row["mode"])
        time_paper, memory_paper = paper_ratios(row["objective"])
        row.update(paper_time_ratio=time_paper, paper_memory_ratio=memory_paper)
        if "step_ms" not in row:
            continue
        if peak_tflops:
            row["of_peak"] = round(row["achieved_tflops"] / peak_tflops, 3)
        if b is None:
            continue
        row["time_vs_supervised"] = round(row["step_ms"] / b["step_ms"], 3)
        row["flop_ratio"] = round(row["flops_per_step"] / b["flops_per_step"], 3)
        row["time_per_flop"] = round(row["time_vs_supervised"] / row["flop_ratio"], 3)
        row["tracks_flops"] = abs(row["time_per_flop"] - 1) <= FLOP_TRACKING
        if row.get("cuda_peak_mb") and b.get("cuda_peak_mb"):
            row["memory_vs_supervised"] = round(row["cuda_peak_mb"] / b["cuda_peak_mb"], 3)
    return rows


def _write(path: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    os.replace(tmp, path)


def kept_rows(path: Path, setting: str) -> dict[str, dict[str, Any]]:
    """The rows ``path`` holds measured in ``setting`` (a skipped or failed row is run again)."""
    if not path.is_file():
        return {}
    return {r["name"]: r for r in json.loads(path.read_text()).get("results", [])
            if r.get("setting") == setting and "step_ms" in r}


def refuse_without_cuda() -> None:
    """One line and exit 2 where there is no CUDA device."""
    if not torch.cuda.is_available():
        print(f"gpu suite: no CUDA device here (torch {torch.__version__}, CUDA build {torch.version.cuda}): "
              "nothing measured", file=sys.stderr)
        raise SystemExit(2)


def gpu_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of :func:`plan_rows`, each in a process of its own within its limit and the suite's budget."""
    refuse_without_cuda()
    preset = args.preset if args.preset != STUDY["preset"] else PRESET
    args.amp, args.device = "bf16", "cuda"
    img_size = args.img_size or IMG_SIZE
    peak = peak_of(args, state)["gflops"] / 1e3
    torch.cuda.empty_cache()  # the GEMMs' blocks, before the rows' processes share the device
    device = torch.cuda.get_device_name()
    setting = f"{preset}, 3 x {img_size} px, batch {args.batch}, bf16 autocast, {args.attention}, {device}"
    spec = {"preset": preset, "img_size": img_size, "batch": args.batch, "warmup": args.warmup,
            "repeats": args.repeats, "profile_steps": args.gpu_profile_steps, "attention": args.attention,
            "device": "cuda", "backend": args.gpu_backend}
    path = (args.out or Path("results")) / FILE
    kept, rows = kept_rows(path, setting), []
    deadline = time.perf_counter() + args.gpu_budget
    for row in plan_rows(args.objectives, tuple(args.gpu_modes), preset):
        limit = args.gpu_compile_seconds if row.mode == "compile" else args.gpu_row_seconds
        left = deadline - time.perf_counter()
        if row.name in kept:
            got = kept[row.name]
        elif left < min(limit, 30):
            got = {"note": f"skipped: the suite's {args.gpu_budget:.0f} s were spent (run it again: it resumes)"}
        else:
            got = run_row(row, spec, min(limit, left))
        rows.append({**got, "suite": "gpu", "name": row.name, "objective": row.objective, "mode": row.mode,
                     "setting": setting, "preset": preset, "batch": args.batch, "amp": "bf16", "device": device})
        print(json.dumps(rows[-1]), flush=True)
        _write(path, with_ratios(rows, peak), {"suite": "gpu", "partial": True, "bf16_matmul_peak_tflops": peak})
    planned = {r["name"] for r in rows}
    rows += [r for name, r in kept.items() if name not in planned]  # measured before, not asked for this time
    return with_ratios(rows, peak)
