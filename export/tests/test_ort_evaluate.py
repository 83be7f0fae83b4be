"""The ONNX Runtime evaluator: numbers equal to PyTorch's on the same model, consistency behaviour, corruptions,
latency, and errors for mismatched models / data."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from patchplace.data import SplitWriter
from patchplace.export import ExportError, export_checkpoint
from patchplace.export.evaluate import OnnxModel, accuracy, consistency, corrupt_batch, latency, load_uint8, main
from patchplace.finetune import consistency_curve, torch_predict
from patchplace.models import create_model, save_pretrained
from patchplace.objectives import jigsaw


def train_to_read_positions(model, images: torch.Tensor, labels: torch.Tensor, max_steps: int = 600) -> None:
    """Train the toy until it classifies all 24 images (the class is where the square is, so it must use its PE).

    Built to learn on any CPU: mean pooling and a PE table 25x its init scale (std 0.5) make the position signal
    strong from step 0, and it trains until learned (8 seeds x 1 / 2 threads here: 52-180 steps) instead of for a
    fixed count whose end depends on float rounding; it then checks that it learned, and says so if not."""
    x = (torch.nn.functional.pad(images, (2, 2, 2, 2)).float() / 255 - 0.5) / 0.25
    with torch.no_grad():
        model.pos_table.mul_(25.0)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for _ in range(max_steps):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, labels)
        if loss.item() < 0.05 and bool((logits.argmax(1) == labels).all()):
            return
        opt.zero_grad()
        loss.backward()
        opt.step()
    raise AssertionError(f"the position toy did not learn in {max_steps} steps (loss {loss.item():.3f}): the "
                         "consistency tests below need a model that reads positions")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """28 x 28 gray shards (3 classes) and exported 32 px / patch 4 classifiers (pad 28 -> 32, as Fashion-MNIST)."""
    root = tmp_path_factory.mktemp("ort")
    rng = np.random.default_rng(0)
    with SplitWriter(root / "shards", "test", dataset="toy", modality="image", classes=["a", "b", "c"],
                     info={"image_size": [28, 28], "channels": 1}, source="t", recipe="t", recipe_version=1) as w:
        for i in range(24):  # the class is *where* a bright square sits (left / middle / right): layout matters
            image = rng.integers(0, 40, (28, 28), dtype=np.uint8)
            top, left = [2, 6, 10, 14][i % 4], [2, 10, 18][i % 3]  # patch-aligned after padding: no content cue
            image[top: top + 8, left: left + 8] = 250
            w.add_image(f"{i:03d}", i % 3, image)
    meta = {"classes": ["a", "b", "c"], "normalization": {"mean": [0.5], "std": [0.25]}, "pad_to": 32}
    images, labels = load_uint8(root / "shards" / "test", None, 24)
    models = {}
    for name, overrides in {"learned": {"pos_embed": "learned", "global_pool": "mean"},
                            "nope": {"pos_embed": "none", "class_token": False, "global_pool": "mean"},
                            "mjp": {"pos_embed": "learned", "unknown_pos": True}}.items():
        torch.manual_seed(0)
        model = create_model("vit_micro", img_size=32, in_chans=1, num_classes=3, **overrides)
        if name == "learned":
            train_to_read_positions(model, images, labels)
        model.eval()
        save_pretrained(model, root / name, metadata=meta)
        export_checkpoint(root / name, root / f"{name}.onnx")
        models[name] = model
    return root, models


def test_onnx_numbers_equal_pytorch_numbers(toy):
    """Accuracy, consistency and Diff. Norm of the ONNX Runtime evaluator equal the PyTorch evaluator's on the same
    model: one implementation (``consistency_curve``), one feature (the head's input), any batch size."""
    root, models = toy
    images, labels = load_uint8(root / "shards" / "test", None, 8)
    for name in ("learned", "mjp"):
        onnx_model = OnnxModel(root / f"{name}.onnx")
        got = accuracy(onnx_model, images, labels, 8)
        clean = onnx_model.normalize(onnx_model.pad(images))
        with torch.no_grad():
            logits = models[name](clean)
        assert round(got["top1"] * 24) == int((logits.argmax(1) == labels).sum()) and got["count"] == 24
        ort_curve = consistency(onnx_model, images, 8, ratios=(0.15, 0.5), seed=1)
        torch_curve = consistency_curve(torch_predict(models[name]), clean, 4, (0.15, 0.5), seed=1, batch_size=24,
                                        mark_unknown=models[name].unknown_pos_embed is not None)
        assert ort_curve.keys() == torch_curve.keys()
        for gamma, ort_value in ort_curve.items():
            assert ort_value["consistency"] == torch_curve[gamma]["consistency"], (name, gamma)
            assert ort_value["diff_norm"] == pytest.approx(torch_curve[gamma]["diff_norm"], rel=1e-4, abs=1e-5)
            assert ort_value["diff_norm"] > 0
    assert OnnxModel(root / "mjp.onnx").inputs == ["pixels", "unknown_pos"]


def test_diff_norm_is_measured_on_the_feature_the_head_reads(toy):
    root, models = toy
    model = models["learned"]  # mean-pooled: the head reads the patch mean, not token 0
    images, _ = load_uint8(root / "shards" / "test", None, 8)
    x = OnnxModel(root / "learned.onnx").normalize(OnnxModel(root / "learned.onnx").pad(images))
    curve = consistency_curve(torch_predict(model), x, 4, (0.5,), seed=3, mark_unknown=False)
    shuffled, _ = jigsaw(x, 4, 0.5, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        pooled = [model.forward_head(model.forward_features(v), pre_logits=True) for v in (x, shuffled)]
    assert curve["0.5"]["diff_norm"] == pytest.approx(float((pooled[0] - pooled[1]).norm(dim=1).mean()), rel=1e-5)


def test_no_pe_models_are_fully_consistent_pe_models_are_not(toy):
    root, _ = toy
    images, _ = load_uint8(root / "shards" / "test", None, 8)
    nope = consistency(OnnxModel(root / "nope.onnx"), images, 8, ratios=(0.5,))
    assert nope["0.5"]["consistency"] == 1.0 and nope["0.5"]["diff_norm"] < 1e-3  # permutation invariant
    pe = consistency(OnnxModel(root / "learned.onnx"), images, 8, ratios=(0.5,))
    # The trained PE model reads where the square is: shuffling half the patches changes its mind on some images;
    # the no-PE model moves by float noise only.
    assert pe["0.5"]["consistency"] < 1.0 and pe["0.5"]["diff_norm"] > 100 * nope["0.5"]["diff_norm"]
    other_batch = consistency(OnnxModel(root / "learned.onnx"), images, 5, ratios=(0.5,))  # batch size: no effect
    assert other_batch["0.5"]["consistency"] == pe["0.5"]["consistency"]
    assert other_batch["0.5"]["diff_norm"] == pytest.approx(pe["0.5"]["diff_norm"], rel=1e-6)
    mjp = OnnxModel(root / "mjp.onnx")
    assert 0.0 <= consistency(mjp, images, 8, (0.5,))["0.5"]["consistency"] <= 1.0


def test_corruptions_keep_shape_and_change_pixels():
    images = torch.full((2, 1, 32, 32), 128, dtype=torch.uint8)
    for name in ("gaussian_noise", "contrast", "pixelate"):
        out = corrupt_batch(images, name, 3)
        assert out.shape == images.shape and out.dtype == torch.uint8
    assert not torch.equal(corrupt_batch(images, "gaussian_noise", 5), images)
    with pytest.raises(ExportError, match="at least 32 px"):
        corrupt_batch(images[:, :, :16, :16], "contrast", 1)


def test_cli_writes_results_and_reports_which_corruptions_ran(toy, tmp_path):
    root, _ = toy
    assert main([str(root / "learned.onnx"), "--data", str(root / "shards" / "test"), "--out", str(tmp_path),
                 "--robustness-limit", "4", "--latency-repeats", "2", "--checkpoint", str(root / "learned")]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    r = results["robustness"]
    assert len(r["ran"]) + len(r["failed"]) == 15 and "gaussian_noise" in r["ran"]
    assert set(results["latency"]) >= {"onnxruntime/batch1", "pytorch/batch64"}
    assert (tmp_path / "consistency.png").is_file() and "top-1" in (tmp_path / "results.md").read_text()


def test_mismatched_models_and_data_are_refused(toy, tmp_path, capsys):
    root, _ = toy
    (tmp_path / "model.onnx").write_bytes(b"junk")
    (tmp_path / "model.json").write_text(json.dumps({"kind": "classifier", "modality": "image",
                                                    "outputs": ["logits", "pooled"]}))
    with pytest.raises(ExportError, match="not a loadable ONNX model"):
        OnnxModel(tmp_path / "model.onnx")
    with pytest.raises(ExportError, match="not an exported model"):
        OnnxModel(tmp_path / "other.onnx")
    with SplitWriter(tmp_path / "s", "test", dataset="five", modality="image", classes=list("abcde"),
                     info={"image_size": [28, 28], "channels": 1}, source="t", recipe="t", recipe_version=1) as w:
        w.add_image("0", 0, np.zeros((28, 28), np.uint8))
    assert main([str(root / "learned.onnx"), "--data", str(tmp_path / "s" / "test")]) == 2
    assert "the model's classes are [a, b, c] (its training data) but five/test holds [a, b, c, d, e] (label 3 is " \
           "absent for the model, 'd' in the data)" in capsys.readouterr().err
    # as many classes, other names (or order): a top-1 would compare unrelated labels
    with SplitWriter(tmp_path / "x", "test", dataset="xyz", modality="image", classes=["a", "c", "b"],
                     info={"image_size": [28, 28], "channels": 1}, source="t", recipe="t", recipe_version=1) as w:
        w.add_image("0", 0, np.zeros((28, 28), np.uint8))
    assert main([str(root / "learned.onnx"), "--data", str(tmp_path / "x" / "test"), "--out", str(tmp_path / "o")]) == 2
    assert "error: the model's classes are [a, b, c] (its training data) but xyz/test holds [a, c, b] (label 1 is " \
           "'b' for the model, 'c' in the data): a top-1 would compare unrelated labels" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    # 64 px shards for the 32 px model (sidecar pad_to 32): centre-cropped with exit 0 and top-1 0.10 before
    with SplitWriter(tmp_path / "big", "test", dataset="big", modality="image", classes=list("abc"),
                     info={"image_size": [64, 64], "channels": 1}, source="t", recipe="t", recipe_version=1) as w:
        w.add_image("0", 0, np.zeros((64, 64), np.uint8))
    assert main([str(root / "learned.onnx"), "--data", str(tmp_path / "big" / "test")]) == 2
    assert "hold 64x64 images, larger than the model's 32x32 input" in capsys.readouterr().err
    assert latency(OnnxModel(root / "learned.onnx"), batch_sizes=(2,), repeats=1)["onnxruntime/batch2"]["p50_ms"] > 0


def test_cli_real_input_parity_and_int8_variant(toy, tmp_path, capsys):
    from patchplace.export.__main__ import main as export_main

    root, _ = toy
    assert export_main([str(root / "learned"), "--out", str(tmp_path / "m.onnx"), "--data",
                        str(root / "shards" / "test"), "--samples", "8", "--quantize"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parity"]["max_abs_diff"]["real_0"] <= 1e-4
    int8 = report["int8"]
    assert int8["samples"] == 8 and int8["bytes"] < int8["fp32_bytes"] and 0 <= int8["agreement"] <= 1
    assert int8["top1_delta"] == pytest.approx(int8["int8_top1"] - int8["fp32_top1"])
    # quantized from the optimized graph (its fused attention becomes QAttention), metadata kept
    quantized = onnx.load(str(tmp_path / "m.int8.onnx"))
    assert {"QAttention", "BiasGelu"} <= {n.op_type for n in quantized.graph.node}
    props = {p.key: p.value for p in quantized.metadata_props}
    assert json.loads(props["classes"]) == ["a", "b", "c"] and props["quantization"].startswith("int8 dynamic")


def test_corrupted_images_are_seeded_and_cached(tmp_path, monkeypatch):
    from patchplace.export import robustness
    from patchplace.export.evaluate import corrupted_images

    images = torch.randint(0, 256, (3, 1, 32, 32), dtype=torch.uint8)
    first = corrupted_images(images, "gaussian_noise", 2)
    assert torch.equal(first, corrupted_images(images, "gaussian_noise", 2))  # same images for every model
    assert not torch.equal(first, corrupted_images(images, "gaussian_noise", 4))
    cached = corrupted_images(images, "shot_noise", 1, tmp_path)
    assert len(list(tmp_path.glob("shot_noise-1-3-*.npz"))) == 1
    monkeypatch.setattr(robustness, "corrupt_batch", None)  # a second call reads the cache instead of recomputing
    assert torch.equal(corrupted_images(images, "shot_noise", 1, tmp_path), cached)
    assert not list(tmp_path.glob(".*.tmp"))
