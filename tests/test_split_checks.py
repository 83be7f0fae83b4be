"""Every split is checked against the model before any step: an RGB model on a grayscale data.val (whose statistics
would broadcast one channel to three, a top-1 with no word) and a grayscale model on an RGB one (a traceback after
training, nothing saved) are each one line naming the split, what it holds, what the model takes and the fix — in
training-time validation (pretrain.py, finetune.py) and in evaluate.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pipeline_args import TINY

from patchplace.data import SplitWriter
from patchplace.pipelines import evaluate, finetune, pretrain


@pytest.fixture(scope="module")
def rgb(tmp_path_factory) -> Path:
    """The test shards' classes and size, in RGB (3 channels)."""
    root = tmp_path_factory.mktemp("rgb")
    rng = np.random.default_rng(1)
    for split, n in (("train", 32), ("test", 16)):
        with SplitWriter(root, split, dataset="toy_rgb", modality="image", classes=["a", "b", "c"],
                         info={"image_size": [28, 28], "channels": 3}, source="test", recipe="test",
                         recipe_version=1, max_count=16) as w:
            for i in range(n):
                w.add_image(f"{i:04d}", i % 3, rng.integers(0, 256, (28, 28, 3), dtype=np.uint8))
    return root


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def nothing_trained(out: Path) -> None:
    written = [p.name for p in out.rglob("*") if p.suffix in (".safetensors", ".jsonl")] if out.exists() else []
    assert not written, f"work was done before the refusal: {written}"


CASES = {  # model's data (train), data.val, what the message says the split holds / the model takes
    "rgb model x gray split": ("rgb", "gray", "grayscale images (1 channel(s))", "RGB ones (in_chans=3)"),
    "gray model x rgb split": ("gray", "rgb", "RGB images (3 channel(s))", "grayscale ones (in_chans=1)"),
}


def split(kind: str, shards: Path, rgb: Path, name: str) -> Path:
    return (rgb if kind == "rgb" else shards / "img") / name


@pytest.mark.parametrize("case", CASES)
def test_training_time_validation_refuses_a_split_of_other_channels_before_any_step(case, shards, rgb, tmp_path,
                                                                                   capsys):
    train, val, holds, takes = CASES[case]
    val_dir = split(val, shards, rgb, "test")
    args = [f"data.train={split(train, shards, rgb, 'train')}", f"data.val={val_dir}", *TINY, "optim.max_steps=2",
            "method=supervised", f"run.output={tmp_path / 'pre'}"]
    assert pretrain.main(args) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"error: data.val={val_dir} (") and holds in err and takes in err, err
    assert "point data.val at a split written with" in err, err
    nothing_trained(tmp_path / "pre")


@pytest.mark.parametrize("case", CASES)
def test_finetuning_refuses_a_validation_split_of_other_channels_before_any_step(case, shards, rgb, tmp_path,
                                                                                capsys):
    train, val, holds, takes = CASES[case]
    val_dir = split(val, shards, rgb, "test")
    assert finetune.main([f"data.train={split(train, shards, rgb, 'train')}", f"data.val={val_dir}", *TINY,
                          "optim.max_steps=2", f"run.output={tmp_path / 'ft'}"]) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"error: data.val={val_dir} (") and holds in err and takes in err, err
    nothing_trained(tmp_path / "ft")


@pytest.fixture(scope="module")
def checkpoints(shards, rgb, tmp_path_factory) -> dict[str, Path]:
    """A one-step supervised checkpoint of each kind (grayscale, RGB)."""
    root, out = tmp_path_factory.mktemp("ckpt"), {}
    for kind in ("gray", "rgb"):
        assert pretrain.main([f"data.train={split(kind, shards, rgb, 'train')}",
                              f"data.val={split(kind, shards, rgb, 'test')}", *TINY, "optim.max_steps=1",
                              "method=supervised", f"run.output={root / kind}"]) == 0
        out[kind] = root / kind / "checkpoint"
    return out


@pytest.mark.parametrize("case", CASES)
def test_evaluate_refuses_a_split_of_other_channels_before_any_measurement(case, shards, rgb, checkpoints, tmp_path,
                                                                          capsys):
    model, val, holds, takes = CASES[case]
    val_dir = split(val, shards, rgb, "test")
    capsys.readouterr()
    assert evaluate.main([f"data.train={split(model, shards, rgb, 'train')}", f"data.val={val_dir}",
                          "data.batch_size=8", "data.num_workers=0", f"run.output={tmp_path / 'ev'}",
                          f"model.checkpoint={checkpoints[model]}"]) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"error: data.val={val_dir} (") and holds in err and takes in err, err
    assert not (tmp_path / "ev" / "results.json").exists() and not list(tmp_path.rglob("results.json"))


@pytest.mark.parametrize("case", CASES)
def test_the_onnx_runtime_evaluator_refuses_a_split_of_other_channels_in_one_line(case, shards, rgb, tmp_path,
                                                                                  capsys):
    pytest.importorskip("onnxruntime")
    import torch

    from patchplace.export import export_checkpoint
    from patchplace.export.evaluate import main as ort_evaluate
    from patchplace.models import create_model, save_pretrained

    model_kind, val, holds, _ = CASES[case]
    channels = 3 if model_kind == "rgb" else 1
    torch.manual_seed(0)
    model = create_model("vit_micro", img_size=28, patch_size=4, in_chans=channels, num_classes=3).eval()
    save_pretrained(model, tmp_path / "model", metadata={
        "classes": ["a", "b", "c"], "normalization": {"mean": [0.5] * channels, "std": [0.25] * channels}})
    export_checkpoint(tmp_path / "model", tmp_path / "model.onnx")
    data = split(val, shards, rgb, "test")
    capsys.readouterr()
    assert ort_evaluate([str(tmp_path / "model.onnx"), "--data", str(data), "--out", str(tmp_path / "out"),
                         "--robustness-limit", "0", "--latency-repeats", "0"]) == 2
    err = one_line_error(capsys)
    takes = f"takes {'RGB' if channels == 3 else 'grayscale'} ones"
    assert err.startswith(f"error: --data {data} (") and holds in err and takes in err, err
    assert f"a split written with {channels} channel(s)" in err, err
    assert not (tmp_path / "out").exists()
