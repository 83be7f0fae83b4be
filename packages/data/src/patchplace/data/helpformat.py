"""The --help width of every command line (``python -m patchplace.data``, the export's, the pipelines' and the
research's): at most :data:`HELP_WIDTH` columns, whatever the terminal's width. It lives in the package every
other depends on, so that each shares it."""

from __future__ import annotations

import argparse
import shutil

HELP_WIDTH = 100


def help_formatter(base: type[argparse.HelpFormatter]) -> type[argparse.HelpFormatter]:
    """``base`` with its width capped at :data:`HELP_WIDTH` columns (argparse takes the terminal's, less 2)."""

    class Capped(base):  # type: ignore[misc, valid-type]
        def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                     width: int | None = None) -> None:
            width = min(width or shutil.get_terminal_size().columns - 2, HELP_WIDTH)
            super().__init__(prog, indent_increment, max_help_position, width)

    return Capped
