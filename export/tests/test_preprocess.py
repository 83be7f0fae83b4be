"""The recorded preprocessing as data and its numpy reference (timm's eval transform bit for bit, the docs'
ONNX Runtime snippet on a resize-and-crop model), sidecars held to the .onnx file's metadata, the evaluator keeping
what it measured when an optional part cannot run, the fp16 copy and its parity gate, a missing checkpoint."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data import create_transform, resolve_data_config

from patchplace.data import SplitWriter
from patchplace.export import ExportError, export_checkpoint, load_export
from patchplace.export.__main__ import main as export_main
from patchplace.export.evaluate import OnnxModel
from patchplace.export.evaluate import main as evaluate_main
from patchplace.export.exporter import consistency_problem, fp16_of, image_preprocessing
from patchplace.export.preprocess import preprocess
from patchplace.models import create_model, save_pretrained

ROOT = Path(__file__).resolve().parents[2]
SIZES = [(37, 53), (64, 48), (40, 40), (91, 33), (50, 77), (33, 90), (32, 32), (120, 160)]
STATS = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}


def decoded_jpeg(h: int, w: int, channels: int, rng: np.random.Generator) -> Image.Image:
    """A JPEG of a gradient plus noise, decoded (RGB or L)."""
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / w, yy * 255 / h, (xx + yy) * 127 / (h + w)], -1)
    array = np.clip(base + rng.normal(0, 25, (h, w, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="JPEG", quality=90)
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB" if channels == 3 else "L")


def chw(image: Image.Image) -> np.ndarray:
    array = np.asarray(image)
    return (array[None] if array.ndim == 2 else array.transpose(2, 0, 1)).copy()


@pytest.mark.parametrize("channels", [3, 1])
def test_the_numpy_reference_is_timms_eval_transform(channels):
    """preprocess() on the recorded steps against timm.data.create_transform(**resolve_data_config(...)) built
    from the crop_pct alone: 8 JPEG sizes x 4 crop_pct, max abs difference 0."""
    rng, worst = np.random.default_rng(0), 0.0
    norm = {k: v[:channels] for k, v in STATS.items()}
    backbone = create_model("vit_micro", img_size=32, in_chans=channels, num_classes=3)
    for crop_pct in (0.875, 0.9, 0.95, 1.0):
        pre = json.loads(json.dumps(image_preprocessing(backbone, {"normalization": norm, "crop_pct": crop_pct})))
        assert [s["op"] for s in pre["steps"]] == ["resize", "center_crop", "scale", "normalize"]
        config = resolve_data_config({"input_size": (channels, 32, 32), "crop_pct": crop_pct,
                                      "interpolation": "bicubic", "mean": tuple(norm["mean"]),
                                      "std": tuple(norm["std"])})
        timm_eval = create_transform(**config)
        for h, w in SIZES:
            image = decoded_jpeg(h, w, channels, rng)
            ours, want = preprocess([chw(image)], pre)[0], timm_eval(image).numpy()
            assert ours.shape == want.shape == (channels, 32, 32) and ours.dtype == np.float32
            worst = max(worst, float(np.abs(ours - want).max()))
    print(f"numpy reference vs timm eval transform ({channels} channels): max abs diff {worst}")
    assert worst == 0.0


def test_the_reference_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import numpy as np\n"
            "from patchplace.export.preprocess import preprocess\n"
            "pre = {'height': 4, 'width': 4, 'steps': [{'op': 'resize', 'short_side': 4, 'interpolation': "
            "'bicubic'}, {'op': 'center_crop', 'height': 4, 'width': 4}, {'op': 'scale', 'divide_by': 255.0}, "
            "{'op': 'normalize', 'mean': [0.5], 'std': [0.5]}]}\n"
            "x = preprocess([np.zeros((1, 6, 9), np.uint8)], pre)\n"
            "loaded = {m.split('.')[0] for m, module in sys.modules.items() if module}\n"
            "assert x.shape == (1, 1, 4, 4) and 'torch' not in loaded\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A 32 px RGB classifier exported at crop_pct 0.875 (no padding: images of any size), JPEG shards of 8 sizes."""
    root, rng = tmp_path_factory.mktemp("pre"), np.random.default_rng(1)
    images = []
    with SplitWriter(root / "shards", "val", dataset="toyjpeg", modality="image", classes=["a", "b", "c"],
                     info={"channels": 3}, source="t", recipe="t", recipe_version=1) as w:
        for i, (h, wd) in enumerate(SIZES):
            image = chw(decoded_jpeg(h, wd, 3, rng))
            w.add_image(f"{i:04d}", i % 3, image.transpose(1, 2, 0))
            images.append(image)
    torch.manual_seed(0)
    save_pretrained(create_model("vit_micro", img_size=32, in_chans=3, num_classes=3).eval(), root / "ck",
                    metadata={"classes": ["a", "b", "c"], "normalization": STATS, "img_size": 32})
    export_checkpoint(root / "ck", root / "model.onnx", crop_pct=0.875)
    return root, images


def docs_snippet(**names) -> dict:
    """docs/interop.md's ``onnxruntime`` block, run as written."""
    text = (ROOT / "docs" / "interop.md").read_text()
    code = text.split("<!-- snippet: onnxruntime -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    scope = dict(names)
    exec(compile(code, "docs/interop.md snippet onnxruntime", "exec"), scope)
    return scope


def test_the_docs_snippet_runs_a_resize_and_crop_model(exported):
    """Before: NotImplementedError on the resize step (the crop lived in prose). Now the snippet's pixels are the
    evaluator's, bit for bit, on images of 8 sizes, and so are its predictions."""
    root, images = exported
    scope = docs_snippet(MODEL=str(root / "model.onnx"), images=images)
    model = OnnxModel(root / "model.onnx")
    expected = model.normalize(torch.stack([model.resize_crop(torch.from_numpy(i)) for i in images])).numpy()
    assert scope["x"].shape == (len(SIZES), 3, 32, 32) and np.array_equal(scope["x"], expected)
    logits = model.run(torch.from_numpy(expected))[0]
    assert scope["predictions"] == [["a", "b", "c"][i] for i in logits.argmax(1)]


def _edited(root: Path, tmp_path: Path, edit) -> Path:
    """A copy of the exported pair whose sidecar ``edit`` changed."""
    sidecar = json.loads((root / "model.json").read_text())
    edit(sidecar)
    (tmp_path / "m.onnx").write_bytes((root / "model.onnx").read_bytes())
    (tmp_path / "m.json").write_text(json.dumps(sidecar))
    return tmp_path / "m.onnx"


def test_an_edited_sidecar_is_refused_naming_the_field(exported, tmp_path):
    root, _ = exported
    load_export(root / "model.onnx")  # the pair as written loads

    def side(value):
        def edit(sidecar):
            sidecar["preprocessing"]["eval_transform"]["resize_short_side"] = value
        return edit

    with pytest.raises(ExportError, match=r"preprocessing.*resize_short_side is 64 but the .onnx file's metadata "
                                          r"says 36") as info:
        load_export(_edited(root, tmp_path, side(64)))
    assert "\n" not in str(info.value)

    def crop(sidecar):
        sidecar["preprocessing"]["eval_transform"]["crop_pct"] = 0.5

    with pytest.raises(ExportError, match=r"crop_pct is 0.5 but the .onnx file's metadata says 0.875"):
        load_export(_edited(root, tmp_path, crop))

    def norm(sidecar):
        sidecar["normalization"]["mean"] = [0.5, 0.5, 0.5]

    with pytest.raises(ExportError, match=r"normalization.mean is \[0.5, 0.5, 0.5\] but preprocessing.mean"):
        load_export(_edited(root, tmp_path, norm))
    # a sidecar whose crop_pct and resize side disagree with each other
    sidecar = json.loads((root / "model.json").read_text())
    sidecar["preprocessing"]["eval_transform"]["resize_short_side"] = 64
    assert "resize_short_side is 64 but its crop_pct 0.875 at size 32 gives floor(32 / 0.875) = 36" in \
        consistency_problem(sidecar)
    assert consistency_problem(json.loads((root / "model.json").read_text())) == ""


def test_the_evaluator_keeps_what_it_measured_when_robustness_cannot_run(exported, tmp_path, monkeypatch, capsys):
    """A default ./export[cpu] install has no [corruptions] extra: top-1 and consistency are written, robustness
    is said skipped with the pip command, exit 0 — exit 2 only under --require robustness."""
    root, _ = exported
    monkeypatch.setitem(sys.modules, "imagecorruptions", None)  # import imagecorruptions: ImportError
    args = [str(root / "model.onnx"), "--data", str(root / "shards" / "val"), "--robustness-limit", "2",
            "--consistency-limit", "4", "--latency-repeats", "0"]
    assert evaluate_main([*args, "--out", str(tmp_path / "a")]) == 0
    results = json.loads((tmp_path / "a" / "results.json").read_text())
    assert results["accuracy"]["count"] == len(SIZES) and set(results["consistency"]) >= {"0.15"}
    assert "robustness" not in results and "patchplace-export[corruptions]" in results["skipped"]["robustness"]
    err = capsys.readouterr().err
    assert "[ort-eval] robustness skipped:" in err and "error:" not in err
    assert "Skipped: robustness" in (tmp_path / "a" / "results.md").read_text()
    assert evaluate_main([*args, "--out", str(tmp_path / "b"), "--require", "robustness"]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert "robustness required (--require) but skipped" in line
    assert json.loads((tmp_path / "b" / "results.json").read_text())["accuracy"] == results["accuracy"]


def test_the_fp16_copy_passes_its_own_gate_or_is_removed(exported, tmp_path, capsys, monkeypatch):
    root, _ = exported
    out = tmp_path / "model.onnx"
    assert export_main([str(root / "ck"), "--out", str(out), "--crop-pct", "0.875", "--fp16", "--data",
                        str(root / "shards" / "val"), "--samples", "8"]) == 0
    report = json.loads(capsys.readouterr().out)["fp16"]
    with capsys.disabled():
        print(f"fp16: max abs diff {report['max_abs_diff']:.2e} on {report['worst']} "
              f"(scale {report['relative_to']:.3g}),"
              f" top-1 agreement {report['top1_agreement']} on {report['samples']} samples")
    assert report["max_abs_diff"] <= 1e-2 * report["relative_to"] and report["top1_agreement"] == 1.0
    assert report["samples"] == len(SIZES) and fp16_of(out).is_file()
    import onnx

    half = onnx.load(str(fp16_of(out)))
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in half.graph.initializer)
    assert half.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT  # keep_io_types
    assert {p.key for p in half.metadata_props} >= {"preprocessing", "classes", "precision"}
    with pytest.raises(ExportError, match="fp16 copy"):
        load_export(fp16_of(out))
    # a re-export without --fp16 removes the old copy; a copy that misses the gate is removed, the export fails
    assert export_main([str(root / "ck"), "--out", str(out), "--crop-pct", "0.875"]) == 0
    assert not fp16_of(out).exists()
    monkeypatch.setattr("patchplace.export.__main__.half.__defaults__", (0.0, 0.99))
    capsys.readouterr()
    assert export_main([str(root / "ck"), "--out", str(out), "--crop-pct", "0.875", "--fp16"]) == 2
    err = capsys.readouterr().err
    assert "the fp16 model differs from the fp32 one" in err and "was removed" in err and not fp16_of(out).exists()
    assert out.is_file() and load_export(out)


def test_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    """Before: with --data, read_config's ModelError ended in a traceback."""
    for extra in ([], ["--data", str(tmp_path / "nowhere")]):
        assert export_main([str(tmp_path / "nonexistent"), "--out", str(tmp_path / "m.onnx"), *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "no such directory" in err, err
    assert not (tmp_path / "m.onnx").exists()


def test_the_old_resize_step_still_applies():
    """Sidecars written before the crop was its own step: a resize step whose crop is "then" prose."""
    pre = {"height": 4, "width": 4, "steps": [{"op": "resize", "size": 5, "interpolation": "bicubic",
                                               "then": "center crop to 4x4 (crop_pct 0.875)"},
                                              {"op": "scale", "divide_by": 255.0}]}
    image = np.arange(5 * 7, dtype=np.uint8).reshape(1, 5, 7)
    assert np.array_equal(preprocess([image], pre)[0], image[:, 0:4, 2:6].astype(np.float32) / 255)
