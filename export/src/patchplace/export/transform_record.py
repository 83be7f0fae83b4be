"""The evaluation transform of raw images a checkpoint records (padding, resize and crop, normalization), written
into the sidecar and the ``.onnx`` file's metadata so that onnxruntime + numpy alone preprocess as PyTorch does."""

from __future__ import annotations

import math
from typing import Any

from patchplace.models import Backbone


def image_preprocessing(backbone: Backbone, metadata: dict[str, Any]) -> dict[str, Any]:
    """How raw uint8 images become the ``pixels`` input, step by step, with the constants — what the evaluation
    path of ``patchplace.data`` does (pad, resize only when the checkpoint trained at another side, scale,
    normalize), written so that numpy alone can reproduce it."""
    c = backbone.config
    height, width = c.image_hw
    norm = metadata.get("normalization") or {"mean": [0.5] * c.in_chans, "std": [0.5] * c.in_chans}
    pad_to, img_size = metadata.get("pad_to"), metadata.get("img_size")
    steps: list[dict[str, Any]] = []
    if pad_to:
        steps.append({"op": "pad", "to": pad_to, "value": 0, "on": "uint8 pixels, (C, h, w)",
                      "placement": "centered: top = (to - h) // 2, left = (to - w) // 2, the rest bottom / right",
                      "when": "h, w <= to (larger images are refused, not cropped)"})
    record = eval_transform(backbone, metadata)
    crop_pct = record["crop_pct"] if record["mode"] == "resize_center_crop" else 1.0
    kernel = recorded_interpolation(metadata)
    # images of any size (resize_center_crop) always go through the resize and the crop (no-ops at the input's
    # size); padded ones only when the checkpoint trained at another side than the padding's
    resize = record["mode"] == "resize_center_crop" or (bool(img_size) and img_size != (pad_to or height))
    if resize:
        short_side = record.get("resize_short_side", math.floor(height / crop_pct))
        steps += [{"op": "resize", "short_side": short_side, "interpolation": kernel, "library": "PIL",
                   "long_side": "int(short_side * long / short) (torchvision Resize(int)); no resize when equal"},
                  {"op": "center_crop", "height": height, "width": width,
                   "placement": "top = int(round((h - height) / 2)), left likewise (torchvision CenterCrop)"}]
    steps += [{"op": "scale", "divide_by": 255.0, "to": "float32"},
              {"op": "normalize", "mean": list(norm["mean"]), "std": list(norm["std"]),
               "formula": "(x - mean[c]) / std[c] per channel"}]
    return {"input": "pixels", "layout": "NCHW", "dtype": "float32", "channels": c.in_chans, "height": height,
            "width": width, "steps": steps, "mean": list(norm["mean"]), "std": list(norm["std"]),
            "pad_to": pad_to, "pad_value": 0, "interpolation": kernel if resize else "none (no resize)",
            "crop": f"center, crop_pct {crop_pct}" if resize else "none", "eval_transform": record}


def recorded_interpolation(metadata: dict[str, Any]) -> str:
    """The interpolation of a checkpoint's evaluation resize: ``metadata.interpolation`` (written where it is not
    bicubic), else its recipe's ``data.interpolation``, else bicubic (timm's default, every checkpoint before the
    field)."""
    recipe_data = ((metadata.get("recipe") or {}).get("data") or {}) if isinstance(metadata.get("recipe"), dict) else {}
    return str(metadata.get("interpolation") or recipe_data.get("interpolation") or "bicubic")


def recorded_crop_pct(metadata: dict[str, Any]) -> tuple[float, str]:
    """(crop_pct, where it came from) of a checkpoint's evaluation transform: ``metadata.crop_pct`` (an export's
    ``crop_pct=`` sets it), else its recipe's ``data.crop_pct``, else 1.0 (timm's resize to the input, no margin)."""
    recipe_data = ((metadata.get("recipe") or {}).get("data") or {}) if isinstance(metadata.get("recipe"), dict) else {}
    for value, source in ((metadata.get("crop_pct"), "checkpoint metadata.crop_pct"),
                          (recipe_data.get("crop_pct"), "checkpoint metadata.recipe.data.crop_pct")):
        if value is not None:
            return float(value), source
    return 1.0, "default (the checkpoint records no crop_pct)"


def eval_transform(backbone: Backbone, metadata: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's evaluation transform of raw images, as ``patchplace.data`` (timm's ``create_transform(
    is_training=False)``) runs it, with every constant the ONNX Runtime evaluator needs to give PyTorch's input
    bit for bit. ``mode`` ``pad``: zero-pad (centered) to ``pad_to`` (larger images are refused, not cropped);
    ``resize_center_crop``: PIL resize with the recorded interpolation (:func:`recorded_interpolation`) of the
    short side to ``floor(size / crop_pct)`` (torchvision's ``Resize(int)``: the long side ``int(short * long /
    short_side)``), center crop to ``size`` (top ``int(round((h - size) / 2))``), /255, normalize; ``timm`` holds
    the keyword arguments of that transform."""
    c = backbone.config
    height, width = c.image_hw
    norm = metadata.get("normalization") or {"mean": [0.5] * c.in_chans, "std": [0.5] * c.in_chans}
    record: dict[str, Any] = {"input_size": [c.in_chans, height, width], "mean": [float(v) for v in norm["mean"]],
                              "std": [float(v) for v in norm["std"]]}
    if metadata.get("pad_to"):
        return {"mode": "pad", "pad_to": int(metadata["pad_to"]), "pad_value": 0, **record,
                "larger_images": "refused (padding never crops)"}
    crop_pct, source = recorded_crop_pct(metadata)
    kernel = recorded_interpolation(metadata)
    if height != width or not 0 < crop_pct <= 1:
        return {"mode": "none", **record, "why": f"no resize record for a {height}x{width} input / crop_pct "
                                                 f"{crop_pct} (square inputs, crop_pct in (0, 1] only)"}
    return {"mode": "resize_center_crop", **record, "crop_pct": crop_pct, "crop_pct_source": source,
            "resize_short_side": math.floor(height / crop_pct), "interpolation": kernel,
            "resize": f"PIL Image.resize({kernel.upper()}) of the short side to resize_short_side, the long side "
                      "int(resize_short_side * long / short) (torchvision Resize(int); no resize when equal)",
            "crop": "center: top = int(round((h - size) / 2)), left = int(round((w - size) / 2)) (Python round)",
            "scale": "x / 255 (float32)", "normalize": "(x - mean[c]) / std[c] (float32)",
            "timm": {"is_training": False, "input_size": [c.in_chans, height, width], "crop_pct": crop_pct,
                     "crop_mode": "center", "interpolation": kernel, "mean": [float(v) for v in norm["mean"]],
                     "std": [float(v) for v in norm["std"]]}}
