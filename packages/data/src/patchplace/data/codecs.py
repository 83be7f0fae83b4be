"""Encode samples for shards and decode them back: images as uint8 tensors, audio as float32 16 kHz mono."""

from __future__ import annotations

import io
from math import gcd

import numpy as np
import soundfile
import torch
from PIL import Image, UnidentifiedImageError
from scipy.signal import resample_poly

from .errors import DataError

_PIL_MODE = {1: "L", 3: "RGB"}


def encode_png(image: np.ndarray) -> bytes:
    """PNG bytes of a uint8 ``(H, W)`` or ``(H, W, C)`` array (lossless, so stats and pixels round-trip)."""
    if image.dtype != np.uint8:
        raise DataError(f"images are stored as uint8, got {image.dtype}; convert before writing")
    if image.ndim == 3 and image.shape[2] == 1:
        image = image[:, :, 0]
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def decode_image_bytes(data: bytes, channels: int, key: str = "?") -> torch.Tensor:
    """Decode PNG/JPEG/... bytes to a ``(C, H, W)`` uint8 tensor with ``channels`` in {1, 3}.

    A gray file where 3 channels are declared is expanded (lossless: an RGB folder may hold gray JPEGs); a colour
    file where 1 channel is declared is a :class:`DataError` naming ``key`` (its colour would be lost to gray)."""
    if channels not in _PIL_MODE:
        raise DataError(f"channels must be 1 or 3, got {channels}")
    try:
        with Image.open(io.BytesIO(data)) as img:
            if channels == 1 and _coloured(img):
                raise DataError(f"sample {key}: a colour image (PIL mode {img.mode}) in a split whose manifest "
                                "declares 1 channel (gray): converting it would drop its colour; rebuild the split "
                                "with channels 3, or convert its images to gray when writing them")
            array = np.asarray(img.convert(_PIL_MODE[channels]))
    except (UnidentifiedImageError, OSError) as exc:
        raise DataError(f"sample {key}: cannot decode image ({exc}); the shard may be corrupt") from exc
    tensor = torch.from_numpy(array.copy())
    return tensor.unsqueeze(0) if channels == 1 else tensor.permute(2, 0, 1).contiguous()


def _coloured(img: Image.Image) -> bool:
    """Whether an opened image holds colour: more than one colour band (RGB, RGBA, CMYK, YCbCr, ...), or a palette
    with a colour entry. Gray, gray + alpha and bit-depth modes (1, L, LA, I, F, I;16) are not."""
    if img.mode in ("P", "PA"):  # the entries the pixels use (a palette may hold unused colours)
        palette = np.asarray(img.getpalette() or [], dtype=np.int16).reshape(-1, 3)
        used = [index for _, index in img.getcolors(maxcolors=256) or []]
        used = [i for i in (used if img.mode == "P" else range(len(palette))) if i < len(palette)]
        return bool((palette[used] != palette[used, :1]).any())
    return len([band for band in img.getbands() if band not in ("A", "X")]) > 1


def encoded_size(data: bytes, key: str = "?") -> tuple[int, int]:
    """(H, W) from an encoded image's header (PNG, JPEG, ...), without decoding its pixels."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
    except (UnidentifiedImageError, OSError) as exc:
        raise DataError(f"sample {key}: cannot read the encoded image's header ({exc})") from exc
    return height, width


def encode_wav(wave: np.ndarray, sample_rate: int) -> bytes:
    """16-bit PCM WAV bytes of a mono float waveform in [-1, 1] (clipped)."""
    wave = np.asarray(wave, dtype=np.float32)
    if wave.ndim != 1:
        raise DataError(f"audio is stored mono, got shape {wave.shape}; downmix first")
    bad = ~np.isfinite(wave)
    if bad.any():  # NaN would be written as a full-scale click, inf as a clipped one
        raise DataError(f"audio has {int(bad.sum())} non-finite sample(s) (NaN / inf), the first at index "
                        f"{int(np.argmax(bad))}: fix or drop the clip before writing it")
    buf = io.BytesIO()
    soundfile.write(buf, np.clip(wave, -1.0, 1.0), sample_rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def resample(wave: np.ndarray, orig_rate: int, target_rate: int) -> np.ndarray:
    """Polyphase resampling (scipy), exact rational ratio."""
    if orig_rate == target_rate:
        return wave
    g = gcd(orig_rate, target_rate)
    return resample_poly(wave, target_rate // g, orig_rate // g).astype(np.float32)


def decode_wav(source: bytes | str, key: str = "?") -> tuple[np.ndarray, int]:
    """A WAV (bytes or path) as a float32 mono waveform (channels **downmixed**: their mean) and its sample rate;
    files soundfile cannot parse raise a DataError naming the sample."""
    try:
        wave, rate = soundfile.read(io.BytesIO(source) if isinstance(source, bytes) else source,
                                    dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, ValueError) as exc:
        raise DataError(f"{key}: cannot read as WAV ({exc}); re-create it as 16 kHz mono PCM") from exc
    return wave.mean(axis=1), int(rate)


def read_wav(source: bytes | str, target_rate: int = 16000, key: str = "?") -> np.ndarray:
    """Read a WAV (bytes or path) as float32 mono at ``target_rate``.

    Policy for other formats: multi-channel audio is **downmixed** (channel mean) and other sample rates are
    **resampled** (polyphase); files soundfile cannot parse raise a DataError naming the sample.
    """
    wave, rate = decode_wav(source, key)
    return resample(wave, rate, target_rate)
