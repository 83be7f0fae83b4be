"""``python -m patchplace.export`` and ``python -m patchplace.export.evaluate`` as a user types them, on arguments that
cannot work: each answer is one ``error:`` line on stderr naming the cause and the fix (no usage block, no
traceback), exit 2, nothing written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def one_line(tmp_path: Path, *args: str) -> str:
    """The single stderr line of ``python -m ARGS`` run in ``tmp_path`` (asserted: exit 2, nothing on stdout, nothing
    left in ``tmp_path``)."""
    result = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1 and "error: " in lines[0] and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stdout == "" and list(tmp_path.iterdir()) == [], result.stdout[-2000:]
    return lines[0]


@pytest.mark.parametrize("args, says", [
    (["/nonexistent"], "the following arguments are required: --out"),
    (["/nonexistent", "--out", "model.onnx", "--opset", "9"], "--opset must be >= 17"),
    (["/nonexistent", "--out", "model.onnx", "--kind", "logits"], "argument --kind: invalid choice: 'logits'"),
])
def test_a_usage_error_is_one_line_with_where_the_options_are(tmp_path, args, says):
    line = one_line(tmp_path, "patchplace.export", *args)
    assert says in line and line.endswith("(python -m patchplace.export --help lists the options)"), line


def test_a_checkpoint_that_is_not_there_is_one_line(tmp_path):
    line = one_line(tmp_path, "patchplace.export", "/nonexistent", "--out", "model.onnx")
    assert line.startswith("error: /nonexistent: no such directory") and "save_pretrained()" in line, line


def test_a_file_given_as_the_checkpoint_is_one_line(tmp_path):
    weights = tmp_path.parent / f"{tmp_path.name}-model.safetensors"  # outside tmp_path: nothing may appear there
    weights.write_bytes(b"\0" * 8)
    line = one_line(tmp_path, "patchplace.export", str(weights), "--out", "model.onnx")
    assert "a file, not a directory" in line and "config.json + model.safetensors" in line, line


def test_the_evaluators_usage_error_is_one_line(tmp_path):
    line = one_line(tmp_path, "patchplace.export.evaluate", "model.onnx")
    assert "the following arguments are required: --data" in line, line
    assert line.endswith("(python -m patchplace.export.evaluate --help lists the options)"), line
