"""The onnx suite: inference latency of PyTorch eager vs ONNX Runtime (plain, optimized and int8 graphs)."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from patchplace.research.benchmarks.common import image_setting

ONNX_GRAPHS = ("plain", "optimized", "int8")  # before: the plain graph on a default session; after: the other two


def _onnx_sessions(checkpoint: Path, out: Path, threads: int) -> tuple[dict[str, Any], dict[str, Any], float]:
    """Sessions on the plain graph (a default ONNX Runtime session: the baseline), the optimized
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

    img_size, in_chans, _ = image_setting(args.onnx_preset, None, None, None)
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
