"""Tiny backbones for fast CPU tests."""

from __future__ import annotations

import pytest
import torch

from patchplace.models import create_model


@pytest.fixture
def micro():
    """Factory: a 2-layer, 32-wide ViT on 16 x 16 images with patch 4 (16 positions), eval mode, seeded."""

    def make(**overrides):
        torch.manual_seed(overrides.pop("seed", 0))
        args = dict(img_size=16, patch_size=4, in_chans=3, num_classes=5)
        return create_model("vit_micro", **{**args, **overrides}).eval()

    return make
