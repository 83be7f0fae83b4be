"""Evaluate an exported ONNX model with ONNX Runtime on shards: accuracy, MJP consistency / Diff. Norm,
corruption robustness (ImageNet-C protocol) and latency.

    python -m patchplace.export.evaluate model.onnx --data shards/fashion_mnist/test \\
        --out runs/ort_eval \\
        [--checkpoint runs/x/checkpoint]      # also time PyTorch eager on the same inputs
        [--reference-errors supervised.json]  # mCE: corruption errors over a reference model's

Writes ``results.json``, ``results.md`` and PNG curves into ``--out`` (checked before any work: a
place that cannot be written is one line). Providers (``--provider``): ``auto`` (CUDA when torch
sees a GPU and ONNX Runtime has the CUDA provider, else CPU), ``cpu``, or ``cuda`` — then the
session must run on CUDAExecutionProvider (onnxruntime-gpu; ONNX Runtime falls back to the CPU
silently when the CUDA libraries do not load) or the evaluation stops with one line, and PyTorch
runs on the same GPU. With ``--checkpoint``: parity (max abs logit difference, argmax agreement,
top-1 of both) on the evaluated images, PyTorch on the provider's device; and PyTorch eager timed
beside ONNX Runtime (CUDA-synchronised on a GPU, where ONNX Runtime is also timed with its inputs
and outputs bound on the GPU: ``onnxruntime_iobinding``). ``--corruption-cache``: each corrupted
image set is stored with the fingerprint of its source images, its corruption and severity and its
own checksum; a file that does not match them (damaged, zero-filled, another set's) is said in one
line and computed again.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # `python -m patchplace.export.evaluate`, before the imports below load torch: the
    # arguments parse torch-free (--help, usage errors), then this module, imported by its name, runs them
    from patchplace.export import cli

    sys.exit(cli.evaluate())

import argparse
import errno
import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from patchplace.data import DataError, Manifest

from .cli import evaluate_parser
from .errors import ExportError, Unavailable
from .files import INT8_SUFFIX, check_writable, copy_suffix, fp32_of
from .measures import (
    CONSISTENCY_RATIOS,
    accuracy,
    consistency,
    latency,
    load_uint8,
    parity,
    pytorch_model,
    time_runners,
)
from .ort_model import (
    CUDA_FIX,
    CUDA_LIBRARIES,
    SIDECAR_FORMATS,
    OnnxModel,
    check_provider,
    ort_package,
    prepare_provider,
)
from .report import cpu_name, environment, plot, to_markdown
from .robustness import (
    CACHE_FORMAT,
    IMAGENET_C,
    corrupt_batch,
    corrupted_images,
    corruption_errors,
    read_cached,
    reference_errors,
    robustness,
)

# the names this module has always offered (the pipelines, the benchmarks and the tests import them here)
__all__ = [
    "CACHE_FORMAT",
    "CONSISTENCY_RATIOS",
    "CUDA_FIX",
    "CUDA_LIBRARIES",
    "IMAGENET_C",
    "OUTPUTS",
    "SIDECAR_FORMATS",
    "OnnxModel",
    "accuracy",
    "check_outputs",
    "check_provider",
    "consistency",
    "corrupt_batch",
    "corrupted_images",
    "corruption_errors",
    "cpu_name",
    "environment",
    "evaluate",
    "latency",
    "load_uint8",
    "main",
    "ort_package",
    "parity",
    "plot",
    "prepare_provider",
    "pytorch_model",
    "read_cached",
    "reference_errors",
    "robustness",
    "time_runners",
    "to_markdown",
]


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement the command line asks for; raises :class:`ExportError` / :class:`DataError` (nothing is
    written then), except for a part that cannot run here (:class:`Unavailable`), which is skipped: its reason is in
    ``results["skipped"]``, and the rest is kept."""
    model = OnnxModel(args.model, provider=args.provider)
    manifest = Manifest.load(args.data)
    model.check_data(manifest)
    images, labels = load_uint8(manifest, args.limit, args.batch_size,
                                transform=model.resize_crop if model.resizes else None)
    results: dict[str, Any] = {"model": str(args.model), "data": str(args.data),
                               "providers": model.session.get_providers(), "environment": environment(model)}
    results["accuracy"] = accuracy(model, images, labels, args.batch_size)
    skipped: dict[str, str] = {}

    def optional(part: str, measure: Callable[[], Any]) -> None:
        """``results[part] = measure()``, or — where the part cannot run here (:class:`Unavailable`: a missing
        extra, images it cannot take) — the part skipped, said in one line, and what was measured kept."""
        try:
            results[part] = measure()
        except Unavailable as exc:
            skipped[part] = str(exc)
            print(f"[ort-eval] {part} skipped: {exc}", file=sys.stderr, flush=True)

    if args.checkpoint and args.parity_limit != 0:
        n = len(images) if args.parity_limit is None else min(args.parity_limit, len(images))
        optional("parity", lambda: parity(model, images[:n], labels[:n], args.checkpoint, args.batch_size))
    if args.consistency_limit:  # 0: skipped
        n = min(args.consistency_limit, len(images))
        optional("consistency", lambda: consistency(model, images[:n], args.batch_size))
    if args.robustness_limit:
        reference = json.loads(Path(args.reference_errors).read_text()) if args.reference_errors else None
        n = min(args.robustness_limit, len(images))
        optional("robustness", lambda: robustness(model, images[:n], labels[:n], args.batch_size,
                                                  reference=reference, cache=args.corruption_cache))
    if args.latency_repeats:
        optional("latency", lambda: latency(model, tuple(args.latency_batches), args.latency_repeats,
                                            args.checkpoint, warmup=args.latency_warmup))
    if skipped:
        results["skipped"] = skipped
    return results


OUTPUTS = ("results.json", "results.md", "consistency.png", "robustness.png")  # what --out receives


def check_outputs(args: argparse.Namespace, argv: list[str]) -> None:
    """Before any work: refuse an int8 / fp16 copy as the model (with the command that evaluates its exported
    pair), and an ``--out`` or ``--corruption-cache`` that cannot be written (a file where a directory goes, a
    directory where a result file goes, a read-only place), each in one line."""
    if suffix := copy_suffix(args.model):
        kind, flag = ("int8", "--quantize") if suffix == INT8_SUFFIX else ("fp16", "--fp16")
        fp32 = str(fp32_of(args.model))
        command = shlex.join(["python", "-m", "patchplace.export.evaluate",
                              *(fp32 if a == args.model else a for a in argv)])
        raise ExportError(f"{args.model} is the {kind} copy {flag} wrote of {fp32}, not an exported pair (no "
                          f"sidecar of its own): evaluate the pair ({command}); the export's {flag} --data "
                          f"SPLIT reports the {kind} model's top-1 change")
    out = Path(args.out)
    check_writable(out, f"--out {out}")
    for name in OUTPUTS:
        if (out / name).is_dir():
            raise ExportError(f"--out {out}: {out / name} is a directory where a result file goes: remove it, or "
                              "choose another --out")
    if args.corruption_cache is not None and args.robustness_limit:
        check_writable(Path(args.corruption_cache), f"--corruption-cache {args.corruption_cache}")


def main(argv: list[str] | None = None) -> int:
    parser = evaluate_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    try:
        if min(args.consistency_limit, args.robustness_limit) < 0:
            raise ExportError("--consistency-limit and --robustness-limit count images: give 0 (skip) or more")
        check_outputs(args, argv)
        results = evaluate(args)
    except (ExportError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path this file system cannot hold (--out, --data, --corruption-cache)
        if exc.errno != errno.ENAMETOOLONG:
            raise
        print(f"error: {exc.filename}: a name in this path is longer than the file system takes (ENAMETOOLONG): "
              "choose a shorter path", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(to_markdown(results))
    plot(results, out)
    print(to_markdown(results))
    if missing := [part for part in args.require or () if part in results.get("skipped", {})]:
        print(f"error: {', '.join(missing)} required (--require) but skipped: {results['skipped'][missing[0]]} "
              f"(the other results are in {out / 'results.json'})", file=sys.stderr)
        return 2
    return 0
