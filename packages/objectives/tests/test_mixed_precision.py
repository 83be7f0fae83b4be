"""bf16 autocast (``run.mixed_precision=bf16``; CPU autocast here, CUDA in tests/test_gpu.py) against fp32 on the
same batch, masks and noise, for every objective the pipelines train.

Stated tolerances: loss within 1% (relative) of fp32 and the gradient's cosine similarity to fp32's >= 0.99. Measured
on tiny models at initialization (5 seeds): losses within 0.22% (RandSAC; MAE 0.18%, I-JEPA 0.08%, the
classification losses 0.01%), gradient cosine >= 0.9996. The losses, the I-JEPA / StoP targets (LayerNorm of the
EMA encoder's features) and DropPos's smoothed position targets are computed in fp32 whatever the autocast; masks
are integer / bool and noise is drawn in fp32 (``torch.rand`` ignores autocast).
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
import torch.nn.functional as F

from patchplace.models import create_model
from patchplace.objectives import (
    IJEPA,
    MAE,
    MJP,
    MP3,
    DropPos,
    DropPosConfig,
    IJEPAConfig,
    MAEConfig,
    MJPConfig,
    MP3Config,
    RandSAC,
    RandSACConfig,
    Supervised,
)

DECODER = dict(decoder_dim=32, decoder_depth=1, decoder_heads=2)
PREDICTOR = dict(predictor_dim=32, predictor_depth=1, predictor_heads=2, min_keep=2)


def image_backbone(pos: str, classes: int = 0):
    return create_model("vit_micro", in_chans=1, img_size=32, pos_embed=pos, num_classes=classes)


OBJECTIVES = {
    "supervised": lambda: Supervised(image_backbone("learned", 3)),
    "mp3": lambda: MP3(image_backbone("none")),
    "mp3_speech": lambda: MP3(create_model("audio_mp3", pos_embed="sincos1d", num_classes=0),
                              MP3Config(eta=0.0, anchor_ratio=0.05)),
    "droppos": lambda: DropPos(image_backbone("sincos2d"), DropPosConfig(**DECODER)),
    "mae": lambda: MAE(image_backbone("sincos2d"), MAEConfig(**DECODER)),
    "ijepa": lambda: IJEPA(image_backbone("sincos2d"), IJEPAConfig(**PREDICTOR)),
    "stop": lambda: IJEPA(image_backbone("sincos2d"), IJEPAConfig(stop=True, **PREDICTOR)),
    "randsac": lambda: RandSAC(image_backbone("sincos2d"), RandSACConfig(**DECODER)),
    "mjp": lambda: MJP(image_backbone("learned", 3), MJPConfig(ratio=0.15, apply_prob=1.0, warmup_fraction=0.0)),
}


def step(objective, batch, seed: int, bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and flattened gradient of one forward / backward; the same masks and noise for a given seed."""
    torch.manual_seed(seed)
    kwargs = {"generator": torch.Generator().manual_seed(seed)} if "generator" in inspect.signature(
        objective.forward).parameters else {}
    with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
        loss = objective(batch, progress=0.5, **kwargs)["loss"]
    objective.zero_grad()
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in objective.parameters() if p.grad is not None])
    return loss.detach(), grad


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_bf16_loss_and_gradient_stay_close_to_fp32(name, images):
    for seed in (0, 1):
        torch.manual_seed(seed)
        objective = OBJECTIVES[name]().train()
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(16, 101, 40, generator=g) if name == "mp3_speech" else images(16, 32, 1, seed)
        batch = (x, torch.arange(16) % 3)
        loss32, grad32 = step(objective, batch, seed, bf16=False)
        loss16, grad16 = step(objective, batch, seed, bf16=True)
        assert loss16.dtype == torch.float32, "the loss is computed in fp32 under autocast"
        assert torch.isfinite(grad16).all()
        assert abs(loss16 - loss32) <= 0.01 * abs(loss32), (name, seed, float(loss32), float(loss16))
        assert F.cosine_similarity(grad16, grad32, dim=0) >= 0.99, name


def test_targets_stay_fp32_under_autocast(images):
    x = images(4, 32, 1, 0)
    ijepa = OBJECTIVES["stop"]()
    droppos = OBJECTIVES["droppos"]()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ijepa.targets(x).dtype == torch.float32  # LayerNorm'd EMA features: the regression target
        smoothed = droppos.smoothed_targets(torch.arange(16).expand(4, 16), sigma=0.5)
    assert smoothed.dtype == torch.float32 and torch.allclose(smoothed.sum(-1), torch.ones(4, 16))
