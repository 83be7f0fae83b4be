"""Audio through the shard path: WAV shards -> 16 kHz float clips of fixed length, with noise from a split."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from patchplace.data import DataError, Manifest, ShardDataset, SplitWriter, build_transform

RATE = 16000


def write_audio_split(out, split, clips, classes=("a", "b"), clip_samples=RATE):
    with SplitWriter(out, split, dataset="kws-toy", modality="audio", classes=list(classes),
                     info={"sample_rate": RATE, "clip_samples": clip_samples}, source="test", recipe="toy",
                     recipe_version=1) as writer:
        for i, (wave, label) in enumerate(clips):
            writer.add_audio(f"{i:03d}", label, wave)
    return out / split


@pytest.fixture
def audio_splits(tmp_path):
    t = np.arange(int(1.3 * RATE)) / RATE
    clips = [(0.5 * np.sin(2 * np.pi * 300 * t[: RATE // 2]), 0), (0.5 * np.sin(2 * np.pi * 500 * t), 1)]
    train = write_audio_split(tmp_path, "train", clips)
    rng = np.random.default_rng(0)
    noise = write_audio_split(tmp_path, "background_noise", [(0.5 * rng.standard_normal(3 * RATE).clip(-1, 1), 0)],
                              classes=("_background_noise_",), clip_samples=None)
    return train, noise, clips


def test_eval_clips_are_padded_or_center_cropped_to_one_second(audio_splits):
    train, _, clips = audio_splits
    m = Manifest.load(train)
    assert m.modality == "audio" and m.fields == {"input": "wav", "label": "cls"}
    out = list(ShardDataset(m, transform=build_transform(m, train=False)))
    assert [x.shape for x, _ in out] == [(RATE,), (RATE,)] and [y for _, y in out] == [0, 1]
    short, long_ = out[0][0].numpy(), out[1][0].numpy()
    assert np.abs(short[: RATE // 4 - 1]).max() == 0 and np.abs(short[-RATE // 4 + 1 :]).max() == 0
    start = (len(clips[1][0]) - RATE) // 2
    np.testing.assert_allclose(long_, clips[1][0][start : start + RATE], atol=1 / 16000)  # 16-bit PCM


def test_train_clips_get_background_noise_from_the_noise_split(audio_splits):
    train, noise, _ = audio_splits
    m = Manifest.load(train)
    clean = build_transform(m, train=True, noise_prob=0.0, time_shift_ms=0.0)
    noisy = build_transform(m, train=True, noise_bank=str(noise), noise_prob=1.0, noise_volume=0.5,
                            time_shift_ms=0.0)
    wave = next(iter(ShardDataset(m)))[0]
    torch.manual_seed(0)
    a = clean(wave)
    torch.manual_seed(0)
    b = noisy(wave)
    assert a.shape == b.shape == (RATE,) and b.abs().max() <= 1.0
    assert (b - a).abs().mean() > 1e-3, "noise from the background_noise split must be mixed in"


def test_audio_splits_refuse_non_mono_input(tmp_path):
    with pytest.raises(DataError, match="stored mono"):
        write_audio_split(tmp_path, "train", [(np.zeros((RATE, 2)), 0)])
    assert not (tmp_path / "train").exists()
