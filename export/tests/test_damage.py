"""Correct under damage: non-finite weights, outputs or tolerances fail every gate; an exported pair is bound together
(a model.onnx beside another export's model.json is refused); killed exports leave nothing that lasts; each failure
is one line that says what happened and what to do."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from patchplace.data import SplitWriter
from patchplace.export import ExportError, export_checkpoint
from patchplace.export.__main__ import main as export_main
from patchplace.export.evaluate import OnnxModel, corrupted_images
from patchplace.export.evaluate import main as evaluate_main
from patchplace.models import create_model, save_pretrained

META = {"classes": ["a", "b", "c"], "normalization": {"mean": [0.5], "std": [0.25]}, "pad_to": 32, "method": "test"}


def _checkpoint(path: Path, seed: int = 0, spoil=None) -> Path:
    """A tiny 32 px gray classifier (3 classes) saved at ``path``; ``spoil(model)`` edits its weights first."""
    torch.manual_seed(seed)
    model = create_model("vit_micro", img_size=32, in_chans=1, num_classes=3).eval()
    if spoil is not None:
        with torch.no_grad():
            spoil(model)
    save_pretrained(model, path, metadata=META)
    return path


def _one_line(text: str) -> str:
    """The one ``error:`` line of a command's stderr (beside tqdm's cleared progress bars), no traceback."""
    lines = [line for line in text.replace("\r", "\n").splitlines() if line.strip() and "it/s]" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in text, text
    return lines[0]


def _nothing_in(folder: Path) -> bool:
    """No model, no sidecar, no temporary directory (the folder itself may not exist)."""
    return not folder.exists() or list(folder.iterdir()) == []


def _copy_pair(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for suffix in (".onnx", ".json"):
        shutil.copy(src.with_suffix(suffix), (dst / src.name).with_suffix(suffix))
    return dst / src.name


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Test shards (28 px gray, padded to 32) and two exports of different checkpoints: root/{a,b}/model.onnx."""
    root = tmp_path_factory.mktemp("damage")
    rng = np.random.default_rng(0)
    with SplitWriter(root / "shards", "test", dataset="toy", modality="image", classes=["a", "b", "c"],
                     info={"image_size": [28, 28], "channels": 1}, source="t", recipe="t", recipe_version=1) as w:
        for i in range(6):
            w.add_image(f"{i:03d}", i % 3, rng.integers(0, 256, (28, 28), dtype=np.uint8))
    for name, seed in (("a", 0), ("b", 1)):
        export_checkpoint(_checkpoint(root / f"ckpt_{name}", seed), root / name / "model.onnx")
    return root


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_fail_the_export_in_one_line(tmp_path, capsys, monkeypatch, value):
    import patchplace.export.exporter as exporter

    def spoil(model):
        model.blocks[0].mlp.fc1.weight[0, 0] = value

    ckpt = _checkpoint(tmp_path / "diverged", spoil=spoil)
    # load_pretrained refuses it, or else the exporter's own check, with the same line
    message = (r"diverged.* holds non-finite weights \((NaN|inf|NaN / inf) in 1 tensor\(s\), e\.g\. "
               r"blocks\.0\.mlp\.fc1\.weight\): the training that wrote it diverged; use an earlier checkpoint")
    with pytest.raises(ExportError, match=message) as caught:
        export_checkpoint(ckpt, tmp_path / "out" / "model.onnx")
    assert "\n" not in str(caught.value)
    assert _nothing_in(tmp_path / "out")
    assert export_main([str(ckpt), "--out", str(tmp_path / "out" / "model.onnx")]) == 2
    assert _one_line(capsys.readouterr().err).startswith(f"error: {ckpt}")
    assert _nothing_in(tmp_path / "out")
    torch.manual_seed(0)  # the exporter's own check, behind a loader that checks nothing
    model = create_model("vit_micro", img_size=32, in_chans=1, num_classes=3).eval()
    with torch.no_grad():
        spoil(model)
    monkeypatch.setattr(exporter, "load_pretrained", lambda path: (model, META))
    with pytest.raises(ExportError, match=message.replace("|NaN / inf", "")):
        export_checkpoint(ckpt, tmp_path / "out" / "model.onnx")
    assert _nothing_in(tmp_path / "out")


def test_finite_weights_that_overflow_fail_the_export(tmp_path):
    def spoil(model):  # every weight finite, the patch embedding overflows float32: inf, then NaN after LayerNorm
        model.patch_embed.proj.weight.fill_(3e38)

    ckpt = _checkpoint(tmp_path / "overflow", spoil=spoil)
    with pytest.raises(ExportError, match=r"PyTorch's logits output holds NaN.* although its weights are finite.*"
                                          r"use an earlier checkpoint"):
        export_checkpoint(ckpt, tmp_path / "out" / "model.onnx")
    assert _nothing_in(tmp_path / "out")


def test_a_nan_never_passes_a_tolerance(tmp_path, monkeypatch):
    import patchplace.export.exporter as exporter
    from patchplace.export.optimize import optimize_graph

    ckpt = _checkpoint(tmp_path / "ok")
    with pytest.raises(ExportError, match="tolerance must be a number >= 0"):
        export_checkpoint(ckpt, tmp_path / "out" / "model.onnx", tolerance=float("nan"))
    assert export_main([str(ckpt), "--out", str(tmp_path / "out" / "model.onnx"), "--tolerance", "nan"]) == 2

    def nan_head(graph, *args):  # an optimizer whose graph computes NaN logits: the plain graph is written instead
        optimized, fusion = optimize_graph(graph, *args)
        head = next(t for t in optimized.graph.initializer if t.name == "backbone.head.weight")
        head.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(head) * np.nan, head.name))
        return optimized, fusion

    monkeypatch.setattr(exporter, "optimize_graph", nan_head)
    sidecar = export_checkpoint(ckpt, tmp_path / "plain" / "model.onnx")
    assert not sidecar["graph"]["optimized"] and "non-finite" in sidecar["graph"]["reason"]
    assert all(np.isfinite(v) for v in sidecar["parity"]["max_abs_diff"].values())
    logits = OnnxModel(tmp_path / "plain" / "model.onnx").run(torch.zeros(2, 1, 32, 32))[0]
    assert np.isfinite(logits).all()
    # the last gate: NaN differences (behind a finite one, where max() would hide them) fail the export
    diffs = iter([1e-6, float("nan")])
    monkeypatch.setattr(exporter, "max_abs_diff", lambda *args, **kwargs: next(diffs, 1e-6))
    with pytest.raises(ExportError, match=r"ONNX Runtime's outputs are non-finite \(nan\) on random_batch_5") as e:
        export_checkpoint(ckpt, tmp_path / "out" / "model.onnx", optimize=False)
    assert "\n" not in str(e.value) and _nothing_in(tmp_path / "out")


def test_the_evaluator_reports_no_top1_for_non_finite_logits(pairs, tmp_path, capsys):
    path = _copy_pair(pairs / "a" / "model.onnx", tmp_path / "nan")
    graph = onnx.load(str(path))  # a graph whose head went NaN (a bit flip, a bad edit) but whose pair is bound
    head = next(t for t in graph.graph.initializer if t.name == "backbone.head.weight")
    head.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(head) * np.nan, head.name))
    onnx.save(graph, str(path))
    sidecar = json.loads(path.with_suffix(".json").read_text())
    if "onnx_sha256" in sidecar:
        from patchplace.export.exporter import sha256_file

        sidecar["onnx_sha256"] = sha256_file(path)
        path.with_suffix(".json").write_text(json.dumps(sidecar))
    code = evaluate_main([str(path), "--data", str(pairs / "shards" / "test"), "--out", str(tmp_path / "ort"),
                          "--robustness-limit", "0", "--latency-repeats", "0"])
    err = _one_line(capsys.readouterr().err)
    assert code == 2 and err.startswith(f"error: {path}: the model's logits hold NaN") and "no top-1" in err
    assert not (tmp_path / "ort").exists()


def test_a_model_beside_another_exports_sidecar_is_refused(pairs, tmp_path, capsys):
    path = _copy_pair(pairs / "a" / "model.onnx", tmp_path / "mixed")
    shutil.copy(pairs / "b" / "model.onnx", path)  # a model beside the sidecar of another export
    with pytest.raises(ExportError, match=r"come from different exports .* re-run the export") as caught:
        OnnxModel(path)
    assert "\n" not in str(caught.value)
    args = [str(path), "--data", str(pairs / "shards" / "test"), "--out", str(tmp_path / "ort"),
            "--robustness-limit", "0", "--latency-repeats", "0"]
    assert evaluate_main(args) == 2
    assert "come from different exports" in _one_line(capsys.readouterr().err)
    # the same export's model, changed after the export (still a loadable graph): refused too
    path = _copy_pair(pairs / "a" / "model.onnx", tmp_path / "changed")
    graph = onnx.load(str(path))
    graph.doc_string = "edited"
    onnx.save(graph, str(path))
    with pytest.raises(ExportError, match=r"model\.onnx changed after its export .* re-run the export"):
        OnnxModel(path)
    path.with_suffix(".json").write_text('{"kind": "classif')  # a torn sidecar
    with pytest.raises(ExportError, match=r"model\.json is not valid JSON .* re-run the export") as caught:
        OnnxModel(path)
    assert "\n" not in str(caught.value)
    assert OnnxModel(pairs / "b" / "model.onnx").meta["export_id"]  # an intact pair loads


def test_stale_temporary_directories_of_killed_exports_are_removed(pairs, tmp_path):
    from patchplace.export.exporter import temporary_prefix

    out = tmp_path / "model.onnx"
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    prefix = temporary_prefix(out)  # .model.onnx.HOST.PID.
    here = prefix.rsplit(".", 2)[0]
    stale = {"dead": f"{here}.{dead.pid}.abc12345", "legacy_old": ".model.onnx.k2j4h5g6"}
    kept = {"running": f"{here}.{os.getpid()}.def67890", "legacy_young": ".model.onnx.a1b2c3d4",
            "other_host": ".model.onnx.elsewhere.1.x9y8z7w6", "other_file": ".model.onnx.keep"}
    for name in [*stale.values(), *kept.values()]:
        if name == kept["other_file"]:
            (tmp_path / name).write_text("not a directory")
            continue
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.onnx").write_bytes(b"partial")
    past = time.time() - 3 * 24 * 3600
    os.utime(tmp_path / stale["legacy_old"], (past, past))
    export_checkpoint(pairs / "ckpt_a", out, optimize=False)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["model.json", "model.onnx", *kept.values()]), left


@pytest.mark.slow
def test_a_kill_anywhere_in_the_commit_leaves_a_consistent_or_refused_pair(pairs, tmp_path):
    """SIGKILL at every line event of the commit (the writes and renames at the end of the export), starting from an
    older export of another checkpoint: the evaluator's loader accepts the old or the new pair or refuses in one
    line, never a mixed pair; a re-run succeeds and leaves no temporary directory."""
    report = tmp_path / "report.json"
    driver = Path(__file__).with_name("kill_driver.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(driver), str(pairs / "ckpt_a"), str(pairs / "ckpt_b"),
                    str(tmp_path / "export"), str(report)], check=True, env=env, timeout=300)
    result = json.loads(report.read_text())
    points = result["points"]
    assert len(points) == result["distinct"] >= 10 and all(p["killed"] for p in points), result
    killed_lines = {p["line"] for p in points}
    assert result["never_executed"] == [] and set(result["commit_lines"]) <= killed_lines, "every line a kill point"
    states = [p["after_kill"]["state"] for p in points]
    assert {"old", "new", "refused"} <= set(states), states
    for p in points:
        after = p["after_kill"]
        assert after["state"] in ("old", "new", "refused"), p  # never "mixed"
        if after["state"] == "refused":
            assert "\n" not in after["message"] and "re-run" in after["message"], p
        assert p["rerun"]["state"] == "new" and p["leftovers"] == [], p


def test_pickle_checkpoints_are_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "ckpt").mkdir()
    torch.save({"w": torch.zeros(1)}, tmp_path / "ckpt" / "model.pt")
    assert export_main([str(tmp_path / "ckpt"), "--out", str(tmp_path / "m.onnx")]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "refusing to load" in err and "pickle" in err and "weights_only=False" not in err
    assert not (tmp_path / "m.onnx").exists()


def test_a_failed_int8_quantization_leaves_nothing(pairs, tmp_path, monkeypatch):
    import onnxruntime.quantization

    from patchplace.export.exporter import quantize_int8

    path = _copy_pair(pairs / "a" / "model.onnx", tmp_path)

    def dies_halfway(model_input, model_output, **kwargs):
        Path(model_output).write_bytes(b"half a model")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(onnxruntime.quantization, "quantize_dynamic", dies_halfway)
    with pytest.raises(OSError, match="No space left"):
        quantize_int8(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.json", "model.onnx"]


def test_an_int8_model_with_non_finite_logits_is_not_kept(pairs, tmp_path, monkeypatch, capsys):
    import patchplace.export.__main__ as cli
    from patchplace.export import exporter
    from patchplace.export.exporter import quantize_int8

    def nan_int8(path):  # a quantization gone wrong: NaN logits
        out = quantize_int8(path)
        graph = onnx.load(str(out))
        for t in graph.graph.initializer:
            if t.data_type == onnx.TensorProto.FLOAT:
                t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t) * np.nan, t.name))
        onnx.save(graph, str(out))
        return out

    monkeypatch.setattr(exporter, "quantize_int8", nan_int8)  # the command imports it from there when it runs
    assert cli.main([str(pairs / "ckpt_a"), "--out", str(tmp_path / "m.onnx"), "--data",
                     str(pairs / "shards" / "test"), "--samples", "4", "--quantize", "--no-optimize"]) == 2
    err = capsys.readouterr().err  # after the export's "graph: ..." line
    assert err.count("error:") == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: the int8 model's logits hold NaN")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json", "m.onnx"]  # the fp32 pair stays, no int8


def test_a_damaged_corruption_cache_file_is_recomputed(tmp_path):
    images = torch.randint(0, 256, (2, 1, 32, 32), dtype=torch.uint8)
    first = corrupted_images(images, "gaussian_noise", 1, tmp_path)
    (file,) = tmp_path.glob("gaussian_noise-1-2-*.npz")
    file.write_bytes(file.read_bytes()[:100])  # torn
    assert torch.equal(corrupted_images(images, "gaussian_noise", 1, tmp_path), first)
    with np.load(file) as data:
        assert torch.equal(torch.from_numpy(data["images"]), first)  # and rewritten whole
