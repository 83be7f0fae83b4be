"""``interpolation`` (timm's name of the crop and evaluation-resize kernel) reaches both data paths.

- streaming: timm's transform resamples with it — the training crop is torchvision's ``resized_crop`` of the box
  timm draws, the evaluation transform torchvision's ``Resize`` + ``CenterCrop``, bit for bit, per interpolation;
- in memory: the evaluation resize is PIL's ``Image.resize`` bit for bit (:func:`pil_resize`, every interpolation,
  grayscale and RGB, up and down, both pass orders of the installed Pillow); the training crop (``grid_sample``) is
  within a level of PIL's crop of the same boxes with the same kernel and measurably far from the other kernel's.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data.transforms import RandomResizedCropAndInterpolation
from torchvision import transforms
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

from patchplace.data import DataError, Manifest, build_transform
from patchplace.data.batched import BatchedImageAugment, crop_boxes, pil_resize
from patchplace.data.keyed_random import keyed_uniform
from patchplace.data.transforms import INTERPOLATIONS, ImageTransformConfig

PIL_MODES = {"bicubic": Image.BICUBIC, "bilinear": Image.BILINEAR, "nearest": Image.NEAREST, "box": Image.BOX,
             "hamming": Image.HAMMING, "lanczos": Image.LANCZOS}


def rgb_split(make_toy_split, tmp_path, size: int = 24) -> Manifest:
    split, _ = make_toy_split(tmp_path / "rgb", n=4, size=size, channels=3)
    return Manifest.load(split)


def reference_tensor(pil: Image.Image, m: Manifest) -> torch.Tensor:
    """torchvision's ToTensor + Normalize with the split's statistics."""
    return TF.normalize(TF.to_tensor(pil), m.normalization["mean"], m.normalization["std"])


def smooth_image(channels: int, h: int, w: int, seed: int) -> torch.Tensor:
    """uint8 (C, h, w): gradients plus noise (kernels differ most on edges, least on flat areas)."""
    g = torch.Generator().manual_seed(seed)
    ramp = torch.linspace(0, 200, w)[None, :] + torch.linspace(0, 55, h)[:, None]
    noise = torch.randint(0, 40, (channels, h, w), generator=g)
    return (ramp[None] + noise).clamp(0, 255).to(torch.uint8)


def blobs(n: int) -> torch.Tensor:
    """uint8 (n, 1, 28, 28): a bright ellipse of random size, level and place on a noisy dark background."""
    g = torch.Generator().manual_seed(0)
    rows, cols = torch.arange(28)[:, None], torch.arange(28)[None, :]
    centre, radius = torch.randint(6, 16, (n, 2), generator=g), torch.randint(3, 9, (n, 2), generator=g)
    inside = (((rows - centre[:, 0, None, None]) / radius[:, 0, None, None]) ** 2
              + ((cols - centre[:, 1, None, None]) / radius[:, 1, None, None]) ** 2) <= 1
    level, noise = torch.randint(120, 256, (n, 1, 1), generator=g), torch.randint(0, 30, (n, 28, 28), generator=g)
    return (inside * level + noise).clamp(0, 255).to(torch.uint8)[:, None]


def test_the_interpolation_names_are_timms_and_others_are_refused():
    assert set(INTERPOLATIONS) == set(PIL_MODES)
    with pytest.raises(DataError, match="interpolation must be one of"):
        ImageTransformConfig(interpolation="cubic").validate()
    with pytest.raises(DataError, match="interpolation must be one of"):
        ImageTransformConfig(interpolation="random").validate()  # timm's per-image pick: not one kernel to record


@pytest.mark.parametrize("interpolation", INTERPOLATIONS)
def test_the_streamed_training_crop_is_torchvisions_resized_crop_of_timms_box(make_toy_split, tmp_path,
                                                                            interpolation):
    m = rgb_split(make_toy_split, tmp_path)
    ours = build_transform(m, True, img_size=20, hflip=0.0, interpolation=interpolation)
    image = smooth_image(3, 24, 24, seed=1)
    pil = TF.to_pil_image(image)
    for seed in range(4):
        random.seed(seed)
        top, left, h, w = RandomResizedCropAndInterpolation.get_params(pil, (0.35, 1.0), (3 / 4, 4 / 3))
        want = reference_tensor(TF.resized_crop(pil, top, left, h, w, [20, 20], InterpolationMode(interpolation)), m)
        random.seed(seed)
        assert torch.equal(ours(image), want), (interpolation, seed)
    if interpolation != "bicubic":  # the kernel is used: bicubic gives another crop
        random.seed(0)
        bicubic = build_transform(m, True, img_size=20, hflip=0.0)(image)
        random.seed(0)
        assert not torch.equal(ours(image), bicubic)


@pytest.mark.parametrize("interpolation", INTERPOLATIONS)
def test_the_streamed_evaluation_resize_is_torchvisions(make_toy_split, tmp_path, interpolation):
    m = rgb_split(make_toy_split, tmp_path)
    image = smooth_image(3, 24, 24, seed=2)
    mode = InterpolationMode(interpolation)
    for img_size, crop_pct in ((32, 1.0), (16, 0.875), (20, 0.9)):
        ours = build_transform(m, False, img_size=img_size, crop_pct=crop_pct, interpolation=interpolation)
        reference = transforms.Compose([transforms.Resize(int(img_size / crop_pct), interpolation=mode),
                                        transforms.CenterCrop(img_size)])
        assert torch.equal(ours(image), reference_tensor(reference(TF.to_pil_image(image)), m)), (img_size, crop_pct)


@pytest.mark.parametrize("interpolation", INTERPOLATIONS)
def test_pil_resize_is_pils_image_resize_bit_for_bit(interpolation):
    rng = np.random.default_rng(0)
    sizes = [((28, 28), (32, 32)), ((32, 32), (24, 24)), ((40, 30), (10, 50)), ((7, 61), (33, 5)),
             ((64, 48), (20, 47))] + [(tuple(rng.integers(3, 70, 2)), tuple(rng.integers(2, 90, 2))) for _ in range(20)]
    for k, ((h, w), (oh, ow)) in enumerate(sizes):
        channels = 1 if k % 2 else 3
        image = smooth_image(channels, int(h), int(w), seed=k) if k % 3 else torch.randint(
            0, 256, (channels, int(h), int(w)), dtype=torch.uint8, generator=torch.Generator().manual_seed(k))
        pil = TF.to_pil_image(image).resize((int(ow), int(oh)), PIL_MODES[interpolation])
        want = torch.from_numpy(np.array(pil)).reshape(int(oh), int(ow), channels).permute(2, 0, 1).float()
        got = pil_resize(image[None].float(), (int(oh), int(ow)), interpolation)[0]
        assert torch.equal(got, want), (interpolation, (h, w), (oh, ow), channels)


@pytest.mark.parametrize("interpolation", INTERPOLATIONS)
@pytest.mark.parametrize("img_size,crop_pct", [(40, 1.0), (24, 1.0), (32, 0.875), (28, 0.9)])
def test_batched_evaluation_is_the_streamed_one_bit_for_bit(make_toy_split, tmp_path, interpolation, img_size,
                                                           crop_pct):
    m = rgb_split(make_toy_split, tmp_path, size=32)
    images = torch.stack([smooth_image(3, 32, 32, seed=s) for s in range(6)])
    options = dict(img_size=img_size, crop_pct=crop_pct, interpolation=interpolation)
    ours = BatchedImageAugment(m, False, ImageTransformConfig(**options))(images, torch.arange(6), 0, 0)
    streamed = torch.stack([build_transform(m, False, **options)(x) for x in images])
    assert torch.equal(ours, streamed)


@pytest.mark.parametrize("interpolation,other", [("bilinear", "bicubic"), ("bicubic", "bilinear")])
@pytest.mark.parametrize("size", [32, 24])
def test_batched_training_crops_resample_with_the_interpolation(interpolation, other, size):
    """The batched crop of 500 boxes vs PIL's crop of the same boxes (torchvision ``resized_crop``), in uint8 levels:
    measured 0.28 / 0.93 (bilinear, size 32 / 24) and 0.96 / 1.54 (bicubic: PyTorch's a = -0.75, no antialiasing)
    from the same kernel, 2.2 / 1.9 and 2.6 / 3.2 from the other one."""
    images = torch.nn.functional.pad(blobs(500), (2, 2, 2, 2))
    top, left, h, w = crop_boxes(keyed_uniform(0, 0, torch.arange(500), 22, 1), 32, 32, (0.35, 1.0), (3 / 4, 4 / 3))
    augment = BatchedImageAugment.__new__(BatchedImageAugment)  # the crop alone, on the padded 32 px images
    augment.cfg, augment.size, augment.height, augment.width = ImageTransformConfig(interpolation=interpolation), \
        size, 32, 32
    ours = augment._resized_crop(images.float(), top, left, h, w)

    def pil_crops(kernel: str) -> torch.Tensor:
        return torch.stack([torch.from_numpy(np.array(TF.resized_crop(
            TF.to_pil_image(x), int(t), int(lf), int(hh), int(ww), [size, size], InterpolationMode(kernel)))).float()
            for x, t, lf, hh, ww in zip(images, top, left, h, w, strict=True)])[:, None]

    same, different = (float((ours - pil_crops(k)).abs().mean()) for k in (interpolation, other))
    assert same < 1.7 and same < 0.75 * different, (same, different)


def test_batched_training_refuses_the_kernels_grid_sample_lacks(make_toy_split, tmp_path):
    m = rgb_split(make_toy_split, tmp_path)
    with pytest.raises(DataError, match="stream this split"):
        BatchedImageAugment(m, True, ImageTransformConfig(interpolation="lanczos"))
    BatchedImageAugment(m, False, ImageTransformConfig(interpolation="lanczos"))  # evaluation: PIL's resize
