"""``fc_norm`` pooling: the final norm moved after the pooling, as timm's ``VisionTransformer(global_pool='avg',
fc_norm=True)`` and MAE's fine-tuning with ``--global_pool`` ("Masked Autoencoders Are Scalable Vision Learners",
arXiv:2111.06377, models_vit.py). Parity with timm both ways and through timm's own loading routes, the checkpoint
round trip, and the switch of a pretrained backbone (fresh ``fc_norm``, final norm dropped)."""

from __future__ import annotations

import json

import pytest
import timm
import torch
from timm.models.beit import Beit
from timm.models.vision_transformer import VisionTransformer as TimmViT
from torch import nn

from patchplace.models import BackboneConfig, ModelError, from_timm, load_pretrained, save_pretrained
from patchplace.models.timm_interop import beit_kwargs, timm_kwargs, to_timm_state_dict

ATOL = 1e-5  # float32 summation order


def _perturbed(model: nn.Module) -> nn.Module:
    """Every weight non-trivial (LayerNorm's ones / zeros would hide a norm applied in the wrong place)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _timm_fc_norm(**extra) -> TimmViT:
    torch.manual_seed(0)
    args = dict(img_size=32, patch_size=4, in_chans=3, num_classes=7, embed_dim=48, depth=2, num_heads=3,
                global_pool="avg", fc_norm=True)
    return _perturbed(TimmViT(**{**args, **extra})).eval()


@pytest.mark.parametrize("class_token", [True, False])
def test_timm_fc_norm_weights_give_the_same_features_and_logits(class_token):
    reference = _timm_fc_norm(class_token=class_token)
    assert isinstance(reference.norm, nn.Identity) and isinstance(reference.fc_norm, nn.LayerNorm)
    ours = from_timm(reference).eval()
    assert ours.config.fc_norm and ours.config.global_pool == "mean"
    assert isinstance(ours.norm, nn.Identity) and isinstance(ours.fc_norm, nn.LayerNorm)
    x = torch.randn(3, 3, 32, 32)
    torch.testing.assert_close(ours.forward_features(x), reference.forward_features(x), atol=ATOL, rtol=0)
    torch.testing.assert_close(ours.forward_head(ours.forward_features(x), pre_logits=True),
                               reference.forward_head(reference.forward_features(x), pre_logits=True),
                               atol=ATOL, rtol=0)
    torch.testing.assert_close(ours(x), reference(x), atol=ATOL, rtol=0)


@pytest.mark.parametrize("overrides", [dict(pos_embed="learned", global_pool="mean"),
                                       dict(pos_embed="sincos2d", global_pool="mean"),
                                       dict(pos_embed="learned", global_pool="cls")], ids=str)
def test_our_fc_norm_backbone_loads_strictly_into_timm(micro, overrides):
    model = _perturbed(micro(fc_norm=True, **overrides))
    assert timm_kwargs(model.config)["fc_norm"] is True
    reference = TimmViT(**timm_kwargs(model.config)).eval()
    reference.load_state_dict(to_timm_state_dict(model), strict=True)
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(reference(x), model(x), atol=ATOL, rtol=0)


def test_relbias2d_fc_norm_maps_onto_beit_use_fc_norm(micro):
    model = _perturbed(micro(fc_norm=True, pos_embed="relbias2d", global_pool="mean"))
    reference = Beit(**beit_kwargs(model.config)).eval()
    reference.load_state_dict(to_timm_state_dict(model), strict=True)
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(reference(x), model(x), atol=ATOL, rtol=0)


def test_checkpoint_round_trip_and_timm_local_dir(micro, tmp_path):
    model = _perturbed(micro(fc_norm=True, global_pool="mean"))
    directory = save_pretrained(model, tmp_path / "ckpt", metadata={"classes": list("abcde")})
    raw = json.loads((directory / "config.json").read_text())
    assert raw["backbone"]["fc_norm"] is True and raw["model_args"]["fc_norm"] is True
    x = torch.randn(3, 3, 16, 16)
    reloaded, _ = load_pretrained(directory)
    assert reloaded.config.fc_norm and isinstance(reloaded.norm, nn.Identity)
    torch.testing.assert_close(reloaded.eval()(x), model(x), atol=0, rtol=0)
    timm_model = timm.create_model(f"local-dir:{directory}", pretrained=True).eval()
    torch.testing.assert_close(timm_model(x), model(x), atol=ATOL, rtol=0)


def test_a_default_config_is_written_as_before(micro):
    """``fc_norm`` is written only when set: a backbone without it has the config.json of earlier versions (and
    loads in them), and an old config.json without the field loads with the final norm."""
    saved = micro().config.to_dict()
    assert "fc_norm" not in saved
    assert not BackboneConfig.from_dict(saved).fc_norm
    assert BackboneConfig.from_dict({**saved, "fc_norm": True}).fc_norm
    with pytest.raises(ModelError, match="fc_norm must be true or false"):
        BackboneConfig(fc_norm="yes").validate()


def test_switching_a_pretrained_backbone_follows_mae_finetune(micro):
    """MAE's models_vit.py with --global_pool: a new fc_norm (LayerNorm init), the final norm deleted, every other
    weight kept; the pooled feature is fc_norm(mean of the block outputs)."""
    model = _perturbed(micro(global_pool="mean"))
    blocks = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("blocks.")}
    model.set_fc_norm(True)
    assert model.config.fc_norm and isinstance(model.norm, nn.Identity)
    assert torch.equal(model.fc_norm.weight, torch.ones(32)) and torch.equal(model.fc_norm.bias, torch.zeros(32))
    assert not any(k.startswith("norm.") for k in model.state_dict())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in blocks.items())
    x = torch.randn(2, 3, 16, 16)
    h = model.embed(x)
    for block in model.blocks:
        h = block(h)
    expected = nn.functional.layer_norm(h[:, 1:].mean(1), (32,), eps=1e-6)
    torch.testing.assert_close(model.forward_head(model.forward_features(x), pre_logits=True), expected)
    model.set_fc_norm(False)  # and back: a fresh final norm before the pooling
    assert not model.config.fc_norm and isinstance(model.fc_norm, nn.Identity)
    assert torch.equal(model.norm.weight, torch.ones(32))
