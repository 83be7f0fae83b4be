"""``python -m patchplace.models.convert`` as a user runs it, on the files and places a fault probe handed it: each
refusal is exactly one ``error:`` line on stderr (no traceback, no warning raised on the way — torch's load warnings
are Python warnings, recorded here with every filter at "always" —, no advice to allowlist a pickle's globals), exit 2,
and nothing written or changed; one case runs as its own process, ``python -m`` as typed. (The layouts, converted
against a reference, and their key / shape refusals: packages/models/tests/test_convert.py.)"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--from", "mae", "--num-heads", "2", "--mean", "0.5", "--std", "0.25"]


def encoder(d: int = 64, depth: int = 1, patch: int = 4, grid: int = 8) -> dict[str, torch.Tensor]:
    """An MAE encoder's keys (models_mae.py MaskedAutoencoderViT: patch_embed.proj, cls_token, pos_embed, blocks,
    norm), one gray channel, random values."""
    g = torch.Generator().manual_seed(3)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    out = {"patch_embed.proj.weight": randn(d, 1, patch, patch), "patch_embed.proj.bias": randn(d),
           "cls_token": randn(1, 1, d), "pos_embed": randn(1, grid * grid + 1, d),
           "norm.weight": 1 + randn(d), "norm.bias": randn(d)}
    for i in range(depth):
        p = f"blocks.{i}."
        out.update({f"{p}norm1.weight": 1 + randn(d), f"{p}norm1.bias": randn(d),
                    f"{p}attn.qkv.weight": randn(3 * d, d), f"{p}attn.qkv.bias": randn(3 * d),
                    f"{p}attn.proj.weight": randn(d, d), f"{p}attn.proj.bias": randn(d),
                    f"{p}norm2.weight": 1 + randn(d), f"{p}norm2.bias": randn(d),
                    f"{p}mlp.fc1.weight": randn(4 * d, d), f"{p}mlp.fc1.bias": randn(4 * d),
                    f"{p}mlp.fc2.weight": randn(d, 4 * d), f"{p}mlp.fc2.bias": randn(d)})
    return out


class Planted:
    """A pickle whose loading would run a shell command (creating ``marker``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def convert(capsys, file: Path | str, out: Path | str) -> tuple[int, str]:
    """(exit status, stderr) of the command converting ``file`` to ``out``; a warning raised on the way is an
    error of the test."""
    from patchplace.models.convert import main

    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        rc = main([str(file), *SMALL, "--out", str(out)])
    err = capsys.readouterr().err
    assert not raised, [str(w.message) for w in raised]
    return rc, err


def refusal(capsys, file: Path | str, out: Path | str) -> str:
    """The one line the command refuses ``file`` -> ``out`` with (asserted: exit 2, nothing else on stderr)."""
    rc, err = convert(capsys, file, out)
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    assert "allowlist" not in err.lower() and "Traceback" not in err, err
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every entry under ``folder``: a file's bytes, a link's target."""
    return {str(p.relative_to(folder)): os.readlink(p) if p.is_symlink() else p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_symlink() or p.is_file()}


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """An MAE-layout release (checkpoint['model'], as main_pretrain.py saves it)."""
    path = tmp_path_factory.mktemp("release") / "mae.pth"
    torch.save({"model": encoder()}, path)
    return path


def training_run(run: Path) -> Path:
    """A run directory as patchplace.pipelines leaves it: lock, config, a sealed step, the ``checkpoint`` link."""
    from patchplace.models import create_model, save_pretrained

    step = run / "checkpoints" / "step-00000003"
    save_pretrained(create_model("vit_micro", img_size=16), step / "checkpoint", {"method": "mae"})
    (step / "COMPLETE").write_text("{}\n")
    (run / "config.yaml").write_text("method: mae\n")
    (run / ".lock").write_text("")
    (run / "checkpoint").symlink_to("checkpoints/step-00000003/checkpoint")
    return step / "checkpoint"


def test_the_release_converts_and_a_planted_legacy_pickle_is_one_line_as_typed(released, tmp_path):
    """``python -m patchplace.models.convert`` in a process of its own: the control (the release and the options of
    every refusal below convert), then a planted pre-zip pickle, whose torch.load(weights_only=True) answer is a
    multi-line UnpicklingError advising to allowlist its globals."""
    def run(file: Path, out: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "patchplace.models.convert", str(file), *SMALL, "--out", str(out)],
                              capture_output=True, text=True, cwd=ROOT, timeout=300)

    result = run(released, tmp_path / "converted")
    assert result.returncode == 0 and (tmp_path / "converted" / "model.safetensors").is_file(), result.stderr
    marker, planted = tmp_path / "pwned", tmp_path / "planted.pth"
    torch.save({"model": encoder(), "hook": Planted(marker)}, planted, _use_new_zipfile_serialization=False)
    result = run(planted, tmp_path / "out")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: ") and "posix.system" in result.stderr, result.stderr
    assert "Warning" not in result.stderr and "allowlist" not in result.stderr.lower()
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_training_runs_checkpoint_and_its_link_are_not_written_into(capsys, released, tmp_path):
    run = tmp_path / "run"
    sealed = training_run(run)
    before = snapshot(run)
    for out in (run / "checkpoint", sealed, run / "converted"):
        line = refusal(capsys, released, out)
        assert f"inside the training run {run}" in line, line
    assert snapshot(run) == before


def test_an_out_longer_than_a_file_name_can_be_is_one_line(capsys, released, tmp_path):
    line = refusal(capsys, released, tmp_path / ("x" * 300))
    assert "300" in line and "--out" in line, line


def test_a_directory_and_an_empty_file_are_not_weights(capsys, tmp_path):
    (tmp_path / "folder").mkdir()
    assert "is a directory" in refusal(capsys, tmp_path / "folder", tmp_path / "out")
    (tmp_path / "empty.pth").write_bytes(b"")
    assert "is empty (0 bytes)" in refusal(capsys, tmp_path / "empty.pth", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("form", ["legacy", "pickle.dump protocol 4", "torch.save protocol 4",
                                  "legacy protocol 4", "legacy numpy global"])
def test_pickles_torch_would_warn_about_are_refused_by_name(capsys, tmp_path, form):
    """torch.load(weights_only=True) would answer these with a multi-line UnpicklingError advising to allowlist the
    globals (or, for a planted one, run it without weights_only): the command names the file's problem instead."""
    marker, path = tmp_path / "pwned", tmp_path / "file.pth"
    if form == "legacy":
        torch.save({"model": encoder(), "hook": Planted(marker)}, path, _use_new_zipfile_serialization=False)
    elif form == "pickle.dump protocol 4":
        with open(path, "wb") as f:
            pickle.dump({"model": encoder(), "hook": Planted(marker)}, f, protocol=4)
    elif form == "legacy numpy global":  # numpy's reconstructor: not torch's weights_only allowlist
        torch.save({"model": encoder(), "stats": np.zeros(3)}, path, _use_new_zipfile_serialization=False)
    else:
        torch.save({"model": encoder()}, path, pickle_protocol=4, _use_new_zipfile_serialization=form == "torch.save "
                   "protocol 4")
    line = refusal(capsys, path, tmp_path / "out")
    expected = {"legacy numpy global": "its pickle names numpy", "torch.save protocol 4": "protocol 4",
                "legacy protocol 4": "protocol 4"}.get(form, "posix.system")
    assert expected in line, line
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_legacy_torch_save_of_weights_only_converts(capsys, tmp_path):
    """The pre-zip format (torch.save(_use_new_zipfile_serialization=False)) with nothing but tensors is read."""
    torch.save({"model": encoder()}, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    rc, err = convert(capsys, tmp_path / "legacy.pth", tmp_path / "out")
    assert rc == 0 and (tmp_path / "out" / "model.safetensors").is_file(), err


def test_integer_weights_are_refused_not_cast_to_zeros(capsys, tmp_path):
    weights = encoder()
    weights["blocks.0.attn.qkv.weight"] = (weights["blocks.0.attn.qkv.weight"] * 100).long()
    save_file(weights, str(tmp_path / "int.safetensors"))
    line = refusal(capsys, tmp_path / "int.safetensors", tmp_path / "out")
    assert "blocks.0.attn.qkv.weight" in line and "int64" in line, line
    assert not (tmp_path / "out").exists()


def test_a_nan_weight_is_refused(capsys, tmp_path):
    weights = encoder()
    weights["blocks.0.mlp.fc1.weight"][3, 5] = float("nan")
    torch.save({"model": weights}, tmp_path / "nan.pth")
    line = refusal(capsys, tmp_path / "nan.pth", tmp_path / "out")
    assert "blocks.0.mlp.fc1.weight" in line and "NaN" in line, line
    assert not (tmp_path / "out").exists()


def test_a_patchplace_checkpoint_is_not_converted_as_an_mae_release(capsys, tmp_path):
    """Its model.safetensors holds timm's keys, which MAE's layout reads too: converted, it would be labelled MAE's."""
    checkpoint = training_run(tmp_path / "run")
    for file in (checkpoint / "model.safetensors", checkpoint):
        line = refusal(capsys, file, tmp_path / "out")
        assert "patchplace checkpoint" in line, line
    assert not (tmp_path / "out").exists()
