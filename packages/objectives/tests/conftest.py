"""Tiny backbones and structured images for the objectives' tests."""

from __future__ import annotations

import pytest
import torch

from patchplace.models import create_model


def structured_images(n: int, size: int = 32, channels: int = 1, seed: int = 0) -> torch.Tensor:
    """Images whose content makes positions inferable, like natural images: a random mix of a vertical and a
    horizontal gradient, three random blobs, mild pixel noise; normalized. (B, C, size, size)."""
    g = torch.Generator().manual_seed(seed)
    r = torch.linspace(0, 1, size)
    rows, cols = torch.meshgrid(r, r, indexing="ij")
    img = (torch.rand(n, channels, 1, 1, generator=g) + 0.5) * rows + (torch.rand(n, channels, 1, 1, generator=g)
                                                                       + 0.5) * cols
    for _ in range(3):
        cy, cx = torch.rand(n, 1, 1, 1, generator=g), torch.rand(n, 1, 1, 1, generator=g)
        blob = torch.exp(-((rows - cy) ** 2 + (cols - cx) ** 2) / 0.02)
        img = img + 0.5 * blob * torch.randn(n, channels, 1, 1, generator=g)
    img = img + 0.05 * torch.randn(n, channels, size, size, generator=g)
    return (img - img.mean()) / img.std()


@pytest.fixture
def images():
    return structured_images


@pytest.fixture
def micro():
    """Factory: a seeded 2-layer, 32-wide ViT on 16 x 16 images with patch 4 (16 positions)."""

    def make(**overrides):
        torch.manual_seed(overrides.pop("seed", 0))
        args = dict(img_size=16, patch_size=4, in_chans=1)
        return create_model("vit_micro", **{**args, **overrides})

    return make
