"""Encode samples for shards and decode them back: images as uint8 tensors, audio as float32 16 kHz mono."""

from __future__ import annotations

import functools
import io
import warnings
from collections.abc import Callable
from math import gcd
from types import ModuleType

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from .errors import DataError
from .extras import missing

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
    file where 1 channel is declared is a :class:`DataError` naming ``key`` (its colour would be lost to gray).
    The JPEGs :func:`fast_jpeg_layers` admits go through ``torchvision.io.decode_jpeg`` (the same libjpeg-turbo
    decode, pixel for pixel, without Pillow's image object); every other file, and any JPEG torchvision refuses,
    through Pillow, whose pixels and errors are the reference."""
    if channels not in _PIL_MODE:
        raise DataError(f"channels must be 1 or 3, got {channels}")
    fast = _decode_jpeg_fast(data, channels)
    return fast if fast is not None else decode_with_pillow(data, channels, key)


def decode_with_pillow(data: bytes, channels: int, key: str = "?") -> torch.Tensor:
    """:func:`decode_image_bytes` through Pillow alone (the reference the fast JPEG path is tested against)."""
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


# JPEG frames (SOF markers; C4 / C8 / CC are DHT, JPG, DAC) and those decoded on the fast path: Huffman-coded
# 8-bit baseline, extended and progressive. Lossless, hierarchical and arithmetic-coded frames stay on Pillow.
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_SOF_FAST = frozenset({0xC0, 0xC1, 0xC2})
# Sampling factors (H << 4 | V) of Y, Cb, Cr the parity tests cover: 4:4:4, 4:2:2, 4:2:0, what Pillow writes
# (others, e.g. 4:4:0 or 4:1:1, stay on Pillow). A one-component (gray) frame is decoded at full size whatever its
# factors.
_SAMPLING_FAST = frozenset({(0x11, 0x11, 0x11), (0x21, 0x11, 0x11), (0x22, 0x11, 0x11)})
# False: every image through Pillow (the reference), e.g. to time the reader without the fast path; DataLoader
# workers started by fork see the value it had then
FAST_JPEG = True
_TORCHVISION_DEPRECATION = "The image decoding and encoding capabilities of TorchVision are deprecated"


def fast_jpeg_layers(data: bytes) -> int | None:
    """The component count (1: gray, 3: YCbCr / RGB) of a JPEG that ``torchvision.io.decode_jpeg`` decodes to
    Pillow's very pixels, read from its markers up to the first scan without decoding; None for anything else:
    not a JPEG (PNG bytes in a ``.JPEG`` file), CMYK / YCCK (4 components: Pillow's inverted-CMYK conversion is the
    reference), 12-bit, lossless or arithmetic-coded frames, untested chroma subsampling, zero or over-limit sizes
    (Pillow's ``MAX_IMAGE_PIXELS`` check), malformed marker segments. EXIF orientation is ignored on both paths
    (neither rotates: the pixels are stored as they are)."""
    if not data.startswith(b"\xff\xd8\xff"):
        return None
    pos, end, layers = 2, len(data), None
    while pos + 4 <= end:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if marker == 0xDA:  # start of scan: the header is complete
            return layers
        if marker in (0x00, 0x01) or 0xD0 <= marker <= 0xD9:  # no marker segment may stand here
            return None
        length = data[pos + 2] << 8 | data[pos + 3]
        if marker in _SOF:
            if layers is not None or marker not in _SOF_FAST:
                return None
            layers = _frame_layers(data[pos + 4:pos + 2 + length])
            if layers is None:
                return None
        pos += 2 + length
    return None


def _frame_layers(frame: bytes) -> int | None:
    """The component count of a SOF segment's body when the fast path decodes it exactly, else None."""
    if len(frame) < 6 or frame[0] != 8:  # sample precision: 8 bits
        return None
    height, width, layers = frame[1] << 8 | frame[2], frame[3] << 8 | frame[4], frame[5]
    if len(frame) < 6 + 3 * layers or not height or not width:
        return None
    limit = Image.MAX_IMAGE_PIXELS  # Pillow warns above it and refuses above twice it: keep its word
    if limit is not None and height * width > limit:
        return None
    sampling = tuple(frame[7 + 3 * i] for i in range(layers))
    return layers if layers == 1 or (layers == 3 and sampling in _SAMPLING_FAST) else None


def _decode_jpeg_fast(data: bytes, channels: int) -> torch.Tensor | None:
    """``data`` decoded by ``torchvision.io.decode_jpeg`` when :func:`fast_jpeg_layers` admits it for
    ``channels`` (a colour JPEG where 1 channel is declared goes to Pillow, whose error names it) and this
    torchvision agrees with this Pillow (:func:`_torchvision_decoder`); None: decode it with Pillow."""
    layers = fast_jpeg_layers(data) if FAST_JPEG else None
    if layers is None or (channels == 1 and layers != 1):
        return None
    decode = _torchvision_decoder()
    if decode is None:
        return None
    try:
        return decode(data, channels)
    except (RuntimeError, ValueError):  # truncated or corrupt: Pillow's decode gives the reference error (or pixels)
        return None


def _decode_torchvision(data: bytes, channels: int) -> torch.Tensor:
    from torchvision.io import ImageReadMode, decode_jpeg

    mode = ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB
    with warnings.catch_warnings():  # torchvision 0.29 notes the move of its decoders to TorchCodec on every call
        warnings.filterwarnings("ignore", message=_TORCHVISION_DEPRECATION)
        image = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=mode)
    # RGB comes back as a (C, H, W) view of H x W x C pixels: packed like Pillow's path (numpy's transposing copy
    # of uint8 is ~2x torch's .contiguous())
    return image if image.is_contiguous() else torch.from_numpy(np.ascontiguousarray(image.numpy()))


@functools.cache
def _torchvision_decoder() -> Callable[[bytes, int], torch.Tensor] | None:
    """torchvision's JPEG decoder when it is importable and decodes a probe set (RGB baseline 4:2:0, progressive
    4:4:4, gray; odd sizes) to exactly Pillow's pixels in this environment — the two link their own libjpeg builds,
    so a mismatched pair falls back to Pillow everywhere instead of changing samples. Once per process."""
    try:
        from torchvision.io import decode_jpeg  # noqa: F401
    except ImportError:
        return None
    rng = np.random.default_rng(0)
    for shape, options in (((37, 51, 3), {"subsampling": 2}), ((37, 51, 3), {"subsampling": 0, "progressive": True}),
                           ((37, 51), {})):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(buf, "JPEG", quality=90, **options)
        for channels in (3,) if len(shape) == 3 else (3, 1):
            try:
                fast = _decode_torchvision(buf.getvalue(), channels)
            except RuntimeError:
                return None
            if not torch.equal(fast, decode_with_pillow(buf.getvalue(), channels)):
                return None
    return _decode_torchvision


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


def _soundfile(feature: str) -> ModuleType:
    """soundfile, from the [audio] extra (imported on use: image-only installs go without it)."""
    try:
        import soundfile
    except ImportError as exc:
        raise missing(exc, feature) from exc
    return soundfile


def encode_wav(wave: np.ndarray, sample_rate: int) -> bytes:
    """16-bit PCM WAV bytes of a mono float waveform in [-1, 1] (clipped)."""
    wave = np.asarray(wave, dtype=np.float32)
    if wave.ndim != 1:
        raise DataError(f"audio is stored mono, got shape {wave.shape}; downmix first")
    bad = ~np.isfinite(wave)
    if bad.any():  # NaN would be written as a full-scale click, inf as a clipped one
        raise DataError(f"audio has {int(bad.sum())} non-finite sample(s) (NaN / inf), the first at index "
                        f"{int(np.argmax(bad))}: fix or drop the clip before writing it")
    soundfile = _soundfile("writing WAV audio")
    buf = io.BytesIO()
    soundfile.write(buf, np.clip(wave, -1.0, 1.0), sample_rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def resample(wave: np.ndarray, orig_rate: int, target_rate: int) -> np.ndarray:
    """Polyphase resampling (scipy), exact rational ratio."""
    if orig_rate == target_rate:
        return wave
    try:  # the [audio] extra (patchplace.data.extras)
        from scipy.signal import resample_poly
    except ImportError as exc:
        raise missing(exc, "resampling audio") from exc
    g = gcd(orig_rate, target_rate)
    return resample_poly(wave, target_rate // g, orig_rate // g).astype(np.float32)


def decode_wav(source: bytes | str, key: str = "?") -> tuple[np.ndarray, int]:
    """A WAV (bytes or path) as a float32 mono waveform (channels **downmixed**: their mean) and its sample rate;
    files soundfile cannot parse raise a DataError naming the sample."""
    soundfile = _soundfile("reading WAV audio")
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
