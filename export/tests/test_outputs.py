"""What an export and an ONNX Runtime evaluation write, and where: the sidecar and int8 names come from the whole
``--out`` name (one rule for the exporter and the evaluator), a re-export leaves no int8 copy of another checkpoint,
the int8 refusal gives a command that works, a corruption cache is used only when it is what it says, and an output
that cannot be written is one line before any work."""

from __future__ import annotations

import io
import json
import shlex
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from patchplace.data import SplitWriter
from patchplace.export import exporter, load_export
from patchplace.export.__main__ import main as export_main
from patchplace.export.evaluate import corrupted_images
from patchplace.export.evaluate import main as evaluate_main
from patchplace.export.exporter import fp32_of, int8_of, sidecar_of
from patchplace.models import create_model, save_pretrained

META = {"classes": ["a", "b", "c"], "normalization": {"mean": [0.5], "std": [0.25]}, "pad_to": 32, "method": "test"}
FAST = ["--robustness-limit", "0", "--latency-repeats", "0", "--consistency-limit", "4", "--batch-size", "8"]


def _one_line(text: str) -> str:
    lines = [line for line in text.replace("\r", "\n").splitlines() if line.strip() and "it/s]" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in text, text
    return lines[0]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """Test shards (28 px gray, padded to 32) and two tiny checkpoints of different weights: root/ckpt_{a,b}."""
    root = tmp_path_factory.mktemp("outputs")
    rng = np.random.default_rng(0)
    with SplitWriter(root / "shards", "test", dataset="toy", modality="image", classes=["a", "b", "c"],
                     info={"image_size": [28, 28], "channels": 1}, source="t", recipe="t", recipe_version=1) as w:
        for i in range(6):
            w.add_image(f"{i:03d}", i % 3, rng.integers(0, 256, (28, 28), dtype=np.uint8))
    for name, seed in (("a", 0), ("b", 1)):
        torch.manual_seed(seed)
        save_pretrained(create_model("vit_micro", img_size=32, in_chans=1, num_classes=3).eval(), root / f"ckpt_{name}",
                        metadata=META)
    return root


def _export_id(path: Path) -> str:
    return {p.key: p.value for p in onnx.load(str(path)).metadata_props}["export_id"]


@pytest.fixture(scope="module")
def exported(toy):
    """ckpt_a exported to model.v1.onnx with its int8 copy, ckpt_b to model.v2.onnx, side by side."""
    out = toy / "exports"
    assert export_main([str(toy / "ckpt_a"), "--out", str(out / "model.v1.onnx"), "--no-optimize", "--quantize"]) == 0
    assert export_main([str(toy / "ckpt_b"), "--out", str(out / "model.v2.onnx"), "--no-optimize"]) == 0
    return out


def test_sidecar_and_int8_names_come_from_the_whole_out_name(toy, exported, tmp_path, capsys):
    assert sidecar_of("d/model.v1.onnx") == Path("d/model.v1.json") and int8_of("d/model.v1.onnx") == Path(
        "d/model.v1.int8.onnx") and fp32_of("d/model.v1.int8.onnx") == Path("d/model.v1.onnx")
    assert sorted(p.name for p in exported.iterdir()) == ["model.v1.int8.onnx", "model.v1.json", "model.v1.onnx",
                                                          "model.v2.json", "model.v2.onnx"]
    v1, _ = load_export(exported / "model.v1.onnx")  # the evaluator's loader finds each one's own sidecar
    v2, _ = load_export(exported / "model.v2.onnx")
    assert v1["export_id"] != v2["export_id"] and v1["provenance"]["checkpoint"].endswith("ckpt_a")
    assert _export_id(exported / "model.v1.int8.onnx") == v1["export_id"]
    capsys.readouterr()
    # an --out that is not NAME.onnx (its sidecar would be another name's) or is an int8 copy's name: refused
    for out, said in (("model.v3", "name the model NAME.onnx (e.g. --out"), ("model.int8.onnx", "int8 copy")):
        assert export_main([str(toy / "ckpt_a"), "--out", str(tmp_path / out)]) == 2
        assert said in _one_line(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == [], "a refused export writes nothing"


def test_a_reexport_removes_the_old_int8_copy(toy, exported, tmp_path):
    for file in exported.glob("model.v1.*"):
        (tmp_path / file.name).write_bytes(file.read_bytes())
    out = tmp_path / "model.v1.onnx"
    assert export_main([str(toy / "ckpt_b"), "--out", str(out), "--no-optimize"]) == 0
    assert not int8_of(out).exists(), "the int8 copy of ckpt_a's export stood beside ckpt_b's pair"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.v1.json", "model.v1.onnx"]
    assert _export_id(out) == json.loads(sidecar_of(out).read_text())["export_id"]


def test_the_int8_refusal_gives_a_command_that_works(toy, exported, tmp_path, capsys):
    out = exported / "model.v1.onnx"
    capsys.readouterr()
    argv = [str(int8_of(out)), "--data", str(toy / "shards" / "test"), "--out", str(tmp_path / "ev"), *FAST]
    assert evaluate_main(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert not (tmp_path / "ev").exists()
    command = shlex.split(line.split("evaluate the pair (", 1)[1].split(");", 1)[0])
    assert command[:3] == ["python", "-m", "patchplace.export.evaluate"] and command[3] == str(out)
    assert evaluate_main(command[3:]) == 0, "the advised command runs"
    assert (tmp_path / "ev" / "results.json").is_file()


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def test_a_corruption_cache_is_used_only_when_it_matches_what_it_records(tmp_path, capsys):
    images = torch.randint(0, 256, (2, 1, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    fresh = corrupted_images(images, "brightness", 1, tmp_path)
    (file,) = tmp_path.glob("brightness-1-2-*.npz")
    assert torch.equal(corrupted_images(images, "brightness", 1, tmp_path), fresh)
    assert capsys.readouterr().err == ""
    with np.load(file) as data:
        meta = str(data["meta"])
    other = json.dumps({**json.loads(meta), "severity": 2})

    def write(images_, meta_):
        with open(file, "wb") as f:
            np.savez(f, images=images_, meta=np.array(meta_))

    damages = {  # what the file holds -> what the one line says
        "same-shape zeros": (lambda: write(np.zeros(tuple(images.shape), np.uint8), meta), "all zero"),
        "zero-filled file": (lambda: file.write_bytes(b"\0" * 600), "all zero bytes"),
        "another severity's": (lambda: write(fresh.numpy(), other), "another corruption (severity 2"),
        "truncated": (lambda: file.write_bytes(file.read_bytes()[:100]), "not a readable cache file"),
        "a plain .npy": (lambda: file.write_bytes(_npy(fresh.numpy())), "no record of what it holds"),
    }
    for name, (damage, said) in damages.items():
        damage()
        assert torch.equal(corrupted_images(images, "brightness", 1, tmp_path), fresh), name
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and said in err and str(file) in err, (name, err)
        assert torch.equal(corrupted_images(images, "brightness", 1, tmp_path), fresh)
        assert capsys.readouterr().err == "", f"{name}: rewritten whole"
    assert corrupted_images(images[:1], "brightness", 1, tmp_path).shape[0] == 1, "other images: a file of their own"


def test_an_output_that_cannot_be_written_is_one_line_before_any_work(toy, tmp_path, capsys, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("work began before the output was checked")

    monkeypatch.setattr(exporter, "load_pretrained", no_work)
    monkeypatch.setattr("patchplace.export.evaluate.evaluate", no_work)
    monkeypatch.setattr("patchplace.export.__main__.real_inputs", no_work)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    (tmp_path / "model.onnx").mkdir()
    (tmp_path / "ev" / "results.json").mkdir(parents=True)
    read_only = Path("/proc/patchplace-test")  # no process, root included, creates files in /proc
    exports = {str(tmp_path / "model.onnx"): "is a directory", str(a_file / "m.onnx"): "is a file, not a directory",
               str(read_only / "m.onnx"): "cannot create files in /proc",
               str(tmp_path / ("a" * 300 + ".onnx")): "305 bytes long, and this file system takes names of at most"}
    for out, said in exports.items():
        assert export_main([str(toy / "ckpt_a"), "--out", out, "--data", str(toy / "shards" / "test")]) == 2
        assert said in _one_line(capsys.readouterr().err), out
    model = ["model.onnx", "--data", str(toy / "shards" / "test")]
    evaluations = {("--out", str(a_file)): "is a file, not a directory",
                   ("--out", str(read_only)): "cannot create files in /proc",
                   ("--out", str(tmp_path / "ev")): "results.json is a directory",
                   ("--out", str(tmp_path / "ok"), "--corruption-cache", str(a_file)): "is a file, not a directory"}
    for args, said in evaluations.items():
        assert evaluate_main([*model, *args]) == 2
        assert said in _one_line(capsys.readouterr().err), args
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "ev", "model.onnx"], "nothing written"
