"""Decoder / predictor width, depth and heads are set explicitly and independently of the backbone: a config that
asks for a 512-wide, 8-deep, 16-head decoder gets exactly that on any backbone, and the built modules' shapes say
so; inconsistent values are refused in one line; the authors' predictor sizes of I-JEPA and StoP; RandSAC's
ImageNet-1K hierarchy 11 -> 7 -> 3 with its 4 x 512 x 16 decoder ("Self-supervision through Random Segments with
Autoregressive Coding (RandSAC)", arXiv:2203.12054, §5 / Tables 14-16)."""

from __future__ import annotations

import pytest
import torch

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
from patchplace.objectives.common import TransformerDecoder

WIDE = {"dim": 64, "depth": 3, "heads": 16}  # wider, and with more heads, than the 32-wide, 2-head backbone


def _decoder_shapes(decoder: TransformerDecoder) -> tuple[int, int, int, int]:
    """(input width, width, depth, heads) of a decoder / predictor built from the backbone's blocks."""
    heads = {block.attn.num_heads for block in decoder.blocks}
    assert len(heads) == 1
    return decoder.embed.in_features, decoder.embed.out_features, len(decoder.blocks), heads.pop()


@pytest.mark.parametrize(("cls", "config_cls"), [(MAE, MAEConfig), (DropPos, DropPosConfig)])
def test_mae_and_droppos_decoders_are_what_the_config_says(micro, cls, config_cls):
    backbone = micro(pos_embed="sincos2d")
    model = cls(backbone, config_cls(decoder_dim=WIDE["dim"], decoder_depth=WIDE["depth"],
                                     decoder_heads=WIDE["heads"]))
    assert (model.config.decoder_dim, model.config.decoder_depth, model.config.decoder_heads) == tuple(WIDE.values())
    assert _decoder_shapes(model.decoder) == (32, WIDE["dim"], WIDE["depth"], WIDE["heads"])
    assert model.decoder.blocks[0].mlp.fc1.out_features == 4 * WIDE["dim"]
    if cls is MAE:
        assert model.mask_token.shape == (1, 1, WIDE["dim"]) and model.decoder_pred.in_features == WIDE["dim"]
        assert model.decoder_pos.shape == (1, 1 + backbone.num_patches, WIDE["dim"])
    else:
        assert (model.head.in_features, model.head.out_features) == (WIDE["dim"], backbone.num_patches)


@pytest.mark.parametrize("stop", [False, True])
def test_ijepa_and_stop_predictors_are_what_the_config_says(micro, stop):
    backbone = micro(pos_embed="sincos2d")
    model = IJEPA(backbone, IJEPAConfig(stop=stop, predictor_dim=WIDE["dim"], predictor_depth=WIDE["depth"],
                                        predictor_heads=WIDE["heads"], min_keep=2))
    assert _decoder_shapes(model.predictor) == (32, WIDE["dim"], WIDE["depth"], WIDE["heads"])
    assert (model.predictor_proj.in_features, model.predictor_proj.out_features) == (WIDE["dim"], 32)
    assert model.predictor_pos.shape == (1, backbone.num_patches, WIDE["dim"])
    assert (model.mask_token is None) == stop


def test_randsac_decoder_is_what_the_config_says(micro):
    backbone = micro(pos_embed="sincos2d")
    model = RandSAC(backbone, RandSACConfig(decoder_dim=WIDE["dim"], decoder_depth=WIDE["depth"],
                                            decoder_heads=WIDE["heads"], num_segments=4, hierarchy=(2,)))
    assert len(model.decoder_blocks) == WIDE["depth"]
    for block in model.decoder_blocks:
        assert (block.attn.num_heads, block.cross_attn.num_heads) == (WIDE["heads"], WIDE["heads"])
        assert block.attn.qkv.in_features == WIDE["dim"]
    assert (model.decoder_embed.in_features, model.decoder_embed.out_features) == (32, WIDE["dim"])
    assert model.skip_weight.shape == (len(backbone.blocks), WIDE["depth"])
    assert model.decoder_pos.shape == (1, backbone.num_patches, WIDE["dim"])


@pytest.mark.parametrize(("config_cls", "part"), [(MAEConfig, "decoder"), (DropPosConfig, "decoder"),
                                                  (RandSACConfig, "decoder"), (IJEPAConfig, "predictor")])
def test_each_field_is_independent_and_defaults_still_follow_the_backbone(micro, config_cls, part):
    backbone = micro(pos_embed="sincos2d")
    only_heads = config_cls(**{f"{part}_heads": 8}).for_backbone(backbone)  # the width still follows the backbone
    assert (getattr(only_heads, f"{part}_dim"), getattr(only_heads, f"{part}_heads")) == (
        16 if part == "predictor" else 32, 8)
    only_dim = config_cls(**{f"{part}_dim": 48}).for_backbone(backbone)  # the heads still follow the backbone
    assert (getattr(only_dim, f"{part}_dim"), getattr(only_dim, f"{part}_heads")) == (48, 2)
    default = config_cls().for_backbone(backbone)  # the defaults, unchanged
    assert (getattr(default, f"{part}_dim"), getattr(default, f"{part}_heads")) == (
        16 if part == "predictor" else 32, 2)


def test_inconsistent_widths_are_refused_in_one_line(micro):
    with pytest.raises(ObjectiveError, match=r"^decoder_dim 512 must be divisible by decoder_heads 12$"):
        MAEConfig(decoder_dim=512, decoder_heads=12).validate()
    backbone = micro(pos_embed="sincos2d", embed_dim=36, num_heads=3)
    with pytest.raises(ObjectiveError) as caught:  # heads left null: the backbone's 3, which 512 does not fit
        MAE(backbone, MAEConfig(decoder_dim=512))
    message = str(caught.value)
    assert "\n" not in message and "decoder_heads=3 taken from the backbone" in message
    with pytest.raises(ObjectiveError, match="predictor_heads must be > 0"):
        IJEPAConfig(predictor_heads=0).validate()


def test_the_authors_predictors_of_ijepa_and_stop():
    """I-JEPA's in1k_vith14_ep300.yaml: pred_depth 12, pred_emb_dim 384; StoP's configs/pretrain/vit-b16.yaml:
    pred_depth 6, emb_dim 384; both codes give the predictor the encoder's heads (None: the backbone's)."""
    ijepa, stop = IJEPAConfig.paper(), IJEPAConfig.paper(stop=True)
    assert (ijepa.predictor_dim, ijepa.predictor_depth, ijepa.predictor_heads) == (384, 12, None)
    assert (stop.predictor_dim, stop.predictor_depth, stop.predictor_heads, stop.stop) == (384, 6, None, True)


def test_randsac_imagenet_hierarchy_with_the_papers_decoder(micro):
    """11 blobs -> 7 -> 3 partitions, decoder 4 x 512 x 16 (§5): builds, ranks every sample's tokens into at most 11
    segments and trains a step (that the partitions stay contiguous in the order: test_randsac.py)."""
    config = RandSACConfig.paper(hierarchy=(7, 3))
    assert (config.num_segments, config.hierarchy, config.decoder_dim, config.decoder_depth,
            config.decoder_heads) == (11, (7, 3), 512, 4, 16)
    backbone = micro(pos_embed="sincos2d", img_size=32)  # an 8 x 8 grid: room for 11 blobs
    model = RandSAC(backbone, config)
    assert len(model.decoder_blocks) == 4 and model.decoder_blocks[0].attn.num_heads == 16
    assert model.decoder_embed.out_features == 512
    order = model.make_order(4, torch.Generator().manual_seed(0))
    assert order.shape == (4, backbone.num_patches) and int(order.max()) <= 10
    out = model(torch.randn(2, 1, 32, 32), progress=0.0, generator=torch.Generator().manual_seed(0))
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and model.decoder_blocks[-1].mlp.fc2.weight.grad is not None
