"""One --help width for every command: the converter's formatter (patchplace-models, which imports nothing of ours)
caps argparse's width where patchplace.data.helpformat's does, on a wide terminal and on a narrow one."""

from __future__ import annotations

import argparse

import pytest

from patchplace.data.helpformat import HELP_WIDTH, help_formatter
from patchplace.models.cli import _HelpFormatter


@pytest.mark.parametrize("columns", ["250", "60"])
def test_the_converters_help_width_is_every_commands(columns, monkeypatch):
    monkeypatch.setenv("COLUMNS", columns)
    shared = help_formatter(argparse.HelpFormatter)("prog")
    assert _HelpFormatter("prog")._width == shared._width == min(int(columns) - 2, HELP_WIDTH)
