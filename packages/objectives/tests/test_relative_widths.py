"""Decoder / predictor widths default to the backbone's (a small backbone gets a small decoder); the papers' widths
are ``Config.paper()``. The MAE case of the issue: ``MAEConfig()`` on a 28K-parameter backbone built a 25.3M
parameter decoder and its loss diverged at lr 1e-3."""

from __future__ import annotations

import pytest
import torch

from patchplace.models import create_model
from patchplace.objectives import (
    IJEPA,
    MAE,
    DropPos,
    DropPosConfig,
    IJEPAConfig,
    MAEConfig,
    ObjectiveError,
    RandSAC,
    RandSACConfig,
)

# I-JEPA's predictor heads: the encoder's (None), as its code builds it
CASES = [(MAE, MAEConfig, "decoder", (512, 8, 16)), (DropPos, DropPosConfig, "decoder", (512, 2, 16)),
         (RandSAC, RandSACConfig, "decoder", (512, 4, 16)), (IJEPA, IJEPAConfig, "predictor", (384, 12, None))]


@pytest.mark.parametrize(("cls", "config_cls", "part", "paper"), CASES)
def test_widths_follow_the_backbone_and_paper_is_one_call_away(cls, config_cls, part, paper):
    backbone = create_model("vit_micro", in_chans=1, pos_embed="sincos2d")  # 32 wide, 2 heads
    model = cls(backbone, config_cls())
    dim, depth, heads = (getattr(model.config, f"{part}_{k}") for k in ("dim", "depth", "heads"))
    assert (dim, heads) == ((16, 2) if part == "predictor" else (32, 2)), "relative to the backbone, recorded"
    assert (dim, depth, heads) != paper and tuple(getattr(config_cls.paper(), f"{part}_{k}")
                                                  for k in ("dim", "depth", "heads")) == paper
    shallow = config_cls.paper(**{f"{part}_depth": 1})  # overrides on top of the paper's widths
    assert (getattr(shallow, f"{part}_dim"), getattr(shallow, f"{part}_depth")) == (paper[0], 1)
    with pytest.raises(ObjectiveError, match="divisible"):
        config_cls(**{f"{part}_dim": 30, f"{part}_heads": 4}).validate()


def test_mae_defaults_on_a_tiny_backbone_stay_small_and_learn():
    torch.manual_seed(0)
    backbone = create_model("vit_micro", in_chans=1, pos_embed="sincos2d")
    model = MAE(backbone, MAEConfig())
    backbone_params = sum(p.numel() for p in backbone.parameters())
    decoder_params = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("backbone."))
    assert decoder_params < 5 * backbone_params, (decoder_params, backbone_params)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    images = torch.rand(16, 1, 32, 32)  # one batch, fitted: the loss must fall, not diverge
    losses = []
    for step in range(30):
        loss = model(images, progress=step / 30, generator=torch.Generator().manual_seed(step % 2))["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], f"MAE, default widths, did not learn: {losses[0]:.3f} -> {losses[-1]:.3f}"
