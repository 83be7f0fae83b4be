"""Findings of a fault probe that need a run to show: what a run records and warns about when its config asks for
something other than the data can give. (The refusals of the config alone: tests/test_config_refusals.py; the
converter's: tests/test_convert_faults.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pipeline_args import img, method_args

from patchplace.pipelines import pretrain

ROOT = Path(__file__).resolve().parents[1]


def test_a_recipes_crop_far_above_the_datas_image_size_is_warned_about_once(shards, tmp_path, capsys):
    """ImageNet MAE's shipped config (224 px crop) on 28 px gray shards trained a 1-channel 224 px model, upsampling
    8x, without a word. (The model shrunk to a test's size; the crop and the data are the finding's.)"""
    config = ROOT / "pipelines" / "configs" / "imagenet_mae_vitb16_pretrain.yaml"
    shrink = [*img(shards), "data.batch_size=4", "data.num_workers=0", "optim.max_steps=1", "run.mixed_precision=no",
              "run.tensorboard=false", "objective.decoder_dim=16", "objective.decoder_depth=1",
              "objective.decoder_heads=2"]

    def upsampling_warnings(side: int, patch: int, *extra: str) -> list[str]:
        model = f"model.overrides={{depth: 1, embed_dim: 32, num_heads: 2, patch_size: {patch}, img_size: {side}}}"
        assert pretrain.main(["--config", str(config), *shrink, model, *extra,
                              f"run.output={tmp_path / str(len(list(tmp_path.iterdir())))}"]) == 0
        return [line for line in capsys.readouterr().err.splitlines() if "upsamples" in line]

    assert upsampling_warnings(224, 32) == [
        "warning: data.train (toy/train) holds 28x28 grayscale images and data.img_size=224 upsamples them 8x: a "
        "model for 224 px inputs of 1 channel(s) trains on 28 px of content; set data.img_size near 28 (or "
        "data.img_size=null and data.pad_to) for these images, or point data.train at images of the recipe's size"]
    # a crop near the images' size (the fashion-mnist recipes' padding, or a 3x crop) is not warned about
    assert upsampling_warnings(32, 16, "data.pad_to=32", "data.img_size=null") == []
    assert upsampling_warnings(96, 16, "data.img_size=96") == []


@pytest.mark.parametrize(("scaling", "recorded"), [("none", None), ("linear", 8), ("sqrt", 256)])
def test_optimizer_json_records_the_base_batch_only_where_the_lr_was_scaled_from_it(shards, tmp_path, scaling,
                                                                                     recorded):
    """I-JEPA's optimizer.json said ``"lr_base_batch": 8`` under optim.lr_scaling=none: no batch was scaled from."""
    base = ["optim.lr_base_batch=256"] if scaling == "sqrt" else []
    out = tmp_path / scaling
    assert pretrain.main([*method_args(shards, "ijepa"), "optim.max_steps=1", f"optim.lr_scaling={scaling}", *base,
                          f"run.output={out}"]) == 0
    written = json.loads((out / "optimizer.json").read_text())
    assert written["lr_scaling"] == scaling and written["lr_base_batch"] == recorded, written
    assert written["global_batch"] == 8
