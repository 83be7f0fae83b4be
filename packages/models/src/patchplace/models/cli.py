"""``python -m patchplace.models.convert``'s command line without torch: its parser (``--help`` and the usage errors
answer in a fraction of a second: the package imports its modules on first use) and the entry that imports the
converter (torch, timm) only once the arguments parse."""

from __future__ import annotations

import argparse
import importlib
import sys

from .layouts import IMAGENET_MEAN, IMAGENET_STD, LAYOUTS, METHODS

# every patchplace command's --help width (patchplace.data.helpformat.HELP_WIDTH), written again here because this
# package depends on none of ours; tests/test_help_width.py holds the two equal
HELP_WIDTH = 100


class _HelpFormatter(argparse.HelpFormatter):
    """--help in at most :data:`HELP_WIDTH` columns whatever the terminal's width."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: int | None = None) -> None:
        import shutil

        width = min(width or shutil.get_terminal_size().columns - 2, HELP_WIDTH)
        super().__init__(prog, indent_increment, max_help_position, width)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m patchplace.models.convert", formatter_class=_HelpFormatter,
        description="The authors' released weights -> a patchplace checkpoint (config.json + model.safetensors + "
                    "card), with the metadata evaluation reads.",
        epilog="Layouts and where their files are published: docs/interop.md, section \"The authors' released "
               "weights\".")
    parser.add_argument("file", help="the released .pth / .pth.tar / .bin / .safetensors file")
    parser.add_argument("--from", dest="layout", required=True, choices=list(LAYOUTS), help="the file's layout")
    parser.add_argument("--out", required=True, help="checkpoint directory to write (new, or a checkpoint)")
    parser.add_argument("--encoder", choices=["target", "context"],
                        help="ijepa / stop: the target encoder (default: what the papers evaluate) or the context one")
    parser.add_argument("--num-heads", type=int, help="attention heads (default: the standard ViT's for its width)")
    parser.add_argument("--method", choices=list(METHODS), help="timm: the training that made the weights "
                                                                "(default: supervised)")
    parser.add_argument("--mean", type=float, nargs="+", default=list(IMAGENET_MEAN), help="normalization mean")
    parser.add_argument("--std", type=float, nargs="+", default=list(IMAGENET_STD), help="normalization std")
    parser.add_argument("--crop-pct", type=float, help="evaluation crop (default: 0.875 at 224 px, else 1)")
    parser.add_argument("--dataset", default="imagenet-1k", help="the data the weights were trained on")
    return parser.parse_args(argv)


def convert(argv: list[str] | None = None) -> int:
    """The converter's main on ``argv`` (default: the process's arguments), imported once they parse."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parse_args(argv)  # --help, a usage error: exits here
    return importlib.import_module("patchplace.models.convert").main(argv)
