"""data.interpolation through the pipelines: both transforms of a run resample with it (null: bicubic), the kernels
the batched crop lacks stream data.train, a checkpoint records a non-default one, and evaluate.py (a run that does
not train) resizes with the recorded one unless data.interpolation names another."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from patchplace.data import Manifest
from patchplace.models import create_model, save_pretrained
from patchplace.pipelines import engine
from patchplace.pipelines.config import ConfigError
from patchplace.pipelines.engine import inputs
from patchplace.pipelines.sections import DataSection

IMAGES = SimpleNamespace(dataset="x", split="train", info={"image_size": [8, 8], "channels": 1}, modality="image",
                         num_samples=10)


def options_of(cfg: DataSection, checkpoint: str | None = None, augment: bool = True) -> tuple[dict, dict]:
    return inputs.transform_options(cfg, IMAGES, inputs.interpolation_in_force(cfg, checkpoint, augment))


def test_the_interpolation_reaches_both_transforms_and_bicubic_passes_nothing():
    train, val = options_of(DataSection(interpolation="bilinear"))
    assert train["interpolation"] == val["interpolation"] == "bilinear"
    for cfg in (DataSection(), DataSection(interpolation="bicubic")):  # as before the field: nothing passed
        train, val = options_of(cfg)
        assert "interpolation" not in train and "interpolation" not in val


def test_kernels_the_batched_crop_lacks_stream_the_training_split_only():
    lanczos = DataSection(interpolation="lanczos")
    assert engine.memory_choice(lanczos, IMAGES, 2**30, "data.train", True) == \
        "data.interpolation=lanczos run(s) per sample on the streaming path"
    assert engine.memory_choice(lanczos, IMAGES, 2**30, "data.val", False) is None  # PIL's resize, batched
    assert engine.memory_choice(DataSection(interpolation="bilinear"), IMAGES, 2**30, "data.train", True) is None
    with pytest.raises(ConfigError, match=r"data\.in_memory=true but data\.train .*data\.interpolation=lanczos"):
        engine.memory_choice(DataSection(interpolation="lanczos", in_memory=True), IMAGES, 2**30, "data.train", True)


def test_evaluation_resizes_with_the_recorded_interpolation(tmp_path):
    model = create_model("vit_micro", img_size=32, in_chans=1, num_classes=3)
    recorded = str(save_pretrained(model, tmp_path / "bilinear", metadata={"interpolation": "bilinear"}))
    older = str(save_pretrained(model, tmp_path / "older", metadata={}))
    assert options_of(DataSection(), recorded, augment=False)[1]["interpolation"] == "bilinear"
    assert options_of(DataSection(), recorded, augment=False)[0]["interpolation"] == "bilinear"  # data.train too
    assert options_of(DataSection(interpolation="lanczos"), recorded, augment=False)[1]["interpolation"] == "lanczos"
    assert "interpolation" not in options_of(DataSection(), older, augment=False)[1]  # none recorded: bicubic
    assert "interpolation" not in options_of(DataSection(), recorded, augment=True)[0]  # training: the config's


def test_the_checkpoint_records_a_non_default_interpolation(shards):
    data = SimpleNamespace(manifest=Manifest.load(shards / "img" / "train"), normalization=None)
    assert inputs.data_metadata(data, DataSection(interpolation="bilinear"))["interpolation"] == "bilinear"
    assert "interpolation" not in inputs.data_metadata(data, DataSection())
    assert "interpolation" not in inputs.data_metadata(data, DataSection(interpolation="bicubic"))
