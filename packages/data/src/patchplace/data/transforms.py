"""Per-sample transforms for the reader: timm's image transforms with the dataset's own normalization.

Images arrive as uint8 ``(C, H, W)`` tensors of the manifest's ``image_size`` (any other size is an error, not
cropped to fit: the reader checks each decoded image, the transform again). ``pad_to`` zero-pads them (centered)
first — e.g. Fashion-MNIST 28 -> 32 so patch 4 gives the 8 x 8 grid of the MP3 CIFAR setting — then timm's
``create_transform`` does the crop / flip / (optional RandAugment, random erasing) / normalize with the manifest's
mean and std (``img_size`` / ``crop_pct`` resize and crop as configured, with ``interpolation``). I-JEPA's colour
distortion, grayscale and Gaussian blur (:func:`ijepa_extras`), when asked for, run between timm's colour stage and
ToTensor.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image, ImageFilter
from timm.data import auto_augment, create_transform
from torchvision import transforms
from torchvision.transforms.functional import to_pil_image

from .errors import DataError
from .manifest import Manifest

RE_MODES = ("const", "rand", "pixel")  # timm RandomErasing modes
# timm's (PIL's) interpolations of the crop and the evaluation resize ("random", timm's per-image pick of bilinear
# or bicubic for the training crop, is left out: one interpolation for training, evaluation and the export)
INTERPOLATIONS = ("bicubic", "bilinear", "nearest", "box", "hamming", "lanczos")


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
    re_mode: str = "const"  # timm RandomErasing fill: const (zeros) | rand (per channel) | pixel (per pixel)
    re_count: int = 1  # timm RandomErasing max_count: up to this many boxes per image
    interpolation: str = "bicubic"  # crop and eval resize (timm's default; torchvision's and I-JEPA's: bilinear)
    crop_pct: float = 1.0  # eval: resize to img_size / crop_pct, then center crop
    # I-JEPA's extras after timm's crop / flip / RandAugment, before ToTensor (their order in I-JEPA's make_transforms)
    color_distortion: float = 0.0  # strength s: RandomApply(ColorJitter(.8s, .8s, .8s, .2s), p=0.8) (SimCLR, I-JEPA)
    grayscale: float = 0.0  # torchvision RandomGrayscale probability (the channel count is kept)
    gaussian_blur: float = 0.0  # probability of I-JEPA's PIL GaussianBlur, radius ~ U(0.1, 2.0)

    def validate(self) -> None:
        if self.pad_to is not None and self.pad_to < 1:
            raise DataError(f"pad_to must be positive, got {self.pad_to}")
        if not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise DataError(f"scale must satisfy 0 < min <= max <= 1, got {self.scale}")
        for name in ("hflip", "re_prob", "grayscale", "gaussian_blur"):
            if not 0 <= getattr(self, name) <= 1:
                raise DataError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0 < self.crop_pct <= 1:
            raise DataError(f"crop_pct must be in (0, 1], got {self.crop_pct}")
        if self.interpolation not in INTERPOLATIONS:
            raise DataError(f"interpolation must be one of {', '.join(INTERPOLATIONS)}, got {self.interpolation!r}")
        if self.re_mode not in RE_MODES or self.re_count < 1:
            raise DataError(f"re_mode must be one of {', '.join(RE_MODES)} and re_count >= 1, got {self.re_mode!r} "
                            f"and {self.re_count}")
        if self.color_distortion < 0:
            raise DataError(f"color_distortion must be >= 0, got {self.color_distortion}")
        if self.color_distortion and (self.color_jitter or self.auto_augment):
            raise DataError("color_distortion (I-JEPA's) replaces color_jitter / auto_augment (timm's): set one")

    def ijepa_extras(self) -> bool:
        """Whether any of I-JEPA's extra augmentations is on (off: timm's transform exactly)."""
        return bool(self.color_distortion or self.grayscale or self.gaussian_blur)


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


class GaussianBlur:
    """I-JEPA's blur (``src/transforms.py`` of facebookresearch/ijepa; "Self-Supervised Learning from Images with a
    Joint-Embedding Predictive Architecture", arXiv 2301.08243): with probability ``p`` a PIL ``GaussianBlur`` of
    radius ~ U(0.1, 2.0), both drawn from torch's RNG as there (so a seeded reader repeats them)."""

    def __init__(self, p: float = 0.5, radius_min: float = 0.1, radius_max: float = 2.0) -> None:
        self.p, self.radius_min, self.radius_max = p, radius_min, radius_max

    def __call__(self, img: Image.Image) -> Image.Image:
        if torch.bernoulli(torch.tensor(self.p)) == 0:
            return img
        radius = self.radius_min + float(torch.rand(1)) * (self.radius_max - self.radius_min)
        return img.filter(ImageFilter.GaussianBlur(radius=radius))

    def __repr__(self) -> str:
        return f"GaussianBlur(p={self.p}, radius=({self.radius_min}, {self.radius_max}))"


def ijepa_extras(cfg: ImageTransformConfig) -> list[Callable[[Any], Any]]:
    """I-JEPA's colour distortion, grayscale and blur, in its order (``make_transforms``): PIL -> PIL."""
    extras: list[Callable[[Any], Any]] = []
    if cfg.color_distortion:
        s = cfg.color_distortion
        extras.append(transforms.RandomApply([transforms.ColorJitter(0.8 * s, 0.8 * s, 0.8 * s, 0.2 * s)], p=0.8))
    if cfg.grayscale:
        extras.append(transforms.RandomGrayscale(p=cfg.grayscale))  # keeps the image's channel count
    if cfg.gaussian_blur:
        extras.append(GaussianBlur(p=cfg.gaussian_blur))
    return extras


def timm_transform(cfg: ImageTransformConfig, input_size: tuple[int, int, int], train: bool,
                   normalization: dict[str, Any]) -> Callable[[Any], Any]:
    """timm's ``create_transform`` for ``cfg``; I-JEPA's extras (when on) go between its colour stage and
    ToTensor / Normalize / RandomErasing (timm's ``separate`` stages), else it is timm's transform untouched."""
    options = dict(input_size=input_size, is_training=train, scale=cfg.scale, ratio=cfg.ratio, hflip=cfg.hflip,
                   color_jitter=cfg.color_jitter, auto_augment=cfg.auto_augment, re_prob=cfg.re_prob,
                   re_mode=cfg.re_mode, re_count=cfg.re_count, interpolation=cfg.interpolation,
                   crop_pct=cfg.crop_pct, mean=tuple(normalization["mean"]), std=tuple(normalization["std"]))
    if not (train and cfg.ijepa_extras()):
        return _zero_bit_posterize(create_transform(**options))
    if cfg.color_distortion:
        options["color_jitter"] = None  # I-JEPA's jitter stands in for timm's (validate refuses both)
    primary, secondary, final = create_transform(**options, separate=True)
    return _zero_bit_posterize(transforms.Compose([primary, secondary, *ijepa_extras(cfg), final]))


def _posterize(img: Image.Image, bits_to_keep: int, **kwargs: Any) -> Image.Image:
    """timm's RandAugment posterize, keeping 0 bits as Pillow < 13 did (an all-zero image): ``PosterizeIncreasing``
    (``inc1``) keeps ``4 - int(4 m / 10)`` bits, 0 at magnitude 10, which ``mstd0.5`` draws for ~2% of its
    applications; Pillow 13's ``ImageOps.posterize`` refuses bits < 1 (ValueError in a data worker)."""
    if bits_to_keep < 1:
        return img.point(lambda _: 0)
    return auto_augment.posterize(img, bits_to_keep, **kwargs)


def _zero_bit_posterize(transform: Any) -> Any:
    """``transform`` with every RandAugment posterize op of its (nested) Compose using :func:`_posterize`."""
    for op in getattr(transform, "ops", ()):  # timm RandAugment / AutoAugment: AugmentOp(aug_fn, level_fn)
        if getattr(op, "aug_fn", None) is auto_augment.posterize:
            op.aug_fn = _posterize
    for inner in getattr(transform, "transforms", ()):
        _zero_bit_posterize(inner)
    return transform


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
        self.timm = timm_transform(cfg, (self.channels, self.size, self.size), train, manifest.normalization)

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
