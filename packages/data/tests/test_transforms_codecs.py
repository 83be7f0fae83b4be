"""Image transforms (padding, timm pipeline, manifest normalization) and the codecs' edge cases."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile
import torch

from patchplace.data import DataError, Manifest, build_transform, decode_image_bytes, encode_png, read_wav
from patchplace.data.transforms import PadTo


def test_pad_to_centers_the_image_in_zeros():
    x = torch.full((1, 28, 28), 7, dtype=torch.uint8)
    y = PadTo(32)(x)
    assert y.shape == (1, 32, 32) and y[:, 2:30, 2:30].eq(7).all() and y.sum() == 7 * 28 * 28
    with pytest.raises(DataError, match="cannot pad a 28x28 image to 16"):
        PadTo(16)(x)


def test_eval_transform_normalizes_with_the_manifest_statistics(toy_split):
    split_dir, images = toy_split
    m = Manifest.load(split_dir)
    transform = build_transform(m, train=False, pad_to=12)
    x = torch.from_numpy(images[0]).unsqueeze(0)
    y = transform(x)
    mean, std = m.normalization["mean"][0], m.normalization["std"][0]
    assert y.shape == (1, 12, 12) and y.dtype == torch.float32
    expected = (images[0].astype(np.float32) / 255 - mean) / std
    torch.testing.assert_close(y[0, 2:10, 2:10], torch.from_numpy(expected), atol=1e-5, rtol=0)
    torch.testing.assert_close(y[0, 0], torch.full((12,), -mean / std), atol=1e-5, rtol=0)


def test_train_transform_augments_but_keeps_shape(toy_split):
    split_dir, images = toy_split
    transform = build_transform(Manifest.load(split_dir), train=True, pad_to=12, scale=(0.2, 0.5))
    x = torch.from_numpy(images[0]).unsqueeze(0)
    torch.manual_seed(0)
    outs = [transform(x) for _ in range(4)]
    assert all(o.shape == (1, 12, 12) for o in outs)
    assert not torch.equal(outs[0], outs[1]), "random crops of a random image should differ"


def test_transform_config_and_input_errors(toy_split):
    m = Manifest.load(toy_split[0])
    with pytest.raises(DataError, match="scale must satisfy"):
        build_transform(m, train=True, scale=(0.5, 2.0))
    with pytest.raises(DataError, match="hflip must be in"):
        build_transform(m, train=True, hflip=1.5)
    with pytest.raises(DataError, match=r"expected a uint8 \(1, H, W\) image tensor"):
        build_transform(m, train=False)(torch.zeros(3, 8, 8, dtype=torch.uint8))
    with pytest.raises(TypeError):
        build_transform(m, train=False, colour="red")


@pytest.mark.parametrize("channels", [1, 3])
def test_png_round_trip_and_channel_conversion(channels):
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)
    if channels == 1:
        image = image[:, :, 0]
    x = decode_image_bytes(encode_png(image), channels)
    assert x.dtype == torch.uint8 and x.shape == (channels, 5, 7)
    assert np.array_equal(x.numpy().transpose(1, 2, 0).squeeze(), image)
    rgb = decode_image_bytes(encode_png(image), 3)  # gray files are expanded, RGB files are kept
    assert rgb.shape == (3, 5, 7)
    with pytest.raises(DataError, match="cannot decode image"):
        decode_image_bytes(b"not an image", channels, key="k1")


def test_read_wav_downmixes_and_resamples_to_16k():
    t = np.arange(44100) / 44100
    tone = 0.5 * np.sin(2 * np.pi * 440 * t)
    buf = io.BytesIO()
    soundfile.write(buf, np.stack([tone, tone], axis=1), 44100, format="WAV", subtype="FLOAT")
    wave = read_wav(buf.getvalue())
    assert wave.dtype == np.float32 and wave.shape == (16000,)
    spectrum = np.abs(np.fft.rfft(wave))
    assert abs(np.argmax(spectrum) * 16000 / len(wave) - 440) <= 1.0  # the tone survives resampling
    assert abs(np.abs(wave[1000:-1000]).max() - 0.5) < 0.01
    with pytest.raises(DataError, match="sample-7: cannot read as WAV"):
        read_wav(b"RIFF0000WAVEjunk", key="sample-7")
