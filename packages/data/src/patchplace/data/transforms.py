"""Per-sample transforms for the reader: timm's image transforms with the dataset's own normalization.

Images arrive as uint8 ``(C, H, W)`` tensors of the manifest's ``image_size`` (any other size is an error, not
cropped to fit: the reader checks each decoded image, the transform again). ``pad_to`` zero-pads them (centered)
first — e.g. Fashion-MNIST 28 -> 32 so patch 4 gives the 8 x 8 grid of the MP3 CIFAR setting — then timm's
``create_transform`` does the crop / flip / (optional RandAugment, random erasing) / normalize with the manifest's
mean and std (``img_size`` / ``crop_pct`` resize and crop as configured).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from timm.data import create_transform
from torchvision.transforms.functional import to_pil_image

from .errors import DataError
from .manifest import Manifest


@dataclass
class ImageTransformConfig:
    """Image augmentation knobs (timm names). Defaults suit small images (no color jitter, mild crops)."""

    img_size: int | None = None  # output side; default: the (padded) image side from the manifest
    pad_to: int | None = None  # zero-pad to this side before anything else
    scale: tuple[float, float] = (0.35, 1.0)  # RandomResizedCrop area range
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = 0.5
    color_jitter: float = 0.0
    auto_augment: str | None = None  # e.g. "rand-m9-mstd0.5-inc1" (RGB data)
    re_prob: float = 0.0  # random erasing probability
    interpolation: str = "bicubic"
    crop_pct: float = 1.0  # eval: resize to img_size / crop_pct, then center crop

    def validate(self) -> None:
        if self.pad_to is not None and self.pad_to < 1:
            raise DataError(f"pad_to must be positive, got {self.pad_to}")
        if not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise DataError(f"scale must satisfy 0 < min <= max <= 1, got {self.scale}")
        for name in ("hflip", "re_prob"):
            if not 0 <= getattr(self, name) <= 1:
                raise DataError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0 < self.crop_pct <= 1:
            raise DataError(f"crop_pct must be in (0, 1], got {self.crop_pct}")


class PadTo:
    """Zero-pad a ``(C, H, W)`` tensor, centered, to ``size x size`` (no-op when already that big)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        if h > self.size or w > self.size:
            raise DataError(f"cannot pad a {h}x{w} image to {self.size}: it is larger; use img_size to resize")
        top, left = (self.size - h) // 2, (self.size - w) // 2
        return F.pad(x, (left, self.size - w - left, top, self.size - h - top))


def check_native_size(images: torch.Tensor, native: tuple[int, int] | None, where: str) -> None:
    """Images of a size other than their manifest's ``image_size`` (``native``; None: sizes vary) are an error: the
    transform would crop or stretch them to fit without a word."""
    if native is not None and tuple(images.shape[-2:]) != native:
        h, w = images.shape[-2:]
        raise DataError(f"a {h}x{w} image, but the manifest of {where} declares image_size {native[0]}x{native[1]}: "
                        "the shards do not match their manifest; rebuild the split with its data/ recipe")


def image_transform_config(manifest: Manifest, config: ImageTransformConfig | None) -> ImageTransformConfig:
    """The validated config of an image transform (streaming or batched), after checking that ``manifest`` holds
    images with the normalization statistics the transform needs."""
    cfg = config or ImageTransformConfig()
    cfg.validate()
    if manifest.modality != "image":
        raise DataError(f"{manifest.dataset} is {manifest.modality} data, not images")
    if not manifest.normalization:
        raise DataError(f"manifest of {manifest.dataset}/{manifest.split} has no normalization statistics; "
                        "rebuild it with its data/ recipe")
    return cfg


class ImageTransform:
    """uint8 ``(C, H, W)`` tensor -> normalized float tensor, via optional padding and timm's transform."""

    def __init__(self, manifest: Manifest, train: bool, config: ImageTransformConfig | None = None) -> None:
        cfg = image_transform_config(manifest, config)
        native = manifest.info.get("image_size")
        self.size = cfg.img_size or cfg.pad_to or (max(native) if native else None)
        if self.size is None:
            raise DataError(f"{manifest.dataset} images vary in size: set img_size for the transform")
        self.channels = int(manifest.info.get("channels", 3))
        self.native = tuple(native) if native else None
        self.where = f"{manifest.dataset}/{manifest.split}"
        self.pad = PadTo(cfg.pad_to) if cfg.pad_to else None
        self.timm = create_transform(
            input_size=(self.channels, self.size, self.size), is_training=train, scale=cfg.scale,
            ratio=cfg.ratio, hflip=cfg.hflip, color_jitter=cfg.color_jitter, auto_augment=cfg.auto_augment,
            re_prob=cfg.re_prob, interpolation=cfg.interpolation, crop_pct=cfg.crop_pct,
            mean=tuple(manifest.normalization["mean"]), std=tuple(manifest.normalization["std"]),
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.uint8 or x.ndim != 3 or x.shape[0] != self.channels:
            raise DataError(f"expected a uint8 ({self.channels}, H, W) image tensor, got {x.dtype} "
                            f"{tuple(x.shape)}")
        check_native_size(x, self.native, self.where)
        if self.pad is not None:
            x = self.pad(x)
        return self.timm(to_pil_image(x))


def build_transform(manifest: Manifest, train: bool, **options: Any) -> Callable[[Any], Any]:
    """The reader transform for a split: images -> :class:`ImageTransform`; audio -> fixed-length clips
    (random crop + time shift + background noise when training; see :mod:`patchplace.data.audio`).

    Audio options are :class:`~patchplace.data.audio.AudioAugment`'s; ``noise_bank`` may be a list of clips or the
    path of a ``background_noise`` split."""
    if manifest.modality == "image":
        return ImageTransform(manifest, train, ImageTransformConfig(**options))
    from .audio import AudioAugment, AudioTransform, load_noise_bank

    noise = options.pop("noise_bank", None)
    if isinstance(noise, (str, os.PathLike)):  # a background_noise split directory
        noise = load_noise_bank(noise)
    clip = int(manifest.info.get("clip_samples") or manifest.info["sample_rate"])
    augment = AudioAugment(noise_bank=noise or [], **options) if train else None
    return AudioTransform(train=train, clip_samples=clip, augment=augment)
