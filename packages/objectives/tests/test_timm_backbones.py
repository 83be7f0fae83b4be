"""Objectives on a plain timm VisionTransformer: adopted with its parameters shared, so training the objective
trains the timm model in place, with the PE each method needs."""

from __future__ import annotations

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer as TimmViT

from patchplace.models import sincos_2d
from patchplace.objectives import get_method, method_names


def timm_vit(num_classes: int = 10) -> TimmViT:
    return TimmViT(img_size=32, patch_size=4, in_chans=1, num_classes=num_classes, embed_dim=32, depth=2,
                   num_heads=2, fc_norm=False)


@pytest.mark.parametrize("name", method_names("image"))
def test_an_objective_trains_a_timm_vit_in_place(name, tiny_method_config):
    """Every registered image method, on the PE its registration declares."""
    torch.manual_seed(0)
    spec = get_method(name)
    mode = spec.pos_embed
    timm_model = timm_vit()
    before = {k: v.clone() for k, v in timm_model.state_dict().items()}
    model = spec.objective_cls(timm_model, tiny_method_config(spec))
    assert model.backbone.config.pos_embed == mode
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(2):
        images, labels = torch.randn(8, 1, 32, 32), torch.randint(0, 10, (8,))
        out = model((images, labels), progress=step / 2)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        if hasattr(model, "update_target"):
            model.update_target((step + 1) / 2)
    weight = "blocks.0.attn.qkv.weight"
    assert not torch.equal(timm_model.state_dict()[weight], before[weight]), "the timm model itself was trained"
    assert timm_model.blocks[0].attn.qkv.weight is model.backbone.blocks[0].attn.qkv.weight, "shared, not copied"
    if mode == "sincos2d":  # timm holds the fixed table as a frozen pos_embed with the same values
        assert not timm_model.pos_embed.requires_grad
        assert torch.allclose(timm_model.pos_embed[0, 1:], sincos_2d((8, 8), 32))
    if mode == "learned":  # the learned PE is shared too
        assert timm_model.pos_embed is model.backbone.pos_table
    if spec.needs_head:  # classifiers: timm's forward is the trained model's
        model.eval()
        x = torch.randn(4, 1, 32, 32)
        assert torch.allclose(timm_model.eval()(x), model.backbone(x), atol=1e-5)
