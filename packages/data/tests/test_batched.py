"""The in-memory path's batched augmentation against the streaming path's per-sample transform: the same
distributions (crop area / aspect / position, flip and erase rates, per-pixel statistics after normalization,
audio shifts and noise), bit-identical evaluation preprocessing, and per-sample randomness keyed by
(seed, epoch, index) — the same sample gets the same augmentation in any batch, rank split or resume point.

Tolerances (measured values here and in the test messages):
- two-sample Kolmogorov-Smirnov statistic below its critical value at alpha = 1e-4 (2.15 * sqrt((n + m) / (n m)):
  0.0215 for the 20,000 + 20,000 crops, ~0.043 for the ~5,000 + 5,000 erased boxes); measured: crops 0.006 (area),
  0.008 (aspect), 0.012 / 0.011 (top / left); erased boxes 0.010 / 0.020 / 0.012; audio shifts 0.009;
- rates (flip, erase, noise) within 0.015 of the configured probability over 20,000 samples (>= 4 binomial sd);
- per-pixel mean / std of 4,000 augmented images: global mean and std within 0.03, per-pixel mean and std maps
  within 0.03 on average and 0.12 at worst (normalized units). Measured: global 0.0004 / 0.005, maps 0.014 / 0.020
  on average and 0.070 / 0.082 at worst — the sampling noise of 4,000 images (a difference of two per-pixel means
  has a standard error of ~0.022 here); a path without the crop misses by more than 0.12 (checked).
All draws are seeded, so the values are the same on every run; the margins cover float differences between CPUs.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data.random_erasing import RandomErasing
from timm.data.transforms import RandomResizedCropAndInterpolation

from patchplace.data import Manifest, build_transform
from patchplace.data.audio import AudioTransform
from patchplace.data.batched import (
    BatchedAudioAugment,
    BatchedImageAugment,
    build_batched_transform,
    crop_boxes,
    erase_boxes,
)
from patchplace.data.keyed_random import keyed_bits, keyed_uniform
from patchplace.data.memory import InMemorySplit, MemoryReader
from patchplace.data.transforms import ImageTransformConfig

N = 20_000
RATE_TOLERANCE = 0.015


def ks_tolerance(n: int, m: int) -> float:
    """The two-sample KS critical value at alpha = 1e-4."""
    return 2.15 * math.sqrt((n + m) / (n * m))


def ks_statistic(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample Kolmogorov-Smirnov statistic (max distance between the empirical CDFs)."""
    a, b = a.double().sort().values, b.double().sort().values
    points = torch.cat([a, b]).unique()
    cdf_a = torch.searchsorted(a, points, right=True) / len(a)
    cdf_b = torch.searchsorted(b, points, right=True) / len(b)
    return float((cdf_a - cdf_b).abs().max())


def fashion_like(n: int, seed: int = 0) -> torch.Tensor:
    """uint8 (n, 1, 28, 28): a bright blob of random size, brightness and place on a dark background, plus noise —
    structure the per-pixel statistics can see moving (a crop or flip of uniform noise would not show)."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = torch.arange(28)[:, None], torch.arange(28)[None, :]
    centre = torch.randint(6, 16, (n, 2), generator=g)  # left-of-centre: flips matter
    radius = torch.randint(3, 9, (n, 2), generator=g)
    inside = (((rows - centre[:, 0, None, None]) / radius[:, 0, None, None]) ** 2
              + ((cols - centre[:, 1, None, None]) / radius[:, 1, None, None]) ** 2) <= 1
    level = torch.randint(120, 256, (n, 1, 1), generator=g)
    noise = torch.randint(0, 30, (n, 28, 28), generator=g)
    return (inside * level + noise).clamp(0, 255).to(torch.uint8)[:, None]


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> Manifest:
    from patchplace.data import SplitWriter

    out = tmp_path_factory.mktemp("fashion_like")
    images = fashion_like(64, seed=1)
    with SplitWriter(out, "train", dataset="fashion_like", modality="image", classes=["a", "b"],
                     info={"image_size": [28, 28], "channels": 1}, source="test", recipe="test",
                     recipe_version=1, max_count=16) as writer:
        for i, image in enumerate(images):
            writer.add_image(f"{i:05d}", i % 2, image[0].numpy())
    return Manifest.load(out / "train")


# ---------------------------------------------------------------------------------------------- keyed randomness
def test_keyed_uniforms_are_uniform_independent_and_keyed():
    u = keyed_uniform(0, 0, torch.arange(N), 5)
    counts = torch.histc(u[:, 0].float(), bins=50, min=0, max=1)
    expected = N / 50
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 100, f"chi-square {chi2:.1f} over 49 degrees of freedom: not uniform"  # p ~ 3e-5
    corr = torch.corrcoef(u[:, :3].T)
    assert corr.fill_diagonal_(0).abs().max() < 0.03, "draws of one sample are correlated"
    neighbours = torch.corrcoef(torch.stack([u[:-1, 0], u[1:, 0]]))[0, 1]
    assert abs(float(neighbours)) < 0.03, "consecutive samples are correlated"
    # keyed: the same key gives the same bits in any batch; any part of the key changes them
    assert torch.equal(keyed_bits(3, 4, torch.tensor([7, 9]), 3)[1], keyed_bits(3, 4, torch.tensor([9]), 3)[0])
    base = keyed_bits(3, 4, torch.arange(100), 3)
    for other in (keyed_bits(4, 4, torch.arange(100), 3), keyed_bits(3, 5, torch.arange(100), 3),
                  keyed_bits(3, 4, torch.arange(100), 3, stream=1), keyed_bits(2**40 + 3, 4, torch.arange(100), 3)):
        assert (other != base).float().mean() > 0.99
    assert int(base.min()) >= 0 and int(base.max()) < 2**32


# ---------------------------------------------------------------------------------------------- image statistics
def test_crop_boxes_follow_timms_random_resized_crop():
    scale, ratio = (0.35, 1.0), (3 / 4, 4 / 3)
    top, left, h, w = crop_boxes(keyed_uniform(0, 0, torch.arange(N), 22, 1), 32, 32, scale, ratio)
    random.seed(0)
    image = Image.new("L", (32, 32))
    ref = torch.tensor([RandomResizedCropAndInterpolation.get_params(image, scale, ratio) for _ in range(N)])
    stats = {"area": ks_statistic(h * w, ref[:, 2] * ref[:, 3]),
             "aspect": ks_statistic((w / h).log(), (ref[:, 3] / ref[:, 2]).log()),
             "top": ks_statistic(top, ref[:, 0]), "left": ks_statistic(left, ref[:, 1])}
    assert max(stats.values()) <= ks_tolerance(N, N), f"KS statistics vs timm: {stats}"
    assert bool(((top >= 0) & (left >= 0) & (top + h <= 32) & (left + w <= 32)).all()), "a box leaves the image"


def test_crop_boxes_fall_back_to_timms_central_crop():
    """No attempt fits (aspect ratios 3-4 on a square image at full area): timm's central crop at ratio 3."""
    random.seed(0)
    expected = RandomResizedCropAndInterpolation.get_params(Image.new("L", (32, 32)), (0.99, 1.0), (3.0, 4.0))
    boxes = crop_boxes(keyed_uniform(0, 0, torch.arange(50), 22, 1), 32, 32, (0.99, 1.0), (3.0, 4.0))
    assert {tuple(int(v[i]) for v in boxes) for i in range(50)} == {expected}


def test_erase_boxes_follow_timms_random_erasing():
    probability = 0.25
    erase, top, left, h, w = erase_boxes(keyed_uniform(0, 0, torch.arange(N), 23, 3), 32, 32, probability)
    random.seed(0)
    timm_erasing = RandomErasing(probability, mode="const", device="cpu")
    boxes = []  # (area, top, left) of timm's erased box; area 0: not erased
    for _ in range(N):
        x = torch.ones(1, 32, 32)
        timm_erasing(x)
        rows, cols = (x[0] == 0).nonzero(as_tuple=True)
        boxes.append((len(rows), int(rows.min()) if len(rows) else -1, int(cols.min()) if len(cols) else -1))
    ref = torch.tensor(boxes)
    erased = ref[:, 0] > 0
    rate, ref_rate = float(erase.float().mean()), float(erased.float().mean())
    assert abs(rate - probability) < RATE_TOLERANCE and abs(ref_rate - probability) < RATE_TOLERANCE, (rate, ref_rate)
    stats = {"area": ks_statistic((h * w)[erase], ref[erased, 0]), "top": ks_statistic(top[erase], ref[erased, 1]),
             "left": ks_statistic(left[erase], ref[erased, 2])}
    assert max(stats.values()) <= ks_tolerance(int(erase.sum()), int(erased.sum())), f"erased boxes vs timm: {stats}"


def test_flip_rate_is_hflip(manifest):
    augment = BatchedImageAugment(manifest, True, ImageTransformConfig(pad_to=32, hflip=0.5))
    rate = float(augment.flips(0, 0, torch.arange(N)).float().mean())
    assert abs(rate - 0.5) < RATE_TOLERANCE, rate
    never = BatchedImageAugment(manifest, True, ImageTransformConfig(pad_to=32, hflip=0.0))
    assert not bool(never.flips(0, 0, torch.arange(N)).any())


def test_augmented_pixels_match_the_streaming_path(manifest):
    """4,000 images through both paths (timm's PIL transform per sample; ours per batch), the same config."""
    images = fashion_like(4000)
    options = dict(pad_to=32, scale=(0.35, 1.0), hflip=0.5, re_prob=0.25)
    ours = BatchedImageAugment(manifest, True, ImageTransformConfig(**options))(images, torch.arange(4000), 0, 0)
    streaming = build_transform(manifest, True, **options)
    random.seed(0)
    torch.manual_seed(0)
    theirs = torch.stack([streaming(image) for image in images])
    assert ours.shape == theirs.shape == (4000, 1, 32, 32) and ours.dtype == theirs.dtype == torch.float32
    gaps = {"mean": abs(float(ours.mean() - theirs.mean())), "std": abs(float(ours.std() - theirs.std())),
            "pixel_mean_avg": float((ours.mean(0) - theirs.mean(0)).abs().mean()),
            "pixel_std_avg": float((ours.std(0) - theirs.std(0)).abs().mean())}
    worst = {"pixel_mean_max": float((ours.mean(0) - theirs.mean(0)).abs().max()),
             "pixel_std_max": float((ours.std(0) - theirs.std(0)).abs().max())}
    assert max(gaps.values()) < 0.03 and max(worst.values()) < 0.12, f"batched vs streaming: {gaps} {worst}"
    # and the statistics can tell: without the crop (scale 1, ratio 1) the mean map moves far beyond tolerance
    still = BatchedImageAugment(manifest, True, ImageTransformConfig(pad_to=32, scale=(1.0, 1.0), ratio=(1.0, 1.0),
                                                                     hflip=0.0))(images, torch.arange(4000), 0, 0)
    assert float((still.mean(0) - theirs.mean(0)).abs().max()) > 0.12


@pytest.mark.parametrize("img_size", [None, 40, 24])
def test_evaluation_preprocessing_matches_the_streaming_path(manifest, img_size):
    images = fashion_like(64)
    ours = BatchedImageAugment(manifest, False, ImageTransformConfig(pad_to=32, img_size=img_size))(
        images, torch.arange(64), 0, 0)
    theirs = torch.stack([build_transform(manifest, False, pad_to=32, img_size=img_size)(x) for x in images])
    assert ours.shape == theirs.shape
    assert torch.equal(ours, theirs)  # pad (+ PIL's resize, bit for bit: batched.pil_resize) + normalize


# ---------------------------------------------------------------------------------------- keyed: batches, ranks, resume
def test_a_sample_is_augmented_the_same_in_any_batch(manifest):
    augment = BatchedImageAugment(manifest, True, ImageTransformConfig(pad_to=32, re_prob=0.5))
    images, index = fashion_like(64), torch.arange(64)
    whole = augment(images, index, seed=3, epoch=2)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    pieces = torch.empty_like(whole)
    for chunk in order.split(7):
        pieces[chunk] = augment(images[chunk], index[chunk], seed=3, epoch=2)
    assert torch.equal(whole, pieces)
    assert not torch.equal(whole, augment(images, index, seed=3, epoch=3)), "a new epoch draws new augmentations"
    assert not torch.equal(whole, augment(images, index, seed=4, epoch=2))


def test_memory_readers_ranks_are_disjoint_cover_the_split_and_resume_exactly(toy_split):
    split_dir, _ = toy_split  # 23 samples
    split = InMemorySplit.load(split_dir)
    m = split.manifest
    transform = build_batched_transform(m, True, re_prob=0.5)
    single = MemoryReader(split, transform, seed=5, return_key=True)
    ranks = [MemoryReader(split, transform, seed=5, rank=r, world_size=2, return_key=True) for r in range(2)]
    for epoch in range(3):
        keys = [[k for _, _, batch_keys in reader.batches(4, epoch) for k in batch_keys] for reader in ranks]
        assert len(keys[0]) == len(keys[1]) == 11 and not set(keys[0]) & set(keys[1])
        assert len(set(keys[0]) | set(keys[1])) == 22, "two ranks cover the split but one (23 = 2 x 11 + 1)"
        # the same sample, augmented on a rank or on one process: bit-identical
        by_key = {k: x for x, _, ks in single.batches(5, epoch) for k, x in zip(ks, x, strict=True)}
        for x, _, ks in ranks[1].batches(3, epoch):
            for k, image in zip(ks, x, strict=True):
                assert torch.equal(image, by_key[k])
    full = list(ranks[0].batches(4, epoch=1))
    resumed = list(ranks[0].batches(4, epoch=1, skip=2))
    assert len(full) == 3 and len(resumed) == 1
    assert torch.equal(resumed[0][0], full[2][0]) and resumed[0][2] == full[2][2]
    assert ranks[0].num_batches(4) == 3 and len(ranks[0]) == 11


# ---------------------------------------------------------------------------------------------- audio
def test_batched_audio_shifts_and_noise_follow_audio_augment():
    n, shift_ms = 1600, 10.0  # 0.1 s clips at 16 kHz, shifts up to 160 samples
    impulse = torch.zeros(N, n)
    impulse[:, n // 2] = 1.0
    shifted = BatchedAudioAugment(True, n, time_shift_ms=shift_ms, noise_prob=0.0)(impulse, torch.arange(N), 0, 0)
    shift = shifted.argmax(dim=1) - n // 2
    assert int(shift.min()) == -160 and int(shift.max()) == 160, "shifts span [-time_shift, +time_shift]"
    uniform = torch.randint(-160, 161, (N,), generator=torch.Generator().manual_seed(0))
    assert ks_statistic(shift, uniform) <= ks_tolerance(N, N)
    # noise only: a window of one noise clip (tiled when shorter), times U(0, volume), with probability 0.8
    g = torch.Generator().manual_seed(0)
    bank = [torch.rand(4000, generator=g) * 2 - 1, torch.rand(700, generator=g) * 2 - 1]  # the second is short
    noisy = BatchedAudioAugment(True, n, noise_bank=bank, time_shift_ms=0.0, noise_prob=0.8, noise_volume=0.1)(
        torch.zeros(2000, n), torch.arange(2000), 0, 0)
    mixed = noisy.abs().amax(dim=1) > 0
    assert abs(float(mixed.float().mean()) - 0.8) < 0.03
    found = {0: 0, 1: 0}
    for row in noisy[mixed][:100]:
        for k, source in enumerate((bank[0], bank[1].repeat(4))):  # the short clip tiled
            windows = source.double().unfold(0, n, 1)  # every window of n samples
            dots = windows @ row.double()
            cos = dots / (windows.norm(dim=1) * row.double().norm())
            best = int(cos.argmax())
            if float(cos[best]) > 1 - 1e-9:
                volume = float(dots[best] / windows[best].norm() ** 2)
                assert 0 < volume <= 0.1, volume
                found[k] += 1
                break
        else:
            raise AssertionError("a mixed clip is not a scaled window of a noise clip")
    assert min(found.values()) > 20, f"both noise clips are drawn: {found}"


def test_batched_audio_evaluation_is_the_streaming_center_fix():
    g = torch.Generator().manual_seed(0)
    for length in (1200, 1600, 2000):  # shorter, equal, longer than the clip
        waves = torch.rand(8, length, generator=g) - 0.5
        ours = BatchedAudioAugment(False, 1600)(waves, torch.arange(8), 0, 0)
        theirs = torch.stack([AudioTransform(train=False, clip_samples=1600)(w) for w in waves])
        assert torch.equal(ours, theirs), length


def test_batched_audio_random_fix_length_places_the_clip_uniformly():
    waves = torch.ones(N, 1000)
    out = BatchedAudioAugment(True, 1600, time_shift_ms=0.0, noise_prob=0.0)(waves, torch.arange(N), 0, 0)
    start = (out > 0).float().argmax(dim=1)  # where the 1000 samples were placed in the 1600 window
    assert bool(((out > 0).sum(dim=1) == 1000).all())
    assert int(start.min()) == 0 and int(start.max()) == 600
    assert math.isclose(float(start.float().mean()), 300, abs_tol=6)
    assert np.isclose(float((out.sum(1) == 1000).float().mean()), 1.0)
