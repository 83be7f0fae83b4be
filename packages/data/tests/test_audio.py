"""Clip-level audio transforms: fix_length, AudioAugment (shift, noise, clamp), AudioTransform."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from patchplace.data.audio import AudioAugment, AudioTransform, fix_length
from patchplace.data.errors import DataError

SR = 16000


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- fix_length -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["center", "random", "start"])
@pytest.mark.parametrize("n", [1, 9000, 15999, 16000, 16001, 40000])
def test_fix_length_gives_exact_length_and_keeps_content(mode, n):
    wave = torch.arange(1, n + 1, dtype=torch.float32)  # distinct, non-zero samples
    out = fix_length(wave, 16000, mode, generator=_gen(0))
    assert out.shape == (16000,) and out.dtype == torch.float32
    kept = out[out != 0]
    if n <= 16000:
        # Padding: the whole clip, contiguous and in order; everything else zero.
        assert torch.equal(kept, wave)
    else:
        # Cropping: one contiguous window of the clip.
        assert torch.equal(out, torch.arange(out[0], out[0] + 16000, dtype=torch.float32))


def test_fix_length_placement_per_mode():
    short = torch.ones(100)
    assert torch.nonzero(fix_length(short, 1000, "start")).flatten().tolist() == list(range(100))
    assert torch.nonzero(fix_length(short, 1000, "center")).flatten().tolist() == list(range(450, 550))
    long = torch.arange(1000, dtype=torch.float32)
    assert fix_length(long, 100, "start")[0] == 0
    assert fix_length(long, 100, "center")[0] == 450
    # Random: offsets vary over calls and stay in range, and the same generator seed repeats them.
    starts = {int(fix_length(long, 100, "random", generator=_gen(s))[0]) for s in range(20)}
    assert len(starts) > 5 and all(0 <= s <= 900 for s in starts)
    assert torch.equal(fix_length(long, 100, "random", generator=_gen(3)),
                       fix_length(long, 100, "random", generator=_gen(3)))


def test_fix_length_accepts_numpy_and_never_aliases_input():
    wave = np.linspace(-1, 1, 16000, dtype=np.float64)
    out = fix_length(wave, 16000)
    assert out.dtype == torch.float32 and torch.allclose(out, torch.from_numpy(wave).float())
    src = torch.zeros(16000)
    fix_length(src, 16000).add_(1.0)
    assert src.abs().sum() == 0


def test_fix_length_rejects_bad_input():
    with pytest.raises(DataError, match="mode"):
        fix_length(torch.zeros(10), 16000, "end")
    with pytest.raises(DataError, match="length"):
        fix_length(torch.zeros(10), 0)
    with pytest.raises(DataError, match="1-D"):
        fix_length(torch.zeros(2, 10), 16000)
    with pytest.raises(DataError, match="PCM"):
        fix_length(np.zeros(10, dtype=np.int16), 16000)


# ---- AudioAugment -----------------------------------------------------------------------------------------------


def test_time_shift_moves_an_impulse_within_the_window_and_zero_fills():
    augment = AudioAugment(time_shift_ms=100.0, noise_prob=0.0)
    max_shift = 1600  # 100 ms at 16 kHz
    wave = torch.zeros(SR)
    wave[8000] = 1.0
    positions = []
    for seed in range(200):
        out = augment(wave, generator=_gen(seed))
        (where,) = torch.nonzero(out, as_tuple=True)
        assert where.numel() == 1 and out[where] == 1.0, "exactly the impulse, everything else zero"
        positions.append(int(where) - 8000)
    assert min(positions) >= -max_shift and max(positions) <= max_shift
    # Both directions are used and the spread covers most of the window (200 draws of U[-1600, 1600]).
    assert min(positions) < -1000 and max(positions) > 1000


def test_time_shift_is_not_circular():
    # An impulse at the very end shifted right must drop out, not wrap to the start.
    augment = AudioAugment(time_shift_ms=100.0, noise_prob=0.0)
    wave = torch.zeros(SR)
    wave[-1] = 0.5
    outs = [augment(wave, generator=_gen(seed)) for seed in range(50)]
    assert any(out.abs().sum() == 0 for out in outs)
    assert all(out[:1600].abs().sum() == 0 for out in outs), "content wrapped around to the start"


def test_noise_is_mixed_with_prob_one_and_never_with_prob_zero():
    rng = np.random.default_rng(0)
    bank = [rng.uniform(-1, 1, 3 * SR).astype(np.float32), rng.uniform(-1, 1, 2 * SR).astype(np.float32)]
    wave = torch.zeros(SR)
    never = AudioAugment(bank, time_shift_ms=0.0, noise_prob=0.0)
    always = AudioAugment(bank, time_shift_ms=0.0, noise_prob=1.0, noise_volume=0.1)
    for seed in range(20):
        assert torch.equal(never(wave, generator=_gen(seed)), wave)
        noisy = always(wave, generator=_gen(seed))
        assert noisy.abs().max() > 0, "noise_prob=1 must add noise"
        assert noisy.abs().max() <= 0.1 + 1e-7, "volume ~ U(0, noise_volume) on noise in [-1, 1]"


def test_noise_is_a_contiguous_segment_of_a_bank_clip():
    # ramp[k] = (k + 1) / 5 SR, so volume * ramp[o : o + SR] has constant steps volume / 5 SR and out[0] / step
    # recovers o + 1: a contiguous, in-range stretch of the noise clip.
    ramp = np.arange(1, 5 * SR + 1, dtype=np.float64) / (5 * SR)
    augment = AudioAugment([ramp], time_shift_ms=0.0, noise_prob=1.0, noise_volume=1.0)
    offsets = set()
    for seed in range(5):
        out = augment(torch.zeros(SR), generator=_gen(seed)).numpy().astype(np.float64)
        steps = np.diff(out)
        np.testing.assert_allclose(steps, steps.mean(), rtol=5e-2)
        offset = round(out[0] / steps.mean()) - 1
        assert 0 <= offset <= 4 * SR
        offsets.add(offset)
    assert len(offsets) > 1, "random offsets into the noise clip"


def test_short_noise_clips_are_tiled():
    tone = np.sin(2 * np.pi * np.arange(400) / 400).astype(np.float32)  # 25 ms, one period
    augment = AudioAugment([tone], time_shift_ms=0.0, noise_prob=1.0, noise_volume=1.0)
    out = augment(torch.zeros(SR), generator=_gen(0))
    assert out.shape == (SR,)
    # Periodic with the clip's period all the way through: tiled, not zero-padded.
    torch.testing.assert_close(out[400:], out[:-400])
    assert out[-400:].abs().max() > 0


def test_same_seed_same_output_and_different_seed_differs():
    rng = np.random.default_rng(1)
    bank = [rng.uniform(-1, 1, 2 * SR).astype(np.float32)]
    wave = torch.from_numpy(rng.uniform(-0.5, 0.5, SR).astype(np.float32))
    # Seed in the constructor: two objects built alike give the same stream.
    a, b = AudioAugment(bank, seed=7), AudioAugment(bank, seed=7)
    assert all(torch.equal(a(wave), b(wave)) for _ in range(5))
    # A generator passed to the call wins over the constructor's seed.
    c = AudioAugment(bank, seed=123)
    assert torch.equal(a(wave, generator=_gen(5)), c(wave, generator=_gen(5)))
    assert not torch.equal(a(wave, generator=_gen(5)), a(wave, generator=_gen(6)))


def test_output_is_clamped_to_unit_range():
    loud = np.full(SR, 0.99, dtype=np.float32)
    augment = AudioAugment([np.ones(SR, dtype=np.float32)], time_shift_ms=50.0, noise_prob=1.0, noise_volume=1.0)
    wave = torch.from_numpy(np.random.default_rng(2).choice([-0.99, 0.99], SR).astype(np.float32))
    for seed in range(10):
        out = augment(wave, generator=_gen(seed))
        assert out.abs().max() <= 1.0
    out = augment(torch.from_numpy(loud), generator=_gen(0))
    assert out.max() == 1.0, "0.99 + positive noise must saturate at 1"


def test_empty_bank_only_shifts():
    augment = AudioAugment([], noise_prob=1.0)
    wave = torch.zeros(SR)
    wave[8000] = 0.25
    out = augment(wave, generator=_gen(0))
    assert torch.count_nonzero(out) == 1 and out.sum() == 0.25


@pytest.mark.parametrize("kwargs", [
    dict(noise_prob=1.5),
    dict(noise_prob=-0.1),
    dict(noise_prob=float("nan")),
    dict(noise_volume=-0.1),
    dict(time_shift_ms=-1.0),
    dict(sample_rate=0),
    dict(noise_bank=[np.zeros(0, dtype=np.float32)]),
    dict(noise_bank=[np.zeros((2, 100), dtype=np.float32)]),
    dict(noise_bank=np.zeros(100, dtype=np.float32)),
    dict(seed=1.5),
])
def test_augment_rejects_bad_args(kwargs):
    with pytest.raises(DataError, match="AudioAugment"):
        AudioAugment(**kwargs)


# ---- AudioTransform ---------------------------------------------------------------------------------------------


def test_eval_transform_is_deterministic_center_fix():
    transform = AudioTransform(train=False, clip_samples=SR, augment=AudioAugment(noise_prob=1.0))
    wave = np.random.default_rng(3).uniform(-1, 1, 20000).astype(np.float32)
    out = transform(wave)
    assert out.shape == (SR,) and out.dtype == torch.float32
    assert torch.equal(out, torch.from_numpy(wave[2000:18000])), "eval ignores augment and crops the center"
    assert torch.equal(transform(wave), out)


def test_train_transform_crops_randomly_and_augments():
    rng = np.random.default_rng(4)
    bank = [rng.uniform(-1, 1, 2 * SR).astype(np.float32)]
    wave = rng.uniform(-0.5, 0.5, 24000).astype(np.float32)
    plain = AudioTransform(train=True, clip_samples=SR, augment=None)
    outs = [plain(wave, generator=_gen(s)) for s in range(10)]
    assert all(o.shape == (SR,) for o in outs)
    assert len({float(o[0]) for o in outs}) > 1, "random crop offsets"
    augmented = AudioTransform(train=True, clip_samples=SR, augment=AudioAugment(bank, noise_prob=1.0))
    out = augmented(wave, generator=_gen(0))
    assert out.shape == (SR,) and out.abs().max() <= 1.0
    assert not torch.equal(out, plain(wave, generator=_gen(0))), "augment must change the train clip"
    assert torch.equal(out, augmented(wave, generator=_gen(0))), "same generator, same output"
    seeded = [AudioTransform(train=True, augment=AudioAugment(bank, seed=1), seed=2) for _ in range(2)]
    assert torch.equal(seeded[0](wave), seeded[1](wave))


def test_transform_rejects_bad_args():
    with pytest.raises(DataError, match="train"):
        AudioTransform(train="yes")
    with pytest.raises(DataError, match="clip_samples"):
        AudioTransform(train=True, clip_samples=-1)
    with pytest.raises(DataError, match="augment"):
        AudioTransform(train=True, augment=0.5)


def test_non_finite_samples_are_refused_naming_the_clip(tmp_path):
    """A float WAV with NaN samples is refused, naming the clip and the first bad index (never written, e.g. as a
    full-scale click)."""
    import numpy as np
    import pytest

    from patchplace.data import DataError, SplitWriter

    wave = np.zeros(16000, np.float32)
    wave[123] = np.nan
    message = r"kws/train sample k7: audio has 1 non-finite sample\(s\) \(NaN / inf\), the first at index 123"
    writer = SplitWriter(tmp_path, "train", dataset="kws", modality="audio", classes=["a"],
                         info={"sample_rate": 16000, "clip_samples": 16000}, source="t", recipe="t", recipe_version=1)
    with pytest.raises(DataError, match=message), writer:
        writer.add_audio("k7", 0, wave)
    assert not (tmp_path / "train").exists(), "nothing half-written is left"
