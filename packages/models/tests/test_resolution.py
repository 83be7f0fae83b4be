"""Backbone.set_image_size: fine-tuning / exporting at another resolution than pretraining (same patch size)."""

from __future__ import annotations

import pytest
import torch
from timm.layers import resample_abs_pos_embed, resize_rel_pos_bias_table

from patchplace.models import ModelError, create_model
from patchplace.models.pos_embed import sincos_2d


@pytest.mark.parametrize("mode", ["learned", "sincos2d", "relbias2d", "none"])
def test_set_image_size_resamples_the_pe_the_way_timm_does_and_keeps_every_other_weight(mode):
    torch.manual_seed(0)
    model = create_model("vit_micro", pos_embed=mode, num_classes=3).eval()
    for block in model.blocks if mode == "relbias2d" else []:  # non-zero tables, so resizing is visible
        torch.nn.init.normal_(block.rel_pos_bias.relative_position_bias_table)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tables = [b.rel_pos_bias.relative_position_bias_table.detach().clone() for b in model.blocks] \
        if mode == "relbias2d" else []
    assert model.set_image_size(48) == ((8, 8), (12, 12))
    assert model.config.image_hw == (48, 48) and model.num_patches == 144
    assert model(torch.randn(2, 3, 48, 48)).shape == (2, 3)
    with pytest.raises(ModelError, match="expected images"):
        model(torch.randn(2, 3, 32, 32))
    after = model.state_dict()
    if mode == "learned":
        expected = resample_abs_pos_embed(before["pos_table"], new_size=[12, 12], old_size=[8, 8],
                                          num_prefix_tokens=1)
        assert torch.equal(after["pos_table"], expected) and after["pos_table"].shape == (1, 145, 32)
    if mode == "sincos2d":
        assert torch.allclose(model.pos_table[0, 1:], sincos_2d((12, 12), 32).to(model.pos_table.dtype))
    for block, table in zip(model.blocks, tables, strict=False):
        got = block.rel_pos_bias.relative_position_bias_table
        want = resize_rel_pos_bias_table(table, new_window_size=(12, 12), new_bias_shape=tuple(got.shape),
                                         old_window_size=(8, 8))
        assert got.shape == ((2 * 12 - 1) ** 2 + 3, 2) and torch.allclose(got, want)
    unchanged = [k for k in before if "pos_table" not in k and "relative_position" not in k]
    assert unchanged and all(torch.equal(before[k], after[k]) for k in unchanged)


def test_set_image_size_refuses_sides_the_patch_does_not_tile_and_audio():
    model = create_model("vit_micro")
    with pytest.raises(ModelError, match="not divisible by patch_size 4"):
        model.set_image_size(50)
    assert model.config.image_hw == (32, 32), "a refused resize leaves the model as it was"
    with pytest.raises(ModelError, match="image backbones"):
        create_model("audio_mp3").set_image_size(48)
