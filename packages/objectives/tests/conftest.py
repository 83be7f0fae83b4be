"""Tiny backbones, tiny objectives of every registered method and structured images for the objectives' tests."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from patchplace.models import create_model
from patchplace.objectives import MethodSpec, get_method

# Per-method test settings beside the tiny widths: MJP's jigsaw on every step from the first, on 0.15 of the patches.
TEST_FIELDS = {"mjp": {"ratio": 0.15, "apply_prob": 1.0, "warmup_fraction": 0.0}}


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


def tiny_config(spec: MethodSpec, **extra):
    """``spec``'s config with a tiny decoder / predictor (by its config's fields) and its :data:`TEST_FIELDS`."""
    names = {f.name for f in fields(spec.config_cls)}
    small = {f"{part}_{what}": value for part in ("decoder", "predictor") if f"{part}_dim" in names
             for what, value in (("dim", 32), ("depth", 1), ("heads", 2))}
    small.update({"min_keep": 2} if "min_keep" in names else {})
    return spec.config({**small, **TEST_FIELDS.get(spec.name, {}), **extra})


@pytest.fixture
def method_objective():
    """Factory: registered method ``name`` on a tiny backbone of its modality (``vit_micro`` on 32 px, 1 channel,
    3 classes when it trains through a head; ``audio_mp3``) with its PE mode, at :func:`tiny_config` widths."""

    def make(name: str, **extra):
        spec = get_method(name)
        if spec.modality == "audio":
            backbone = create_model("audio_mp3", pos_embed=spec.pos_embed, num_classes=0)
        else:
            backbone = create_model("vit_micro", in_chans=1, img_size=32, pos_embed=spec.pos_embed,
                                    num_classes=3 if spec.needs_head else 0)
        return spec.objective_cls(backbone, tiny_config(spec, **extra))

    return make


@pytest.fixture
def tiny_method_config():
    return tiny_config


def random_batch(objective, size: int, device: str = "cpu", generator: torch.Generator | None = None):
    """(inputs, labels) of ``size`` random samples shaped for ``objective``'s backbone (images or MFCC frames), labels
    of 3 classes."""
    config = objective.backbone.config
    shape = (config.num_frames, config.in_features) if config.modality == "audio" else \
        (config.in_chans, config.img_size, config.img_size)
    x = torch.randn(size, *shape, generator=generator, device=device)
    return x, torch.randint(0, 3, (size,), generator=generator, device=device)


@pytest.fixture
def batch_of():
    """Factory: :func:`random_batch`."""
    return random_batch
