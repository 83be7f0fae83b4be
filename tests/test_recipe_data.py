"""The papers' data / augmentation recipe fields through the pipelines: validation (one line naming the field), which
path reads a split under them, repeated augmentation's epoch, and Mixup / CutMix in pretraining for the methods
trained with labels (timm Mixup's output for the same seed; a tiny MJP run, "Masked Jigsaw Puzzle: A Versatile
Position Embedding for Vision Transformers", arXiv 2205.12551)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from pipeline_args import TINY, img, method_args, run_log, small_heads
from timm.data import Mixup
from torch import nn

from patchplace.data import ShardDataset
from patchplace.pipelines import engine, finetune, pretrain
from patchplace.pipelines.config import ConfigError
from patchplace.pipelines.engine import inputs
from patchplace.pipelines.sections import DataSection


@pytest.mark.parametrize("override,message", [
    ("data.re_mode=zeros", r"data\.re_mode must be one of const, rand, pixel, got 'zeros'"),
    ("data.re_count=0", r"data\.re_count must be an integer >= 1, got 0"),
    ("data.repeated_aug=0", r"data\.repeated_aug must be an integer >= 1, got 0"),
    ("data.crop_pct=1.2", r"data\.crop_pct must be in \(0, 1\] \(ImageNet: 0\.875\), got 1\.2"),
    ("data.crop_pct=0", r"data\.crop_pct must be in \(0, 1\]"),
    ("data.grayscale=1.5", r"data\.grayscale must be a probability in \[0, 1\], got 1\.5"),
    ("data.gaussian_blur=-0.5", r"data\.gaussian_blur must be a probability"),
    ("data.mixup_prob=2", r"data\.mixup_prob must be a probability"),
    ("data.mixup_switch_prob=-1", r"data\.mixup_switch_prob must be a probability"),
    ("data.color_jitter=-0.4", r"data\.color_jitter must be >= 0 \(0: off\), got -0\.4"),
    ("data.mixup=-1", r"data\.mixup must be >= 0"),
    ("data.cutmix=-1", r"data\.cutmix must be >= 0"),
])
def test_recipe_fields_are_validated_in_one_line(shards, capsys, override, message):
    assert pretrain.main(["method=supervised", *img(shards), override]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and re.search(message, err), err


def test_colour_jitter_and_randaugment_together_are_refused(shards, capsys):
    assert pretrain.main([*img(shards), "data.color_jitter=0.4", "data.auto_augment=rand-m9-mstd0.5-inc1"]) == 2
    assert "data.color_jitter=0.4 (I-JEPA's) and data.auto_augment" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["mp3", "stop", "mae"])
def test_mixup_is_refused_for_methods_trained_without_labels(shards, capsys, method):
    assert pretrain.main([f"method={method}", *img(shards), "data.mixup=0.8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"method={method} trains without them" in err and "mjp, supervised" in err, err


def test_finetune_mixes_with_its_own_fields(shards, capsys):
    assert finetune.main([*img(shards), "data.cutmix=1.0"]) == 2
    assert "fine-tuning mixes with finetune.mixup" in capsys.readouterr().err


def test_defaults_leave_the_transform_options_as_before():
    cfg = DataSection()
    assert inputs.recipe_options(cfg) == {} and inputs.eval_recipe_options(cfg) == {}
    assert inputs.per_sample_recipe(cfg, "data.train", True) is None
    assert inputs.per_sample_recipe(cfg, "data.val", False) is None


def test_per_sample_fields_stream_or_refuse_in_memory():
    small = type("M", (), dict(dataset="x", split="train", info={"image_size": [8, 8], "channels": 1},
                               modality="image", num_samples=10))()
    for field, value in (("grayscale", 0.2), ("gaussian_blur", 0.5), ("color_jitter", 0.4), ("repeated_aug", 3)):
        why = engine.memory_choice(DataSection(**{field: value}), small, 2**30, "data.train", True)
        assert why == f"data.{field}={value} run(s) per sample on the streaming path", why
        assert engine.memory_choice(DataSection(**{field: value}), small, 2**30, "data.val", False) is None
    pixel = DataSection(re_prob=0.25, re_mode="pixel")
    assert "data.re_mode=pixel" in engine.memory_choice(pixel, small, 2**30, "data.train", True)
    assert engine.memory_choice(DataSection(re_mode="pixel"), small, 2**30, "data.train", True) is None  # re_prob 0
    crop = DataSection(crop_pct=0.875)
    assert engine.memory_choice(crop, small, 2**30, "data.val", False) == \
        "data.crop_pct=0.875 run(s) per sample on the streaming path"
    assert engine.memory_choice(crop, small, 2**30, "data.train", True) is None  # training crops ignore crop_pct
    with pytest.raises(ConfigError, match=r"data\.in_memory=true but data\.val .*data\.crop_pct=0\.875"):
        engine.memory_choice(DataSection(crop_pct=0.875, in_memory=True), small, 2**30, "data.val", False)


def test_crop_pct_and_repeated_aug_reach_the_streaming_readers(shards):
    from accelerate import Accelerator

    cfg = DataSection(train=str(shards / "img" / "train"), val=str(shards / "img" / "test"), num_workers=0,
                      crop_pct=0.875, repeated_aug=3, shuffle_buffer=12, batch_size=8)  # 64 images: 8 whole batches
    data = engine.build_data(cfg, Accelerator(cpu=True), seed=0)
    assert data.path == {"train": "streaming", "val": "streaming"}
    assert isinstance(data.val, ShardDataset) and data.val.repeated_aug == 1
    resize = data.val.transform.timm.transforms[0]  # pad_to 32, then timm's eval: 32 / 0.875 -> 36, crop 32
    assert type(resize).__name__ == "Resize" and resize.size == math.floor(32 / 0.875)
    train = data.train
    assert train.repeated_aug == 3 and len(train) == 64
    keys = []
    train.return_key = True
    for _, _, key in train:
        keys.append(key)
    # the quota cuts the 3x stream: about 1/3 distinct (the shuffle buffer reads at most its size ahead)
    assert len(keys) == 64 and len(set(keys)) <= (64 + 12) // 3 + 1
    unaugmented = engine.build_data(cfg, Accelerator(cpu=True), seed=0, augment=False)
    assert unaugmented.train.repeated_aug == 1  # evaluation / probes read each sample once


class _Labelled(nn.Module):
    """Stands in for an objective: only ``training`` is read by the batch transform."""


def test_pretraining_mixup_is_timms_for_the_same_seed():
    cfg = pretrain.PretrainConfig(method="mjp", data=DataSection(mixup=0.8, cutmix=1.0, mixup_prob=0.9,
                                                                 mixup_switch_prob=0.3))
    objective = _Labelled().train()
    ours = pretrain.build_mixup_transform(cfg, 10, "image", objective)
    timm_mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, prob=0.9, switch_prob=0.3, label_smoothing=0.1,
                       num_classes=10)  # MJP's objective.label_smoothing 0.1 (the DeiT recipe)
    x, y = torch.randn(8, 1, 32, 32, generator=torch.Generator().manual_seed(0)), torch.arange(8) % 10
    mixed = 0
    for seed in range(8):
        np.random.seed(seed)
        got_x, got_y = ours(x.clone(), y.clone())
        np.random.seed(seed)
        want_x, want_y = timm_mixup(x.clone(), y.clone())
        assert torch.equal(got_x, want_x) and torch.equal(got_y, want_y), seed
        mixed += not torch.equal(got_x, x)
    assert mixed >= 4 and got_y.shape == (8, 10)
    objective.eval()  # validation batches are never mixed
    assert ours(x, y)[1] is y
    assert pretrain.build_mixup_transform(pretrain.PretrainConfig(method="mjp"), 10, "image", objective) is None
    with pytest.raises(ConfigError, match="mix images only"):
        pretrain.build_mixup_transform(cfg, 10, "audio", objective)


def test_a_tiny_mjp_pretraining_run_with_mixup_and_cutmix(shards, tmp_path):
    out = tmp_path / "mjp"
    assert pretrain.main([*method_args(shards, "mjp"), "optim.max_steps=3", "data.mixup=0.8", "data.cutmix=1.0",
                          f"run.output={out}"]) == 0
    records = run_log(out)
    assert len(records) == 3 and all(math.isfinite(r["loss"]) for r in records)


def test_a_tiny_stop_pretraining_run_with_its_augmentation(shards, tmp_path):
    """StoP's recipe (flip, grayscale 0.2, blur 0.5, crop scale [0.3, 1]) plus repeated augmentation: streamed."""
    out = tmp_path / "stop"
    assert pretrain.main(["method=stop", *img(shards), *TINY, *small_heads("stop"), "optim.max_steps=2",
                          "data.grayscale=0.2", "data.gaussian_blur=0.5", "data.scale=[0.3,1.0]",
                          "data.repeated_aug=2", "data.color_jitter=0.4", f"run.output={out}"]) == 0
    assert run_log(out)[-1]["data"]["train"] == "streaming"
