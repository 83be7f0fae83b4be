"""Batched augmentation on the training device: the in-memory path's counterparts of :class:`ImageTransform` (timm's
per-sample PIL transform) and :class:`AudioAugment`, one vectorized op per step for the whole batch.

Every random number is keyed by (seed, epoch, sample index, draw) (:mod:`patchplace.data.keyed_random`), so a sample
is augmented the same whatever batch, rank or resume point it comes in, and bit-identically across runs.

Images (``BatchedImageAugment``), in timm's order (``create_transform(is_training=True)``):

1. zero-pad to ``pad_to`` (as :class:`PadTo`);
2. random resized crop with per-sample boxes drawn exactly as timm's ``RandomResizedCropAndInterpolation.get_params``
   (10 attempts of area ~ U(scale) and log-aspect ~ U(log ratio), the first that fits; else the central fallback),
   resampled by PyTorch's batched ``affine_grid`` + ``grid_sample`` (bicubic by default) and rounded to uint8
   levels as PIL's resize does;
3. horizontal flip with probability ``hflip``;
4. ``/255``, normalize with the manifest's mean / std;
5. random erasing (timm ``RandomErasing``, ``const`` mode, one box: 10 attempts of area ~ U(0.02, 1/3),
   log-aspect ~ U(log 0.3, log 1/0.3)), with probability ``re_prob``.

Why ``grid_sample`` (``python pipelines/benchmark.py --suite data``; this 2-core CPU, batch 128, 32 px, 2 threads):
at the same bilinear interpolation PyTorch's batched sampler does 198k images/s, kornia's ``crop_and_resize`` 121k
(it builds a homography per sample, then calls the same ``grid_sample``), torchvision's ``roi_align`` 37k
(bilinear only) and a loop of torchvision v2 ``resized_crop`` calls 35k; ``grid_sample`` also does bicubic (timm's
default here; 79k images/s), needs no new dependency and runs the same code on CUDA. All of them are far above
what training consumes (~250-450 samples/s for the study ViT); timm's per-sample PIL transform does ~8k.

Differences of the training crop from the PIL path, none of which moves the statistics tested in
``tests/test_batched.py``: PyTorch's bicubic kernel is a = -0.75 (PIL's a = -0.5) and neither of its kernels widens
when a crop shrinks (PIL's antialiases); samples near a crop's edge read the image's real neighbours (PIL crops
first, then clamps to the crop's edge). Its interpolations are grid_sample's (``bicubic``, ``bilinear``,
``nearest``; PIL's ``box`` / ``hamming`` / ``lanczos`` crops stream). The evaluation resize is PIL's bit for bit
(:func:`pil_resize`: Pillow's fixed-point coefficients, two passes rounded to uint8 as ``libImaging/Resample.c``),
for every interpolation timm names. RandAugment / color jitter run on PIL images only: configs that ask for them
stream (``data.in_memory=auto``) or fail (``data.in_memory=true``).

Audio (``BatchedAudioAugment``): fix to the clip length (random offset when training, centered for evaluation),
zero-filled time shift, background-noise mixing and clamp, exactly :class:`AudioAugment`'s recipe; MFCC follows
on the same device (the pipelines' frontend).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence

import numpy as np
import PIL
import torch
import torch.nn.functional as F

from .audio import _as_wave
from .errors import DataError
from .keyed_random import keyed_uniform
from .manifest import Manifest
from .transforms import ImageTransformConfig, check_native_size, image_transform_config

# keyed_random streams: one per kind of draw, so adding draws to one never changes another
CROP_STREAM, FLIP_STREAM, ERASE_STREAM, CLIP_STREAM, SHIFT_STREAM, NOISE_STREAM = range(1, 7)
ATTEMPTS = 10  # timm's RandomResizedCrop / RandomErasing tries per sample
ERASE_AREA, ERASE_ASPECT = (0.02, 1 / 3), 0.3  # timm RandomErasing defaults (create_transform passes none)
CROP_INTERPOLATIONS = ("bicubic", "bilinear", "nearest")  # grid_sample's modes: the training crop's


def _randint(u: torch.Tensor, low: torch.Tensor | int, high: torch.Tensor | int) -> torch.Tensor:
    """Uniform integers in [low, high] (both inclusive, as ``random.randint``) from uniforms ``u`` in [0, 1)."""
    return (low + torch.floor(u * (high - low + 1))).to(torch.int64)


def crop_boxes(u: torch.Tensor, height: int, width: int, scale: tuple[float, float],
               ratio: tuple[float, float]) -> tuple[torch.Tensor, ...]:
    """timm's ``RandomResizedCropAndInterpolation.get_params`` for a batch: ``u`` (B, 22) uniforms ->
    (top, left, crop height, crop width), int64 (B,) each."""
    area = height * width
    target_area = area * (scale[0] + (scale[1] - scale[0]) * u[:, :ATTEMPTS])
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(log_lo + (log_hi - log_lo) * u[:, ATTEMPTS:2 * ATTEMPTS])
    w = torch.round(torch.sqrt(target_area * aspect))  # round half to even, as Python's round()
    h = torch.round(torch.sqrt(target_area / aspect))
    fits = (w <= width) & (h <= height)
    first = fits.to(torch.int8).argmax(dim=1, keepdim=True)  # the first attempt that fits
    w, h = w.gather(1, first)[:, 0].to(torch.int64), h.gather(1, first)[:, 0].to(torch.int64)
    top = _randint(u[:, 2 * ATTEMPTS], 0, height - h)
    left = _randint(u[:, 2 * ATTEMPTS + 1], 0, width - w)
    # no attempt fits: timm's central crop at the nearest allowed aspect ratio
    in_ratio = width / height
    if in_ratio < min(ratio):
        fw, fh = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        fw, fh = round(height * max(ratio)), height
    else:
        fw, fh = width, height
    none = ~fits.any(dim=1)
    h, w = torch.where(none, fh, h), torch.where(none, fw, w)
    top, left = torch.where(none, (height - fh) // 2, top), torch.where(none, (width - fw) // 2, left)
    return top, left, h, w


def erase_boxes(u: torch.Tensor, height: int, width: int, probability: float) -> tuple[torch.Tensor, ...]:
    """timm ``RandomErasing`` (one box) for a batch: ``u`` (B, 23) uniforms -> (erase?, top, left, height, width)."""
    area = height * width
    target_area = area * (ERASE_AREA[0] + (ERASE_AREA[1] - ERASE_AREA[0]) * u[:, 1:1 + ATTEMPTS])
    log_lo, log_hi = math.log(ERASE_ASPECT), math.log(1 / ERASE_ASPECT)
    aspect = torch.exp(log_lo + (log_hi - log_lo) * u[:, 1 + ATTEMPTS:1 + 2 * ATTEMPTS])
    h = torch.round(torch.sqrt(target_area * aspect))  # timm: h from area * aspect, w from area / aspect
    w = torch.round(torch.sqrt(target_area / aspect))
    fits = (w < width) & (h < height)
    first = fits.to(torch.int8).argmax(dim=1, keepdim=True)
    h, w = h.gather(1, first)[:, 0].to(torch.int64), w.gather(1, first)[:, 0].to(torch.int64)
    top = _randint(u[:, 1 + 2 * ATTEMPTS], 0, height - h)
    left = _randint(u[:, 2 + 2 * ATTEMPTS], 0, width - w)
    erase = (u[:, 0] < probability) & fits.any(dim=1)
    return erase, top, left, h, w


def _box_mask(top: torch.Tensor, left: torch.Tensor, h: torch.Tensor, w: torch.Tensor, height: int,
              width: int) -> torch.Tensor:
    """(B, 1, height, width) bool: inside each sample's box."""
    rows = torch.arange(height, device=top.device)[None, :]
    cols = torch.arange(width, device=top.device)[None, :]
    inside_rows = (rows >= top[:, None]) & (rows < (top + h)[:, None])
    inside_cols = (cols >= left[:, None]) & (cols < (left + w)[:, None])
    return (inside_rows[:, :, None] & inside_cols[:, None, :])[:, None]


# ---------------------------------------------------------------------------------------------- PIL's resize, exactly
PRECISION_BITS = 32 - 8 - 2  # Pillow's fixed-point coefficients for 8-bit images (libImaging/Resample.c)
HAMMING_A, HAMMING_B = (float(np.float32(v)) for v in (0.54, 0.46))  # Pillow's constants are C floats (0.54f)
# Pillow >= 13 resamples vertically first when the height shrinks by more than twice the width's loss
# (ImagingResampleInner's horizontal_first); before, always horizontally first. The two orders round differently.
PIL_VERTICAL_FIRST = int(PIL.__version__.split(".")[0]) >= 13


def _box(x: float) -> float:
    return 1.0 if -0.5 < x <= 0.5 else 0.0


def _triangle(x: float) -> float:
    x = -x if x < 0.0 else x
    return 1.0 - x if x < 1.0 else 0.0


def _hamming(x: float) -> float:
    x = -x if x < 0.0 else x
    if x == 0.0:
        return 1.0
    if x >= 1.0:
        return 0.0
    x = x * math.pi
    return math.sin(x) / x * (HAMMING_A + HAMMING_B * math.cos(x))


def _cubic(x: float, a: float = -0.5) -> float:
    x = -x if x < 0.0 else x
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    if x < 2.0:
        return (((x - 5) * x + 8) * x - 4) * a
    return 0.0


def _sinc(x: float) -> float:
    if x == 0.0:
        return 1.0
    x = x * math.pi
    return math.sin(x) / x


def _lanczos(x: float) -> float:
    return _sinc(x) * _sinc(x / 3) if -3.0 <= x < 3.0 else 0.0


# Pillow's resampling filters and their supports (Resample.c: BOX, BILINEAR, HAMMING, BICUBIC a = -0.5, LANCZOS 3)
PIL_FILTERS = {"box": (_box, 0.5), "bilinear": (_triangle, 1.0), "hamming": (_hamming, 1.0), "bicubic": (_cubic, 2.0),
               "lanczos": (_lanczos, 3.0)}
PIL_INTERPOLATIONS = (*PIL_FILTERS, "nearest")


@functools.lru_cache(maxsize=64)
def pil_resize_matrix(in_size: int, out_size: int, interpolation: str, device: str = "cpu") -> torch.Tensor:
    """(out_size, in_size) float64 coefficients of one axis of PIL's ``Image.resize`` with a filter: Pillow's
    ``precompute_coeffs`` (window, normalization) and ``normalize_coeffs_8bpc`` (rounded to ``PRECISION_BITS``),
    integers, computed in Python's doubles in Pillow's order so that they are Pillow's."""
    kernel, support = PIL_FILTERS[interpolation]
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support, inverse = support * filterscale, 1.0 / filterscale
    weights = torch.zeros(out_size, in_size, dtype=torch.float64)
    for x in range(out_size):
        center = (x + 0.5) * scale
        low, high = max(int(center - support + 0.5), 0), min(int(center + support + 0.5), in_size)
        k = [kernel((i - center + 0.5) * inverse) for i in range(low, high)]
        total = 0.0
        for w in k:  # summed in order, as Pillow
            total += w
        for i, w in zip(range(low, high), k, strict=True):
            w = w / total if total != 0.0 else w
            weights[x, i] = int(-0.5 + w * (1 << PRECISION_BITS)) if w < 0 else int(0.5 + w * (1 << PRECISION_BITS))
    return weights.to(device)


@functools.lru_cache(maxsize=64)
def pil_nearest_index(in_size: int, out_size: int, device: str = "cpu") -> torch.Tensor:
    """(out_size,) int64 source pixels of PIL's ``Image.resize(NEAREST)`` along one axis: Pillow's scaling transform
    (``ImagingScaleAffine``) accumulates the centre ``(x + 0.5) * scale`` step by step and truncates it."""
    scale, index = in_size / out_size, []
    position = 0.0 + scale * 0.5
    for _ in range(out_size):
        index.append(int(position))
        position += scale
    return torch.tensor(index, dtype=torch.int64, device=device)


def _pil_pass(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One pass of PIL's resampling over the last axis of uint8-valued float64 ``x``: the sums of integers are exact
    in float64 (below 2**53), then Pillow's rounding (``+ 2**21``, shift right, clip to uint8)."""
    out = x @ weights.T
    return torch.floor((out + (1 << (PRECISION_BITS - 1))) / (1 << PRECISION_BITS)).clamp_(0, 255)


def pil_resize(x: torch.Tensor, size: tuple[int, int], interpolation: str) -> torch.Tensor:
    """uint8-valued ``(..., H, W)`` images -> ``(..., h, w)`` float32, bit for bit PIL's ``Image.resize((w, h),
    interpolation)`` of each (the resize of torchvision's ``Resize`` on a PIL image, timm's eval transform) with
    the installed Pillow: for a filter, Pillow's two fixed-point passes in its order, each rounded to uint8 and
    skipped when that side does not change; ``nearest``, Pillow's source pixels."""
    if interpolation not in PIL_INTERPOLATIONS:
        raise DataError(f"interpolation must be one of {', '.join(PIL_INTERPOLATIONS)}, got {interpolation!r}")
    (height, width), device = x.shape[-2:], str(x.device)
    if interpolation == "nearest":
        x = x.index_select(-1, pil_nearest_index(width, size[1], device)) if width != size[1] else x
        return (x.index_select(-2, pil_nearest_index(height, size[0], device)) if height != size[0] else x).float()
    y = x.to(torch.float64)
    vertical_first = PIL_VERTICAL_FIRST and height - size[0] > 0 and height - size[0] > 2 * (width - size[1])
    for axis in ((-2, -1) if vertical_first else (-1, -2)):
        before, after = (height, size[0]) if axis == -2 else (width, size[1])
        if before != after:
            y = _pil_pass(y.transpose(axis, -1), pil_resize_matrix(before, after, interpolation, device))
            y = y.transpose(axis, -1)
    return y.to(torch.float32)


class BatchedImageAugment:
    """uint8 ``(B, C, H, W)`` images on any device -> normalized float32 ``(B, C, size, size)``; the batched
    counterpart of :class:`~patchplace.data.transforms.ImageTransform` with the same config and sizes."""

    def __init__(self, manifest: Manifest, train: bool, config: ImageTransformConfig | None = None) -> None:
        cfg = image_transform_config(manifest, config)
        if train and (cfg.auto_augment or cfg.color_jitter):
            raise DataError("auto_augment / color_jitter run on PIL images, one at a time: stream this split "
                            "(data.in_memory=false) or drop them")
        if train and (cfg.ijepa_extras() or (cfg.re_prob and (cfg.re_mode, cfg.re_count) != ("const", 1))):
            raise DataError("color_distortion / grayscale / gaussian_blur and random erasing other than one const box "
                            "run per sample (timm, I-JEPA): stream this split (data.in_memory=false) or drop them")
        if train and cfg.interpolation not in CROP_INTERPOLATIONS:
            raise DataError(f"the batched crop resamples by grid_sample ({', '.join(CROP_INTERPOLATIONS)}), not "
                            f"{cfg.interpolation!r}: stream this split (data.in_memory=false)")
        native = manifest.info.get("image_size")
        if not native:
            raise DataError(f"{manifest.dataset} images vary in size: they cannot be batched in memory")
        self.cfg, self.train = cfg, train
        self.size = cfg.img_size or cfg.pad_to or max(native)
        self.channels = int(manifest.info.get("channels", 3))
        height, width = native
        self.native, self.where = (int(height), int(width)), f"{manifest.dataset}/{manifest.split}"
        if cfg.pad_to and (height > cfg.pad_to or width > cfg.pad_to):
            raise DataError(f"cannot pad a {height}x{width} image to {cfg.pad_to}: it is larger; use img_size to "
                            "resize")
        self.height, self.width = (cfg.pad_to, cfg.pad_to) if cfg.pad_to else (height, width)
        norm = manifest.normalization
        self.mean = torch.tensor(norm["mean"], dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(norm["std"], dtype=torch.float32).view(1, -1, 1, 1)

    def to(self, device: torch.device | str) -> BatchedImageAugment:
        """Keep the normalization constants on ``device`` (where the batches are)."""
        self.mean, self.std = self.mean.to(device), self.std.to(device)
        return self

    def __repr__(self) -> str:
        c = self.cfg
        return (f"BatchedImageAugment(train={self.train}, size={self.size}, pad_to={c.pad_to}, scale={c.scale}, "
                f"ratio={c.ratio}, hflip={c.hflip}, re_prob={c.re_prob}, interpolation={c.interpolation!r})")

    # ------------------------------------------------------------------ parameters (exposed for the tests)
    def crops(self, seed: int, epoch: int, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        u = keyed_uniform(seed, epoch, index, 2 * ATTEMPTS + 2, CROP_STREAM)
        return crop_boxes(u, self.height, self.width, self.cfg.scale, self.cfg.ratio)

    def flips(self, seed: int, epoch: int, index: torch.Tensor) -> torch.Tensor:
        return keyed_uniform(seed, epoch, index, 1, FLIP_STREAM)[:, 0] < self.cfg.hflip

    def erasures(self, seed: int, epoch: int, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        u = keyed_uniform(seed, epoch, index, 2 * ATTEMPTS + 3, ERASE_STREAM)
        return erase_boxes(u, self.size, self.size, self.cfg.re_prob)

    # ------------------------------------------------------------------ the transform
    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        if (h, w) == (self.height, self.width):
            return x
        top, left = (self.height - h) // 2, (self.width - w) // 2
        return F.pad(x, (left, self.width - w - left, top, self.height - h - top))

    def _resized_crop(self, x: torch.Tensor, top, left, h, w) -> torch.Tensor:
        """Each sample's box resampled to size x size: an affine map of the output grid onto the box (the same
        sample positions as resizing the cropped image, align_corners=False)."""
        b, size = x.shape[0], self.size
        theta = torch.zeros(b, 2, 3, dtype=torch.float32, device=x.device)
        theta[:, 0, 0] = w / self.width
        theta[:, 0, 2] = (2 * left + w) / self.width - 1
        theta[:, 1, 1] = h / self.height
        theta[:, 1, 2] = (2 * top + h) / self.height - 1
        grid = F.affine_grid(theta, [b, x.shape[1], size, size], align_corners=False)
        out = F.grid_sample(x, grid, mode=self.cfg.interpolation, padding_mode="border", align_corners=False)
        return out.round_().clamp_(0, 255)  # PIL resizes uint8 images to uint8

    def _resize(self, x: torch.Tensor) -> torch.Tensor:
        """timm's eval transform: shorter side to size / crop_pct (PIL's resize, bit for bit), then the central
        size x size crop."""
        scale_size = math.floor(self.size / self.cfg.crop_pct)
        h, w = x.shape[-2:]
        if (h, w) != (self.size, self.size) or scale_size != self.size:
            short, long = (h, w) if h <= w else (w, h)
            new_long = int(scale_size * long / short)
            new = (scale_size, new_long) if h <= w else (new_long, scale_size)
            if new != (h, w):
                x = pil_resize(x, new, self.cfg.interpolation)
            top, left = round((new[0] - self.size) / 2), round((new[1] - self.size) / 2)
            x = x[..., top:top + self.size, left:left + self.size]
        return x

    def __call__(self, images: torch.Tensor, index: torch.Tensor, seed: int, epoch: int) -> torch.Tensor:
        """Augment ``images`` (uint8, on the device to run on); ``index``: each sample's index in the split."""
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != self.channels:
            raise DataError(f"expected a uint8 (B, {self.channels}, H, W) batch, got {images.dtype} "
                            f"{tuple(images.shape)}")
        check_native_size(images, self.native, self.where)
        index = index.to(images.device)
        x = self._pad(images.to(torch.float32))
        if self.train:
            x = self._resized_crop(x, *self.crops(seed, epoch, index))
            x = torch.where(self.flips(seed, epoch, index)[:, None, None, None], x.flip(-1), x)
        else:
            x = self._resize(x)
        x = (x / 255.0 - self.mean.to(x.device)) / self.std.to(x.device)  # no-ops after .to(device)
        if self.train and self.cfg.re_prob > 0:
            erase, top, left, h, w = self.erasures(seed, epoch, index)
            mask = _box_mask(top, left, h, w, self.size, self.size) & erase[:, None, None, None]
            x = x.masked_fill(mask, 0.0)
        return x


class BatchedAudioAugment:
    """float32 ``(B, T)`` waveforms on any device -> ``(B, clip_samples)``: :class:`AudioTransform` for a batch.

    Training: a random ``clip_samples`` window / placement (``fix_length(mode="random")``), a zero-filled time shift
    in [-time_shift, +time_shift] samples, background noise (a random clip of ``noise_bank`` from a random offset,
    tiled when shorter, times U(0, noise_volume)) with probability ``noise_prob``, clamp to [-1, 1]
    (:class:`AudioAugment`, TensorFlow speech_commands / TC-ResNet). Evaluation: centered ``fix_length`` only."""

    def __init__(self, train: bool, clip_samples: int = 16000, noise_bank: Sequence[np.ndarray | torch.Tensor] = (),
                 time_shift_ms: float = 100.0, noise_prob: float = 0.8, noise_volume: float = 0.1,
                 sample_rate: int = 16000) -> None:
        from .audio import AudioAugment

        check = AudioAugment(noise_bank, time_shift_ms, noise_prob, noise_volume, sample_rate)  # validates
        self.train, self.clip_samples = train, int(clip_samples)
        self.time_shift, self.noise_prob, self.noise_volume = check.time_shift, check.noise_prob, check.noise_volume
        clips = [_as_wave(c, "noise_bank clip") for c in noise_bank]
        self.noise_lengths = torch.tensor([len(c) for c in clips], dtype=torch.int64)
        self.noise = torch.zeros(len(clips), max((len(c) for c in clips), default=1))
        for k, clip in enumerate(clips):
            self.noise[k, :len(clip)] = clip
        self.size = None  # (images only)

    def to(self, device: torch.device | str) -> BatchedAudioAugment:
        """Keep the noise bank on ``device`` (where the batches are)."""
        self.noise, self.noise_lengths = self.noise.to(device), self.noise_lengths.to(device)
        return self

    def __repr__(self) -> str:
        return (f"BatchedAudioAugment(train={self.train}, clip_samples={self.clip_samples}, "
                f"time_shift={self.time_shift}, noise_prob={self.noise_prob}, noise_volume={self.noise_volume}, "
                f"noise_clips={len(self.noise_lengths)})")

    def __call__(self, waves: torch.Tensor, index: torch.Tensor, seed: int, epoch: int) -> torch.Tensor:
        if not waves.is_floating_point() or waves.ndim != 2:
            raise DataError(f"expected float (B, T) waveforms, got {waves.dtype} {tuple(waves.shape)}")
        device, (b, t), n = waves.device, waves.shape, self.clip_samples
        index = index.to(device)
        slack = abs(t - n)
        if self.train:
            offset = _randint(keyed_uniform(seed, epoch, index, 1, CLIP_STREAM)[:, 0], 0, slack)
        else:
            offset = torch.full((b,), slack // 2, dtype=torch.int64, device=device)
        d = offset if t >= n else -offset  # fixed[u] = wave[u + d]
        shift = torch.zeros(b, dtype=torch.int64, device=device)
        if self.train and self.time_shift > 0:
            u = keyed_uniform(seed, epoch, index, 1, SHIFT_STREAM)[:, 0]
            shift = _randint(u, -self.time_shift, self.time_shift).clamp_(-n, n)
        positions = torch.arange(n, device=device)[None, :]
        shifted = positions - shift[:, None]  # out[t] = fixed[t - shift]
        source = shifted + d[:, None]
        valid = (shifted >= 0) & (shifted < n) & (source >= 0) & (source < t)
        out = torch.where(valid, waves.gather(1, source.clamp(0, t - 1)), torch.zeros((), device=device))
        if self.train and len(self.noise_lengths):
            u = keyed_uniform(seed, epoch, index, 4, NOISE_STREAM)
            k = _randint(u[:, 2], 0, len(self.noise_lengths) - 1).clamp_(max=len(self.noise_lengths) - 1)
            lengths = self.noise_lengths.to(device)[k]
            start = torch.where(lengths >= n, _randint(u[:, 3], 0, lengths - n), _randint(u[:, 3], 0, lengths - 1))
            noise = self.noise.to(device)[k[:, None], (start[:, None] + positions) % lengths[:, None]]
            volume = (u[:, 1] * self.noise_volume).to(out.dtype)
            out = out + torch.where(u[:, 0:1] < self.noise_prob, volume[:, None] * noise, 0.0)
        return out.clamp_(-1.0, 1.0) if self.train else out


def build_batched_transform(manifest: Manifest, train: bool, **options: object
                            ) -> BatchedImageAugment | BatchedAudioAugment:
    """The in-memory path's counterpart of :func:`~patchplace.data.transforms.build_transform`, with the same
    options: images -> :class:`BatchedImageAugment`; audio -> :class:`BatchedAudioAugment` (``noise_bank``: a
    list of clips or a ``background_noise`` split directory; augmentation when ``train``)."""
    if manifest.modality == "image":
        return BatchedImageAugment(manifest, train, ImageTransformConfig(**options))
    from .audio import load_noise_bank

    noise = options.pop("noise_bank", None)
    if isinstance(noise, (str, os.PathLike)):
        noise = load_noise_bank(noise)
    clip = int(manifest.info.get("clip_samples") or manifest.info["sample_rate"])
    return BatchedAudioAugment(train, clip, noise_bank=(noise or []) if train else [], **options)
