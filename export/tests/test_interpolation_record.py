"""The export resizes with the interpolation the checkpoint recorded (``data.interpolation``; bicubic when none):
the sidecar's resize step, its evaluation transform and timm's keywords name it, the numpy reference then gives
timm's eval transform of that interpolation bit for bit, and a sidecar whose three disagree is refused."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from PIL import Image
from timm.data import create_transform

from patchplace.export.exporter import consistency_problem, image_preprocessing, recorded_interpolation
from patchplace.export.preprocess import preprocess
from patchplace.models import create_model

STATS = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
SIZES = [(37, 53), (64, 48), (40, 40), (91, 33)]


def image(h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 (3, h, w): a gradient plus noise."""
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / w, yy * 255 / h, (xx + yy) * 127 / (h + w)])
    return np.clip(base + rng.normal(0, 25, (3, h, w)), 0, 255).astype(np.uint8)


def test_the_recorded_interpolation_wins_then_the_recipes_then_bicubic():
    assert recorded_interpolation({}) == "bicubic"
    assert recorded_interpolation({"recipe": {"data": {"interpolation": "bilinear"}}}) == "bilinear"
    assert recorded_interpolation({"interpolation": "lanczos", "recipe": {"data": {"interpolation": "bilinear"}}}) \
        == "lanczos"


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic", "lanczos", "nearest"])
def test_the_sidecar_resizes_with_the_recorded_interpolation(interpolation):
    backbone = create_model("vit_micro", img_size=32, in_chans=3, num_classes=3)
    metadata = {"normalization": STATS, "crop_pct": 0.875, "interpolation": interpolation}
    pre = json.loads(json.dumps(image_preprocessing(backbone, metadata)))
    [resize] = [s for s in pre["steps"] if s["op"] == "resize"]
    record = pre["eval_transform"]
    assert resize["interpolation"] == record["interpolation"] == record["timm"]["interpolation"] == interpolation
    assert pre["interpolation"] == interpolation
    timm_eval = create_transform(**record["timm"])
    rng = np.random.default_rng(0)
    for h, w in SIZES:
        x = image(h, w, rng)
        want = timm_eval(Image.fromarray(x.transpose(1, 2, 0))).numpy()
        assert np.array_equal(preprocess([x], pre)[0], want), (interpolation, h, w)
    sidecar = {"preprocessing": pre, "normalization": STATS, "inputs": [{"shape": ["N", 3, 32, 32]}]}
    assert consistency_problem(sidecar) == ""
    other = "bicubic" if interpolation != "bicubic" else "bilinear"
    for where in ("timm", "step"):
        broken = copy.deepcopy(sidecar)
        target = broken["preprocessing"]["eval_transform"]["timm"] if where == "timm" else next(
            s for s in broken["preprocessing"]["steps"] if s["op"] == "resize")
        target["interpolation"] = other
        assert "interpolation" in consistency_problem(broken), where
