"""The papers' ImageNet recipe knobs of the streaming transform, against timm (the same output for the same seed)
or by their distribution: eval resize + centre crop (``crop_pct``), random erasing modes / counts, RandAugment,
repeated augmentation, and I-JEPA's grayscale / blur / colour distortion ("Self-Supervised Learning from Images with
a Joint-Embedding Predictive Architecture", arXiv 2301.08243)."""

from __future__ import annotations

import io
import math
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter
from timm.data import create_transform
from timm.data.random_erasing import RandomErasing
from torchvision.transforms.functional import to_pil_image

from patchplace.data import Manifest, ShardDataset, SplitWriter, build_transform
from patchplace.data.errors import DataError
from patchplace.data.transforms import GaussianBlur, ImageTransform, ImageTransformConfig

SIZES = [(37, 53), (64, 48), (40, 40), (91, 33), (50, 77), (33, 90)]  # (H, W): portrait, landscape, square


def jpeg(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def smooth_image(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A colourful, smooth RGB image (JPEG keeps it close; a blur visibly changes its noise)."""
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / w, yy * 255 / h, (xx + yy) * 127 / (h + w)], -1)
    return np.clip(base + rng.normal(0, 25, (h, w, 3)), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def jpeg_split(tmp_path_factory) -> tuple[Path, list[bytes]]:
    """RGB JPEG shards of varying sizes (no declared image_size) and their bytes, in key order."""
    out, rng, encoded = tmp_path_factory.mktemp("jpeg"), np.random.default_rng(0), []
    with SplitWriter(out, "val", dataset="toyjpeg", modality="image", classes=["a", "b"], info={"channels": 3},
                     source="test", recipe="test", recipe_version=1, max_count=4) as writer:
        for i, (h, w) in enumerate(SIZES * 2):
            data = jpeg(smooth_image(rng, h, w))
            writer.add_image(f"{i:04d}", i % 2, np.asarray(Image.open(io.BytesIO(data)).convert("RGB")), data)
            encoded.append(data)
    return out / "val", encoded


def stats(m: Manifest) -> dict:
    return dict(mean=tuple(m.normalization["mean"]), std=tuple(m.normalization["std"]))


def seeded(fn, x, seed: int):
    """``fn(x)`` with python's, numpy's and torch's RNGs seeded (as ShardDataset's seeded_transforms does: timm's
    RandAugment draws its ops from numpy)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return fn(x)


def test_eval_crop_pct_is_timms_resize_and_centre_crop_bit_for_bit(jpeg_split):
    split, encoded = jpeg_split
    m = Manifest.load(split)
    ds = ShardDataset(split, transform=build_transform(m, train=False, img_size=32, crop_pct=0.875),
                      return_key=True)
    timm_eval = create_transform(input_size=(3, 32, 32), is_training=False, crop_pct=0.875, interpolation="bicubic",
                                 **stats(m))
    seen = 0
    for x, _, key in ds:
        want = timm_eval(Image.open(io.BytesIO(encoded[int(key)])).convert("RGB"))
        assert x.shape == (3, 32, 32) and torch.equal(x, want), key
        seen += 1
    assert seen == len(encoded)
    # and crop_pct changes the view: 1.0 keeps more of the image
    full = ImageTransform(m, False, ImageTransformConfig(img_size=32))
    x = torch.from_numpy(np.array(Image.open(io.BytesIO(encoded[0])).convert("RGB"))).permute(2, 0, 1)
    assert not torch.equal(full(x.contiguous()), ds.transform(x.contiguous()))


def rgb_manifest(make_toy_split, tmp_path: Path) -> Manifest:
    split, _ = make_toy_split(tmp_path / "rgb", n=4, size=24, channels=3)
    return Manifest.load(split)


@pytest.mark.parametrize("mode,count", [("const", 1), ("rand", 1), ("pixel", 1), ("pixel", 3), ("rand", 2)])
def test_random_erasing_is_timms_for_the_same_seed(make_toy_split, tmp_path, mode, count):
    m = rgb_manifest(make_toy_split, tmp_path)
    image = torch.randint(0, 256, (3, 24, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    ours = ImageTransform(m, True, ImageTransformConfig(re_prob=1.0, re_mode=mode, re_count=count))
    base = create_transform(input_size=(3, 24, 24), is_training=True, scale=(0.35, 1.0), interpolation="bicubic",
                            color_jitter=0.0, **stats(m))
    erase = RandomErasing(1.0, mode=mode, max_count=count, device="cpu")
    for seed in range(6):
        got = seeded(ours, image, seed)
        want = seeded(lambda x: erase(base(to_pil_image(x))), image, seed)
        assert torch.equal(got, want), (mode, count, seed)
        assert not torch.equal(got, seeded(lambda x: base(to_pil_image(x)), image, seed))  # it erased


def test_randaugment_is_timms_create_transform_for_the_same_seed(make_toy_split, tmp_path):
    m = rgb_manifest(make_toy_split, tmp_path)
    policy = "rand-m9-mstd0.5-inc1"
    image = torch.randint(0, 256, (3, 24, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    ours = ImageTransform(m, True, ImageTransformConfig(auto_augment=policy))
    plain = ImageTransform(m, True, ImageTransformConfig())
    timm_aa = create_transform(input_size=(3, 24, 24), is_training=True, scale=(0.35, 1.0), color_jitter=0.0,
                               interpolation="bicubic", auto_augment=policy, **stats(m))
    differs = 0
    for seed in range(8):
        got = seeded(ours, image, seed)
        assert torch.equal(got, seeded(lambda x: timm_aa(to_pil_image(x)), image, seed)), seed
        differs += not torch.equal(got, seeded(plain, image, seed))
    assert differs >= 6  # RandAugment's two ops change the image (rarely both near identity)


def test_randaugment_on_a_seeded_reader_is_the_same_for_any_worker_count(make_toy_split, tmp_path):
    split, _ = make_toy_split(tmp_path / "rgb", n=12, size=16, channels=3, max_count=3)
    m = Manifest.load(split)

    def read(workers: int) -> dict[str, torch.Tensor]:
        ds = ShardDataset(m, transform=build_transform(m, train=True, auto_augment="rand-m9-mstd0.5-inc1"),
                          seeded_transforms=True, return_key=True, num_workers=workers, seed=3)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
        return {k: x for x, _, k in loader}

    one, two = read(0), read(2)
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


def test_recipe_config_is_checked():
    for bad in (dict(re_mode="zeros"), dict(re_count=0), dict(grayscale=1.5), dict(gaussian_blur=-0.1),
                dict(color_distortion=-1.0), dict(color_distortion=0.5, auto_augment="rand-m9")):
        with pytest.raises(DataError):
            ImageTransformConfig(**bad).validate()


# ---------------------------------------------------------------------- I-JEPA / StoP extras
def binomial_ok(k: int, n: int, p: float) -> bool:
    """``k`` successes of ``n`` within 4.5 standard deviations of Binomial(n, p) (a false alarm ~ 1e-5)."""
    return abs(k - n * p) <= 4.5 * math.sqrt(n * p * (1 - p)) + 1


def fixed_view(m: Manifest, **extras) -> ImageTransform:
    """A training transform whose timm part is deterministic (whole-image crop, no flip): only the extras draw."""
    return ImageTransform(m, True, ImageTransformConfig(scale=(1.0, 1.0), ratio=(1.0, 1.0), hflip=0.0, **extras))


def unnormalize(x: torch.Tensor, m: Manifest) -> torch.Tensor:
    mean, std = (torch.tensor(m.normalization[k]).view(-1, 1, 1) for k in ("mean", "std"))
    return x * std + mean


def colour_image() -> torch.Tensor:
    rng = np.random.default_rng(3)
    return torch.from_numpy(smooth_image(rng, 24, 24)).permute(2, 0, 1).contiguous()


def test_grayscale_fraction_is_p_and_keeps_three_channels(make_toy_split, tmp_path):
    m, image, n, p = rgb_manifest(make_toy_split, tmp_path), colour_image(), 600, 0.2
    t = fixed_view(m, grayscale=p)
    torch.manual_seed(0)
    random.seed(0)
    gray = 0
    for _ in range(n):
        x = unnormalize(t(image), m)
        assert x.shape == (3, 24, 24)
        gray += bool(torch.allclose(x[0], x[1], atol=1e-5) and torch.allclose(x[1], x[2], atol=1e-5))
    assert binomial_ok(gray, n, p), gray


def ijepa_blur_reference(img: Image.Image, p: float) -> Image.Image:
    """facebookresearch/ijepa src/transforms.py GaussianBlur.__call__ (radius_min 0.1, radius_max 2.0)."""
    if torch.bernoulli(torch.tensor(p)) == 0:
        return img
    radius = 0.1 + torch.rand(1) * (2.0 - 0.1)
    return img.filter(ImageFilter.GaussianBlur(radius=float(radius)))  # a tensor radius: older PIL only


def test_gaussian_blur_is_ijepas_and_fires_with_probability_p():
    img, n, p = to_pil_image(colour_image()), 400, 0.5
    blur, changed = GaussianBlur(p), 0
    for seed in range(n):
        torch.manual_seed(seed)
        got = blur(img)
        torch.manual_seed(seed)
        assert np.array_equal(np.asarray(got), np.asarray(ijepa_blur_reference(img, p))), seed
        changed += got is not img
    assert binomial_ok(changed, n, p), changed


def test_colour_distortion_fires_with_probability_0_8(make_toy_split, tmp_path):
    m, image, n = rgb_manifest(make_toy_split, tmp_path), colour_image(), 400
    plain, distorted = fixed_view(m)(image), fixed_view(m, color_distortion=1.0)
    torch.manual_seed(0)
    changed = sum(not torch.allclose(distorted(image), plain, atol=1e-6) for _ in range(n))
    assert binomial_ok(changed, n, 0.8), changed


def test_extras_sit_between_timms_colour_stage_and_totensor(make_toy_split, tmp_path):
    m = rgb_manifest(make_toy_split, tmp_path)
    t = ImageTransform(m, True, ImageTransformConfig(grayscale=0.2, gaussian_blur=0.5, color_distortion=0.5))
    names = [type(s).__name__ for s in t.timm.transforms]
    assert names[2:5] == ["RandomApply", "RandomGrayscale", "GaussianBlur"], names
    assert [type(s).__name__ for s in t.timm.transforms[-1].transforms][:2] == ["MaybeToTensor", "Normalize"]


@pytest.mark.parametrize("train", [True, False])
def test_extras_off_leave_timms_transform_unchanged(make_toy_split, tmp_path, train):
    m = rgb_manifest(make_toy_split, tmp_path)
    image = colour_image()
    ours = ImageTransform(m, train, ImageTransformConfig(grayscale=0.0, gaussian_blur=0.0, color_distortion=0.0))
    timm_t = create_transform(input_size=(3, 24, 24), is_training=train, scale=(0.35, 1.0), color_jitter=0.0,
                              interpolation="bicubic", crop_pct=1.0, **stats(m))
    for seed in range(5):
        assert torch.equal(seeded(ours, image, seed), seeded(lambda x: timm_t(to_pil_image(x)), image, seed))


# ---------------------------------------------------------------------- repeated augmentation
def reader(split: Path, repeated: int, **kwargs) -> ShardDataset:
    m = Manifest.load(split)
    return ShardDataset(m, transform=build_transform(m, train=True, scale=(0.2, 1.0), pad_to=None),
                        return_key=True, seeded_transforms=True, seed=5, repeated_aug=repeated, **kwargs)


@pytest.mark.parametrize("workers", [0, 2])
def test_repeated_aug_keeps_the_epoch_length_and_repeats_keys(make_toy_split, tmp_path, workers):
    split, _ = make_toy_split(tmp_path / "toy", n=24, max_count=4, size=16)
    once, thrice = reader(split, 1, num_workers=workers), reader(split, 3, num_workers=workers)
    assert len(once) == len(thrice) == 24
    for epoch in range(2):
        thrice.set_epoch(epoch)
        loader = torch.utils.data.DataLoader(thrice, batch_size=None, num_workers=workers)
        keys = [key for _, _, key in loader]
        assert len(keys) == 24 and set(Counter(keys).values()) == {3} and len(set(keys)) == 8


def test_repeated_aug_copies_share_label_and_key_but_not_augmentation(make_toy_split, tmp_path):
    split, _ = make_toy_split(tmp_path / "toy", n=24, max_count=4, size=16)
    samples = list(reader(split, 3))  # no shuffle buffer: a sample's copies are adjacent
    for i in range(0, 24, 3):
        (x0, y0, k0), (x1, y1, k1), (x2, y2, k2) = samples[i:i + 3]
        assert k0 == k1 == k2 and y0 == y1 == y2
        assert not torch.equal(x0, x1) and not torch.equal(x1, x2) and not torch.equal(x0, x2)
    # copy 0 is the sample as repeated_aug=1 augments it, bit for bit
    plain = {k: x for x, _, k in reader(split, 1)}
    assert all(torch.equal(samples[i][0], plain[samples[i][2]]) for i in range(0, 24, 3))


def test_repeated_aug_with_a_shuffle_buffer_spreads_copies(make_toy_split, tmp_path):
    split, _ = make_toy_split(tmp_path / "toy", n=24, max_count=4, size=16)
    ds = reader(split, 3, shuffle_buffer=12)
    keys = [k for _, _, k in ds]
    assert len(keys) == 24 and max(Counter(keys).values()) <= 3
    assert keys != [k for _, _, k in reader(split, 3)]  # shuffled
    with pytest.raises(DataError, match="repeated_aug"):
        reader(split, 0)
