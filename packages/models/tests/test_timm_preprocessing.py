"""timm's data pipeline reproduces the training preprocessing. A 1-channel model for 28 px images
zero-padded to 32 px (Fashion-MNIST): ``timm.data.create_transform(**timm.data.resolve_data_config({},
model=model))`` gives exactly patchplace's eval tensor through each route the README documents; the route that
cannot (a file overlay without the checkpoint's ``pretrained_cfg``) and the preprocessing timm cannot express (pad
then resize) are shown to differ and refused by ``timm_data_config``; ``timm_transform`` is exact in every case."""

from __future__ import annotations

import json

import pytest
import timm
import torch
from torchvision.transforms.functional import to_pil_image

from patchplace.models import ModelError, create_model, save_pretrained, timm_data_config, timm_transform

NORMS = {1: {"mean": [0.2860], "std": [0.3530]}, 3: {"mean": [0.49, 0.48, 0.45], "std": [0.25, 0.24, 0.26]}}


def _checkpoint(tmp_path, channels=1, native=(28, 28), pad_to=32, img_size=None, **drop):
    side = img_size or pad_to or max(native)
    model = create_model("vit_micro", img_size=side, patch_size=4, in_chans=channels, num_classes=3).eval()
    metadata = {"classes": list("abc"), "normalization": NORMS[channels], "modality": "image", "pad_to": pad_to,
                "img_size": img_size, "native_size": list(native)}
    for key in drop:
        metadata.pop(key)
    return model, save_pretrained(model, tmp_path / "ckpt", metadata=metadata)


def _images(channels, native, n=6):
    torch.manual_seed(1)
    return [torch.randint(0, 256, (channels, *native), dtype=torch.uint8) for _ in range(n)]


def _patchplace_data_transform(channels, native, pad_to, img_size):
    """The transform the training pipeline evaluates with (patchplace.pipelines: eval_options = pad_to, img_size)."""
    data = pytest.importorskip("patchplace.data")
    from patchplace.data.transforms import ImageTransform, ImageTransformConfig

    manifest = data.Manifest(dataset="toy", split="test", modality="image", classes=list("abc"), num_samples=6,
                             shards=[], fields={"input": "png", "label": "cls"},
                             info={"image_size": list(native), "channels": channels}, source="test", recipe="test",
                             recipe_version=1, normalization=NORMS[channels])
    return ImageTransform(manifest, False, ImageTransformConfig(pad_to=pad_to, img_size=img_size))


def _tuples(data_config):
    return {k: tuple(v) if isinstance(v, list) else v for k, v in data_config.items()}


def _routes(directory):
    """Every route the README documents for a checkpoint directory, as timm models."""
    config = json.loads((directory / "config.json").read_text())
    return {
        "local-dir": timm.create_model(f"local-dir:{directory}", pretrained=True),
        "pretrained_cfg_overlay (with the checkpoint's pretrained_cfg)": timm.create_model(
            config["architecture"], pretrained=True, **config["model_args"],
            pretrained_cfg_overlay={**config["pretrained_cfg"], "file": str(directory / "model.safetensors")}),
        "checkpoint_path + pretrained_cfg": timm.create_model(
            config["architecture"], checkpoint_path=str(directory / "model.safetensors"),
            pretrained_cfg=config["pretrained_cfg"], **config["model_args"]),
    }


@pytest.mark.parametrize(("channels", "native"), [(1, (28, 28)), (3, (29, 29)), (1, (27, 30))],
                         ids=["fmnist-28-to-32", "rgb-odd-padding", "non-square"])
def test_timm_data_config_reproduces_the_zero_padding_exactly(tmp_path, channels, native):
    model, directory = _checkpoint(tmp_path, channels, native)
    images = _images(channels, native)
    ours = _patchplace_data_transform(channels, native, 32, None)
    expected = torch.stack([ours(x) for x in images])
    exact = timm_transform(directory)
    torch.testing.assert_close(torch.stack([exact(to_pil_image(x)) for x in images]), expected, atol=0, rtol=0)
    torch.testing.assert_close(torch.stack([exact(x) for x in images]), expected, atol=0, rtol=0)
    for route, timm_model in _routes(directory).items():
        data_config = timm.data.resolve_data_config({}, model=timm_model)
        assert _tuples(data_config) == timm_data_config(directory), route
        transform = timm.data.create_transform(**data_config)
        got = torch.stack([transform(to_pil_image(x)) for x in images])
        torch.testing.assert_close(got, expected, atol=0, rtol=0, msg=route)
        assert torch.equal(timm_model.eval()(got).argmax(1), model(expected).argmax(1)), route
    # crop_pct 1 in the data config would resize 28 -> 32 instead of padding
    before = timm.data.create_transform(**{**timm_data_config(directory), "crop_pct": 1.0})
    assert not torch.equal(torch.stack([before(to_pil_image(x)) for x in images]), expected)


def test_file_overlay_alone_gets_the_registered_names_data_config(tmp_path):
    """The route the README marks as wrong for preprocessing: the weights load, the data config is vit_base's."""
    _, directory = _checkpoint(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    timm_model = timm.create_model(config["architecture"], pretrained=True, **config["model_args"],
                                   pretrained_cfg_overlay=dict(file=str(directory / "model.safetensors"),
                                                               num_classes=3))
    data_config = timm.data.resolve_data_config({}, model=timm_model)
    assert data_config["input_size"] == (3, 224, 224) and tuple(data_config["mean"]) == (0.5, 0.5, 0.5)
    assert _tuples(data_config) != timm_data_config(directory)


def test_pad_then_resize_is_refused_and_timm_transform_stays_exact(tmp_path):
    _, directory = _checkpoint(tmp_path, img_size=48)  # pad 28 -> 32, then resize to the model's 48
    with pytest.raises(ModelError, match=r"cannot reproduce .* zero-pads to 32x32 and then resizes to 48x48"):
        timm_data_config(directory)
    notes = json.loads((directory / "config.json").read_text())["pretrained_cfg"]["notes"]
    assert "does NOT reproduce it" in notes[0] and "timm_transform" in notes[0]
    card = (directory / "README.md").read_text()
    assert "does **not** reproduce it" in card and "NOT ours here" in card
    images = _images(1, (28, 28))
    expected = torch.stack([_patchplace_data_transform(1, (28, 28), 32, 48)(x) for x in images])
    torch.testing.assert_close(torch.stack([timm_transform(directory)(x) for x in images]), expected, atol=0, rtol=0)
    timm_model = timm.create_model(f"local-dir:{directory}", pretrained=True)
    theirs = timm.data.create_transform(**timm.data.resolve_data_config({}, model=timm_model))
    assert not torch.equal(torch.stack([theirs(to_pil_image(x)) for x in images]), expected)


def test_checkpoints_without_native_size_or_statistics_are_refused(tmp_path):
    _, directory = _checkpoint(tmp_path, native_size=True)  # written before engine.py recorded native_size
    with pytest.raises(ModelError, match="does not record"):
        timm_data_config(directory)
    images = _images(1, (28, 28))
    expected = torch.stack([_patchplace_data_transform(1, (28, 28), 32, None)(x) for x in images])
    torch.testing.assert_close(torch.stack([timm_transform(directory)(x) for x in images]), expected, atol=0, rtol=0)
    _, directory = _checkpoint(tmp_path, normalization=True)
    with pytest.raises(ModelError, match="no normalization statistics"):
        timm_data_config(directory)
    with pytest.raises(ModelError, match="no normalization statistics"):
        timm_transform(directory)


def test_timm_transform_refuses_inputs_the_training_data_never_had(tmp_path):
    _, directory = _checkpoint(tmp_path)
    transform = timm_transform(directory)
    assert "zero-pad 28x28 px images to 32x32" in repr(transform)
    with pytest.raises(ModelError, match="a 30x30 image, but this checkpoint was trained on 28x28"):
        transform(torch.zeros(1, 30, 30, dtype=torch.uint8))
    with pytest.raises(ModelError, match="expected a PIL image or a uint8"):
        transform(torch.zeros(1, 28, 28))
    audio = save_pretrained(create_model("audio_mp3"), tmp_path / "audio")
    with pytest.raises(ModelError, match="MFCC"):
        timm_transform(audio)


def test_unpadded_checkpoints_keep_crop_pct_one(tmp_path):
    _, directory = _checkpoint(tmp_path, native=(32, 32))
    assert timm_data_config(directory)["crop_pct"] == 1.0
    _, directory = _checkpoint(tmp_path, pad_to=None, native=(32, 32))
    raw = json.loads((directory / "config.json").read_text())
    assert raw["pretrained_cfg"]["crop_pct"] == 1.0 and "reproduces it exactly" in raw["pretrained_cfg"]["notes"][0]
