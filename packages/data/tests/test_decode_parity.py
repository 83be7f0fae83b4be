"""The fast JPEG path (torchvision.io.decode_jpeg) gives exactly Pillow's pixels and errors: a generated corpus of
every kind the reader meets in ImageNet-like folders (baseline / progressive, 4:4:4 / 4:2:2 / 4:2:0, gray,
Adobe RGB, CMYK, EXIF-rotated, MPO, PNG bytes in a .JPEG, truncated and corrupt bytes), at 1 and 2 torch threads;
the kinds it must not take (CMYK, other subsampling, 12-bit, arithmetic coding, oversized) stay on Pillow."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
import torch
from PIL import Image

from patchplace.data import DataError, decode_image_bytes
from patchplace.data.codecs import (
    _SAMPLING_FAST,
    _decode_jpeg_fast,
    _torchvision_decoder,
    decode_with_pillow,
    fast_jpeg_layers,
)

SIZES = [(1, 1), (7, 13), (17, 33), (123, 77), (240, 320)]


def _photo(h: int, w: int, channels: int, seed: int) -> np.ndarray:
    """Smooth gradients + noise (compresses like a photo; odd sizes exercise partial MCUs)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    wave = np.sin(xx[..., None] / rng.uniform(3, 30, channels) + yy[..., None] / 7)
    base = rng.uniform(40, 200, channels) + 40 * wave
    pixels = np.clip(base + rng.normal(0, 20, (h, w, channels)), 0, 255).astype(np.uint8)
    return pixels[..., 0] if channels == 1 else pixels


def _jpeg(pixels: np.ndarray, mode: str | None = None, **options) -> bytes:
    image = Image.fromarray(pixels)
    buf = io.BytesIO()
    (image.convert(mode) if mode else image).save(buf, "JPEG", **{"quality": 90, **options})
    return buf.getvalue()


def _patched(data: bytes, marker: bytes, offset: int, value: int) -> bytes:
    """``data`` with byte ``offset`` of the first ``marker`` segment (0 = its first length byte) set to ``value``."""
    at = data.index(marker) + 2 + offset
    return data[:at] + bytes([value]) + data[at + 1:]


def _fast_corpus() -> dict[str, bytes]:
    """JPEGs the fast path takes, by kind."""
    corpus = {}
    for i, (h, w) in enumerate(SIZES):
        rgb, gray = _photo(h, w, 3, i), _photo(h, w, 1, i)
        for sub in ("4:4:4", "4:2:2", "4:2:0"):
            corpus[f"baseline {sub} {h}x{w}"] = _jpeg(rgb, subsampling=sub)
            corpus[f"progressive {sub} {h}x{w}"] = _jpeg(rgb, subsampling=sub, progressive=True)
        corpus[f"optimized q50 {h}x{w}"] = _jpeg(rgb, quality=50, optimize=True)
        corpus[f"gray {h}x{w}"] = _jpeg(gray)
        corpus[f"gray progressive {h}x{w}"] = _jpeg(gray, progressive=True)
    rgb = _photo(96, 80, 3, 7)
    corpus["gray sampled 2x2"] = _patched(_jpeg(_photo(96, 80, 1, 7)), b"\xff\xc0", 9, 0x22)  # one component
    corpus["adobe rgb (transform 0)"] = _jpeg(rgb, keep_rgb=True)
    corpus["adobe transform 1"] = _patched(corpus["adobe rgb (transform 0)"], b"\xff\xeeAdobe"[:2], 13, 1)
    corpus["restart markers"] = _jpeg(rgb, restart_marker_blocks=3)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 on display; neither path rotates
    corpus["exif orientation 6"] = _jpeg(rgb, exif=exif.tobytes())
    corpus["icc profile"] = _jpeg(rgb, icc_profile=b"\x00" * 200)
    mpo = io.BytesIO()
    Image.fromarray(rgb).save(mpo, "MPO", save_all=True, append_images=[Image.fromarray(255 - rgb)])
    corpus["mpo (two frames)"] = mpo.getvalue()
    base = corpus["baseline 4:2:0 240x320"]
    corpus["trailing bytes"] = base + b"\x00junk" * 50
    middle = len(base) // 2
    corpus["corrupt scan data"] = base[:middle] + b"\x13" * 20 + base[middle + 20:]
    return corpus


def _pillow_corpus() -> dict[str, bytes]:
    """Bytes the fast path must leave to Pillow, by kind."""
    rgb = _photo(64, 48, 3, 3)
    base = _jpeg(rgb, subsampling="4:2:2")
    png = io.BytesIO()
    Image.fromarray(rgb).save(png, "PNG")
    gray_png = io.BytesIO()
    Image.fromarray(_photo(64, 48, 1, 3)).save(gray_png, "PNG")
    return {"cmyk": _jpeg(rgb, mode="CMYK"), "cmyk progressive": _jpeg(rgb, mode="CMYK", progressive=True),
            "png bytes in a .JPEG": png.getvalue(), "gray png": gray_png.getvalue(),
            "4:4:0 sampling": _patched(base, b"\xff\xc0", 9, 0x12),
            "4:1:1 sampling": _patched(base, b"\xff\xc0", 9, 0x41), "12-bit": _patched(base, b"\xff\xc0", 2, 12),
            "arithmetic coding": base.replace(b"\xff\xc0", b"\xff\xc9", 1), "empty": b"", "SOI only": b"\xff\xd8",
            "not an image": b"GIF89a nonsense", "header only": base[:base.index(b"\xff\xda")]}


def _outcome(decode, data: bytes, channels: int) -> tuple[str, object]:
    try:
        return "pixels", decode(data, channels, key="k")
    except DataError as exc:  # Pillow names an unidentified file's BytesIO by its address: not part of the error
        return "DataError", re.sub(r"0x[0-9a-f]+", "0x...", str(exc))


def _assert_same(data: bytes, channels: int, kind: str) -> None:
    got, want = _outcome(decode_image_bytes, data, channels), _outcome(decode_with_pillow, data, channels)
    assert got[0] == want[0], f"{kind}, {channels} channel(s): {got[0]} vs Pillow's {want[0]}"
    if got[0] == "pixels":
        new, old = got[1], want[1]
        assert new.dtype == old.dtype and new.shape == old.shape and new.is_contiguous(), kind
        assert torch.equal(new, old), f"{kind}, {channels} channel(s): max diff {(new.int() - old.int()).abs().max()}"
    else:
        assert got[1] == want[1], kind


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_the_fast_path_is_on_in_this_environment():
    """torchvision and Pillow agree on the probe set, so the reader uses the fast path (else every file would still
    decode, through Pillow, and the speed-up would be lost silently)."""
    assert _torchvision_decoder() is not None


def test_every_fast_kind_decodes_to_pillows_pixels(threads):
    for kind, data in _fast_corpus().items():
        layers = fast_jpeg_layers(data)
        assert layers in (1, 3), kind
        for channels in (1, 3):
            if channels == 1 and layers == 3:
                assert _decode_jpeg_fast(data, 1) is None, kind  # colour into gray: Pillow's error names it
            elif "corrupt" not in kind:
                assert _decode_jpeg_fast(data, channels) is not None, f"{kind} should take the fast path"
            _assert_same(data, channels, kind)


def _sampling(data: bytes) -> tuple[int, ...]:
    frame = data.index(b"\xff\xc0" if b"\xff\xc0" in data else b"\xff\xc2") + 4
    return tuple(data[frame + 7 + 3 * i] for i in range(data[frame + 5]))


def test_the_corpus_covers_every_subsampling_the_fast_path_takes():
    seen = {_sampling(data) for data in _fast_corpus().values()}
    assert seen >= _SAMPLING_FAST, sorted(_SAMPLING_FAST - seen)


def test_gray_jpegs_expand_to_rgb_and_colour_jpegs_in_a_gray_split_are_refused():
    gray, rgb = _jpeg(_photo(40, 30, 1, 0)), _jpeg(_photo(40, 30, 3, 0))
    x = decode_image_bytes(gray, 3)
    assert x.shape == (3, 40, 30) and torch.equal(x[0], x[1]) and torch.equal(x[1], x[2])
    assert torch.equal(decode_image_bytes(gray, 1)[0], x[0])
    with pytest.raises(DataError, match=r"sample k: a colour image \(PIL mode RGB\)"):
        decode_image_bytes(rgb, 1, key="k")


def test_what_the_fast_path_leaves_to_pillow_decodes_as_before(threads):
    for kind, data in _pillow_corpus().items():
        assert fast_jpeg_layers(data) is None, kind
        for channels in (1, 3):
            _assert_same(data, channels, kind)


@pytest.mark.parametrize("cut", [0.5, -2, -1])
def test_truncated_jpegs_raise_pillows_one_line_error(cut):
    data = _jpeg(_photo(120, 160, 3, 1))
    cut_data = data[:int(len(data) * cut)] if cut > 0 else data[:cut]
    assert fast_jpeg_layers(cut_data) == 3  # the header is whole: torchvision refuses it, Pillow words the error
    with pytest.raises(DataError, match=r"^sample k: cannot decode image \(image file is truncated") as err:
        decode_image_bytes(cut_data, 3, key="k")
    assert "\n" not in str(err.value)
    _assert_same(cut_data, 3, f"truncated at {cut}")


def test_images_over_pillows_pixel_limit_stay_on_pillow(monkeypatch):
    data = _jpeg(_photo(64, 64, 3, 2))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # Pillow: a warning above it, an error above twice it
    assert fast_jpeg_layers(data) is None
    with pytest.raises(Image.DecompressionBombError):
        decode_image_bytes(data, 3)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    assert fast_jpeg_layers(data) == 3
