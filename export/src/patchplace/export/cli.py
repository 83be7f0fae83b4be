"""``python -m patchplace.export.evaluate``'s command line without torch: its parser (``--help`` and the usage
errors answer in a fraction of a second) and the entry that imports the evaluator (torch, ONNX Runtime) only once
the arguments parse."""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

from patchplace.data.helpformat import help_formatter

from .choices import PROVIDERS

OPTIONAL_PARTS = ("parity", "consistency", "robustness", "latency")  # what --require names


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, the cause and where the options are listed (exit 2), instead of the
    whole usage block above it."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def evaluate_parser() -> argparse.ArgumentParser:
    """The evaluator's arguments, described by :mod:`patchplace.export.evaluate`'s docstring (read from its source,
    not imported)."""
    doc = ast.get_docstring(ast.parse(Path(__file__).with_name("evaluate.py").read_text()), clean=False)
    parser = OneLineParser(prog="python -m patchplace.export.evaluate", description=doc,
                           formatter_class=help_formatter(argparse.RawDescriptionHelpFormatter))
    parser.add_argument("model", help="model.onnx written by python -m patchplace.export")
    parser.add_argument("--data", required=True,
                        help="test split directory (manifest.json + shards), or its URL (http(s)://, s3://, gs://, "
                        "hf://, ...)")
    parser.add_argument("--out", default="runs/ort_eval", help="output directory (default: %(default)s)")
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N test images (default: all)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--robustness-limit", type=int, default=1000,
                        help="images for the 15 x 5 corruption sweep (0 = skip; default %(default)s)")
    parser.add_argument("--consistency-limit", type=int, default=2000,
                        help="images for the consistency curves (0 = skip; default %(default)s)")
    parser.add_argument("--reference-errors", help="a reference model's corruption errors, for CE / mCE (ImageNet-C: "
                        "sum over severities of ours / of its): its results.json, its robustness.errors, or "
                        "{corruption: error or [error per severity]}")
    parser.add_argument("--corruption-cache", type=Path, help="directory caching the corrupted images (reused by "
                                                                "every model evaluated on the same images)")
    parser.add_argument("--checkpoint", help="the PyTorch checkpoint the model was exported from: parity with PyTorch "
                        "eager (on the provider's device) and PyTorch eager timed beside ONNX Runtime")
    parser.add_argument("--provider", choices=list(PROVIDERS), default="auto",
                        help="ONNX Runtime execution provider: auto (CUDA when torch sees a GPU and ONNX Runtime has "
                             "the CUDA provider, else CPU), cpu, or cuda (refused in one line unless the session "
                             "really runs on CUDAExecutionProvider; PyTorch then runs on the same GPU). Default: "
                             "%(default)s")
    parser.add_argument("--parity-limit", type=int, default=None,
                        help="images for the parity check against --checkpoint (default: every evaluated image; "
                             "0 = skip)")
    parser.add_argument("--latency-repeats", type=int, default=20, help="timed runs per batch size (0 = skip)")
    parser.add_argument("--latency-batches", type=int, nargs="+", default=[1, 8, 64], metavar="B",
                        help="batch sizes timed (default: 1 8 64)")
    parser.add_argument("--require", nargs="+", choices=OPTIONAL_PARTS, default=[], metavar="PART",
                        help="parts that must run (any of: %(choices)s): exit 2 when one is skipped because it cannot "
                        "run here (a missing extra, e.g. [corruptions] for robustness; images under 32 px). Without "
                        "it such a part is skipped with one line, and the other results are written")
    parser.add_argument("--latency-warmup", type=int, default=3,
                        help="untimed runs per runner and batch size first (default: %(default)s)")
    return parser


def evaluate(argv: list[str] | None = None) -> int:
    """``python -m patchplace.export.evaluate``: the arguments parsed first (``--help`` prints and exits 0, a usage
    error exits 2, as the evaluator's own parsing would), then the evaluator's main on them."""
    argv = list(sys.argv[1:] if argv is None else argv)
    evaluate_parser().parse_args(argv)
    from .evaluate import main

    return main(argv)
