"""Checkpoints (safetensors, atomic, never unpickled) and timm interop (identical outputs)."""

from __future__ import annotations

import json
import pickle

import pytest
import timm
import torch
from timm.models.vision_transformer import VisionTransformer as TimmViT

from patchplace.models import (
    ModelError,
    create_model,
    from_timm,
    load_pretrained,
    save_pretrained,
    timm_kwargs,
    to_timm_state_dict,
)
from patchplace.models.hub import update_metadata


@pytest.mark.parametrize("mode", ["none", "learned", "sincos2d", "relbias2d"])
def test_save_load_round_trip_is_exact(micro, tmp_path, mode):
    model = micro(pos_embed=mode)
    if mode == "relbias2d":
        torch.nn.init.normal_(model.blocks[1].rel_pos_bias.relative_position_bias_table)
    x = torch.randn(2, 3, 16, 16)
    save_pretrained(model, tmp_path / "ckpt", metadata={"classes": ["a", "b"], "data": "abc123"})
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["README.md", "config.json", "model.safetensors"]
    loaded, metadata = load_pretrained(tmp_path / "ckpt")
    assert metadata == {"classes": ["a", "b"], "data": "abc123"} and loaded.config == model.config
    torch.testing.assert_close(loaded.eval()(x), model(x), atol=0, rtol=0)


def test_update_metadata_adds_metrics_to_config_and_card_and_keeps_the_weights(micro, tmp_path):
    model = micro(pos_embed="learned")
    save_pretrained(model, tmp_path / "ckpt", metadata={"method": "mp3"})
    weights = (tmp_path / "ckpt" / "model.safetensors").read_bytes()
    card = (tmp_path / "ckpt" / "README.md").read_text()
    assert "Not recorded in this checkpoint (written before its evaluation)." in card
    update_metadata(tmp_path / "ckpt", metrics={"top1": 0.875})
    raw = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert raw["metadata"] == {"method": "mp3", "metrics": {"top1": 0.875}}
    card = (tmp_path / "ckpt" / "README.md").read_text()
    params = sum(p.numel() for p in model.parameters())
    assert "| top1 | 0.875 | not recorded |" in card and f"{params / 1e6:.2f}M parameters" in card, card
    assert (tmp_path / "ckpt" / "model.safetensors").read_bytes() == weights
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["README.md", "config.json", "model.safetensors"]
    loaded, metadata = load_pretrained(tmp_path / "ckpt")
    assert metadata["metrics"] == {"top1": 0.875} and loaded.config == model.config


def test_audio_round_trip_and_overwrite(tmp_path):
    model = create_model("audio_mp3").eval()
    model.save_pretrained(tmp_path / "ckpt")
    save_pretrained(model, tmp_path / "ckpt")  # replacing an existing checkpoint works
    loaded, _ = load_pretrained(tmp_path / "ckpt")
    x = torch.randn(2, 101, 40)
    torch.testing.assert_close(loaded.eval()(x), model(x), atol=0, rtol=0)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"], "no temp dirs left behind"


def test_pickles_are_refused_and_bad_configs_explained(micro, tmp_path):
    model = micro()
    torch.save(model.state_dict(), tmp_path / "model.pth")
    with pytest.raises(ModelError, match=r"refusing to load .*model.pth: pickle checkpoints"):
        load_pretrained(tmp_path / "model.pth")
    with pytest.raises(ModelError, match="refusing to load"):
        load_pretrained(tmp_path)
    (tmp_path / "evil.pt").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(ModelError, match="refusing"):
        load_pretrained(tmp_path / "evil.pt")
    save_pretrained(model, tmp_path / "ok")
    raw = json.loads((tmp_path / "ok" / "config.json").read_text())
    raw["backbone"]["depht"] = 3
    (tmp_path / "ok" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelError, match=r"unknown backbone config field\(s\) \['depht'\]"):
        load_pretrained(tmp_path / "ok")
    with pytest.raises(ModelError, match=r"no config\.json"):
        load_pretrained(tmp_path / "nowhere")


# Outputs agree up to float32 summation order: measured <= 2e-6 on these models.
TIMM_ATOL = 1e-5


@pytest.mark.parametrize("pool", ["token", "avg"])
def test_timm_weights_load_with_identical_outputs(pool):
    torch.manual_seed(0)
    reference = TimmViT(img_size=32, patch_size=4, in_chans=3, num_classes=7, embed_dim=48, depth=2, num_heads=3,
                        global_pool=pool, fc_norm=False).eval()
    x = torch.randn(3, 3, 32, 32)
    ours = from_timm(reference).eval()
    torch.testing.assert_close(ours(x), reference(x), atol=TIMM_ATOL, rtol=0)
    assert ours.config.global_pool == ("cls" if pool == "token" else "mean")


@pytest.mark.parametrize("mode", ["learned", "sincos2d", "none"])
def test_our_weights_load_into_timm_with_identical_outputs(micro, mode):
    model = micro(pos_embed=mode)
    reference = TimmViT(**timm_kwargs(model.config)).eval()
    reference.load_state_dict(to_timm_state_dict(model), strict=True)
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(reference(x), model(x), atol=TIMM_ATOL, rtol=0)


def test_timm_registry_names_and_refusals():
    torch.manual_seed(0)
    reference = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3).eval()
    ours = from_timm(reference).eval()
    assert ours.config.embed_dim == 192 and ours.config.depth == 12 and ours.grid == (14, 14)
    x = torch.randn(1, 3, 224, 224)
    torch.testing.assert_close(ours(x), reference(x), atol=TIMM_ATOL, rtol=0)
    with pytest.raises(ModelError, match="0 final norms"):  # fc_norm is supported (test_fc_norm.py); no norm is not
        from_timm(TimmViT(img_size=32, patch_size=4, embed_dim=48, depth=1, num_heads=3, final_norm=False))
    with pytest.raises(ModelError, match="LayerScale"):
        from_timm(TimmViT(img_size=32, patch_size=4, embed_dim=48, depth=1, num_heads=3, init_values=0.1))
    with pytest.raises(ModelError, match="no timm VisionTransformer equivalent"):
        timm_kwargs(create_model("vit_micro", pos_embed="relbias2d").config)
