"""evaluate.py --privacy's picture (MJP Fig. 5's grid) on gray and on RGB images: one column per image, drawn from
(N, C, H, W) arrays in [0, 1] (an RGB split, ImageNet's, crashed the plot after every number was computed)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from patchplace.pipelines.evaluation import plot_privacy_grid


@pytest.mark.parametrize("channels", [1, 3])
def test_the_privacy_grid_draws_gray_and_rgb_images(tmp_path, channels):
    images = np.random.default_rng(0).random((3, channels, 8, 8), dtype=np.float32)
    path = tmp_path / "privacy.png"
    plot_privacy_grid(images, images[::-1], {"gradient": images}, {"gradient": images}, path, "grid")
    drawn = np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)
    colour = np.abs(drawn[..., 0] - drawn[..., 1]).max()
    assert (colour > 0) == (channels == 3), "RGB images drawn in colour, gray ones gray"
