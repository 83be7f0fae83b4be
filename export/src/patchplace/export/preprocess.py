"""The exported model's preprocessing as numpy + PIL apply it: raw uint8 images -> the ``pixels`` input.

The export records its evaluation transform as data (``preprocessing["steps"]`` in ``model.json`` and in the
``.onnx`` file's ``metadata_props``): ``pad`` (centred zeros, padded checkpoints), ``resize`` (the short side to
``short_side`` with the interpolation named, the long side ``int(short_side * long / short)``: torchvision's
``Resize(int)``), ``center_crop`` (top ``int(round((h - height) / 2))``: torchvision's ``CenterCrop``), ``scale``
(``x / 255`` in float32) and ``normalize`` (``(x - mean[c]) / std[c]`` in float32). :func:`preprocess` applies
them in order and gives timm's eval tensor (``timm.data.create_transform(**resolve_data_config(...))``) bit for bit
(``export/tests/test_preprocess.py``). This module imports numpy and PIL only — no torch, nothing else of patchplace
— so it can be copied beside an ONNX Runtime deployment as it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from PIL import Image

INTERPOLATIONS = {"bicubic": Image.BICUBIC, "bilinear": Image.BILINEAR, "nearest": Image.NEAREST,
                  "lanczos": Image.LANCZOS, "box": Image.BOX, "hamming": Image.HAMMING}


def preprocess(images: np.ndarray | Iterable[np.ndarray], preprocessing: Mapping[str, Any]) -> np.ndarray:
    """uint8 images -> the model's float32 ``pixels`` (N, C, H, W), by the recorded ``preprocessing["steps"]``.
    ``images``: an (N, C, h, w) array or a sequence of (C, h, w) arrays of any sizes."""
    return np.stack([preprocess_one(np.asarray(image), preprocessing) for image in images])


def preprocess_one(image: np.ndarray, preprocessing: Mapping[str, Any]) -> np.ndarray:
    """One uint8 (C, h, w) image -> float32 (C, H, W) by the recorded steps."""
    if image.dtype != np.uint8 or image.ndim != 3:
        raise ValueError(f"expected a uint8 (C, h, w) image, got {image.dtype} {image.shape}")
    x: np.ndarray = image
    for step in preprocessing["steps"]:
        op = step["op"]
        if op == "pad":
            x = pad(x, int(step["to"]), int(step.get("value", 0)))
        elif op == "resize":
            x = resize_short_side(x, int(step.get("short_side", step.get("size"))), step.get("interpolation",
                                                                                           "bicubic"))
            if "then" in step:  # exports before the crop was its own step: the crop to the model's input
                x = center_crop(x, int(preprocessing["height"]), int(preprocessing["width"]))
        elif op == "center_crop":
            x = center_crop(x, int(step["height"]), int(step["width"]))
        elif op == "scale":
            x = x.astype(np.float32) / np.float32(step["divide_by"])
        elif op == "normalize":
            mean, std = (np.asarray(step[k], np.float32)[:, None, None] for k in ("mean", "std"))
            x = (x - mean) / std
        else:
            raise ValueError(f"unknown preprocessing step {step!r}")
    return x.astype(np.float32, copy=False)


def pad(image: np.ndarray, to: int, value: int = 0) -> np.ndarray:
    """Centred padding of a (C, h, w) image to (C, to, to): top ``(to - h) // 2``, the rest at the bottom (the data
    path's PadTo); larger images are refused, never cropped."""
    _, h, w = image.shape
    if h > to or w > to:
        raise ValueError(f"a {h}x{w} image is larger than the {to} px the model pads to (padding never crops)")
    top, left = (to - h) // 2, (to - w) // 2
    return np.pad(image, ((0, 0), (top, to - h - top), (left, to - w - left)), constant_values=value)


def resize_short_side(image: np.ndarray, short_side: int, interpolation: str = "bicubic") -> np.ndarray:
    """PIL resize of a uint8 (C, h, w) image (C 1 or 3) so that its short side is ``short_side`` and its long side
    ``int(short_side * long / short)`` — torchvision's ``Resize(int)`` on a PIL image; no resize when equal."""
    c, h, w = image.shape
    short, long = (w, h) if w <= h else (h, w)
    new_long = int(short_side * long / short)
    new_w, new_h = (short_side, new_long) if w <= h else (new_long, short_side)
    if (new_h, new_w) == (h, w):
        return image
    if interpolation not in INTERPOLATIONS:
        raise ValueError(f"interpolation {interpolation!r}: one of {', '.join(INTERPOLATIONS)}")
    resized = to_pil(image).resize((new_w, new_h), INTERPOLATIONS[interpolation])
    return np.asarray(resized).reshape(new_h, new_w, c).transpose(2, 0, 1)


def center_crop(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """The centre (C, height, width) of a (C, h, w) image: top ``int(round((h - height) / 2))`` (torchvision's
    ``CenterCrop``, Python's round); an image smaller than the crop is refused."""
    _, h, w = image.shape
    if h < height or w < width:
        raise ValueError(f"a {h}x{w} image is smaller than the {height}x{width} crop")
    top, left = round((h - height) / 2.0), round((w - width) / 2.0)  # Python's round, as torchvision
    return image[:, top:top + height, left:left + width]


def to_pil(image: np.ndarray) -> Image.Image:
    """uint8 (C, h, w), C 1 (``L``) or 3 (``RGB``) -> a PIL image."""
    c = image.shape[0]
    if c not in (1, 3):
        raise ValueError(f"PIL resizes 1- or 3-channel images, got {c} channels")
    hwc = np.ascontiguousarray(image.transpose(1, 2, 0))
    return Image.fromarray(hwc[..., 0] if c == 1 else hwc)  # uint8: mode L or RGB
