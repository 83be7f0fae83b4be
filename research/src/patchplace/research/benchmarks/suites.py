"""The registry: suite name -> function(args, state) -> rows; ``all`` runs most of them in one go."""

from __future__ import annotations

import argparse
import time
from typing import Any

from patchplace.research.benchmarks.activation_memory import activation_memory_suite
from patchplace.research.benchmarks.common import STUDY
from patchplace.research.benchmarks.compute import (
    masks_suite,
    matmul_suite,
    models_suite,
    objectives_suite,
    run_objectives,
)
from patchplace.research.benchmarks.cpu_speed import cpu_speed_suite
from patchplace.research.benchmarks.data import data_suite, data_vs_training
from patchplace.research.benchmarks.data_writer import data_writer_suite
from patchplace.research.benchmarks.equivalence import equivalence_suite
from patchplace.research.benchmarks.fsdp_memory import fsdp_memory_suite
from patchplace.research.benchmarks.gpu import gpu_suite
from patchplace.research.benchmarks.loader_vs_step import loader_vs_step_suite
from patchplace.research.benchmarks.mp3 import mp3_table2_suite, saved_bytes_suite
from patchplace.research.benchmarks.onnx import onnx_suite
from patchplace.research.benchmarks.pipelines import anchor_suite, ddp_suite, pipelines_suite
from patchplace.research.benchmarks.probe_memory import probe_memory_suite
from patchplace.research.benchmarks.profile import profile_suite
from patchplace.research.benchmarks.speed import speed_suite


def all_suite(args: argparse.Namespace, state: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    seconds = state.setdefault("seconds", {})

    def part(name: str, fn) -> None:
        start = time.perf_counter()
        rows.extend(fn())
        seconds[name] = round(time.perf_counter() - start, 1)
        print(f"== {name}: {seconds[name]} s", flush=True)

    part("matmul", lambda: matmul_suite(args, state))
    part("objectives/study_vit", lambda: [{**r, "suite": "objectives"} for r in run_objectives(
        args, state, **STUDY, widths="study", repeats=args.repeats, warmup=args.warmup,
        memory_steps=args.memory_steps, compile_names=args.compile)])
    part("objectives/vit_small", lambda: [{**r, "suite": "objectives"} for r in run_objectives(
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
          "gpu": gpu_suite, "ddp": ddp_suite, "anchor": anchor_suite, "saved_bytes": saved_bytes_suite,
          "speed": speed_suite,
          "cpu_speed": cpu_speed_suite, "cpu_equivalence": equivalence_suite,
          "profile": profile_suite, "data_writer": data_writer_suite, "loader_vs_step": loader_vs_step_suite,
          "probe_memory": probe_memory_suite, "activation_memory": activation_memory_suite,
          "fsdp_memory": fsdp_memory_suite,
          "all": all_suite}
