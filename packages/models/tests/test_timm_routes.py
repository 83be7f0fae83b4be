"""A checkpoint directory through timm's own loading routes: ``local-dir:``,
``pretrained_cfg_overlay=dict(file=...)`` and ``checkpoint_path=`` give the same outputs as patchplace for every PE
mode timm can express, and fail loudly (never a silently wrong model) for the others."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import timm
import torch
from safetensors import safe_open

from patchplace.models import ModelError, create_model, from_timm, load_pretrained, save_pretrained
from patchplace.models.timm_interop import beit_kwargs, timm_kwargs, timm_layout

ATOL = 1e-5  # float32 summation order (BEiT drops the key bias: exact in math, not bit-exact)


def _trained_like(micro, **overrides):
    """A micro ViT whose every table is non-trivial (zero-initialised biases would hide a dropped tensor)."""
    model = micro(**overrides)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


MODES = [dict(pos_embed="learned"), dict(pos_embed="sincos2d"), dict(pos_embed="none"),
         dict(pos_embed="learned", class_token=False, global_pool="mean"), dict(pos_embed="relbias2d"),
         dict(pos_embed="relbias2d", global_pool="mean"), dict(pos_embed="learned", unknown_pos=True)]


@pytest.mark.parametrize("overrides", MODES, ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_every_timm_route_gives_our_outputs(micro, tmp_path, overrides):
    model = _trained_like(micro, **overrides)
    directory = save_pretrained(model, tmp_path / "ckpt", metadata={"classes": list("abcde")})
    x = torch.randn(3, 3, 16, 16)
    expected = model(x)
    layout = timm_layout(model.config)
    name, kwargs = ("vit_tiny_patch16_224", timm_kwargs) if layout == "timm_vit" else ("beit_base_patch16_224",
                                                                                         beit_kwargs)
    routes = {
        "local-dir": timm.create_model(f"local-dir:{directory}", pretrained=True),
        # num_classes in the overlay: with the registered name's 1000, timm re-initialises the head by design
        "pretrained_cfg_overlay": timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(
            file=str(directory / "model.safetensors"), num_classes=5), **kwargs(model.config)),
        "checkpoint_path": timm.create_model(name, checkpoint_path=str(directory / "model.safetensors"),
                                             **kwargs(model.config)),
    }
    for route, timm_model in routes.items():
        torch.testing.assert_close(timm_model.eval()(x), expected, atol=ATOL, rtol=0, msg=route)
    reloaded, _ = load_pretrained(directory)
    torch.testing.assert_close(reloaded.eval()(x), expected, atol=ATOL, rtol=0)
    if overrides.get("unknown_pos"):  # MJP's unknown PE: not a timm parameter, kept beside the weights
        assert (directory / "extras.safetensors").is_file()
        torch.testing.assert_close(reloaded.unknown_pos_embed, model.unknown_pos_embed, atol=0, rtol=0)


def test_sincos2d_does_not_come_back_as_learned(micro, tmp_path):
    model = micro(pos_embed="sincos2d")
    directory = save_pretrained(model, tmp_path / "ckpt")
    timm_model = timm.create_model(f"local-dir:{directory}", pretrained=True)
    assert from_timm(timm_model).config.pos_embed == "sincos2d"
    assert load_pretrained(directory)[0].config.pos_embed == "sincos2d"
    with torch.no_grad():
        timm_model.pos_embed.add_(0.01)  # trained in timm: now it is a learned table
    assert from_timm(timm_model).config.pos_embed == "learned"


def test_models_timm_cannot_express_fail_loudly(micro, tmp_path):
    for model in (create_model("audio_mp3"), micro(pos_embed="relbias2d", class_token=False, global_pool="mean")):
        directory = save_pretrained(model, tmp_path / model.config.modality)
        assert timm_layout(model.config) == "patchplace"
        with pytest.raises(RuntimeError, match="has_no_timm_equivalent"):
            timm.create_model(f"local-dir:{directory}", pretrained=True)
        with pytest.raises(ModelError, match="no timm"):
            timm_kwargs(model.config)
        with pytest.raises(ModelError, match="no timm Beit equivalent"):
            beit_kwargs(model.config)


def test_checkpoint_is_self_describing_without_config_json(micro, tmp_path):
    model = _trained_like(micro, pos_embed="learned")
    directory = save_pretrained(model, tmp_path / "ckpt", metadata={
        "classes": list("abcde"), "pretrained": str(tmp_path / "somewhere" / "checkpoint"),
        "normalization": {"mean": [0.5] * 3, "std": [0.25] * 3}, "data": {"dataset": "toy", "fingerprint": "f00"},
        "recipe": {"epochs": 2, "lr": 1e-3}, "method": "mp3",
        "paper": "Zhai et al. 2022, Position Prediction as an Effective Pretraining Strategy (MP3)"})
    raw = json.loads((directory / "config.json").read_text())
    assert raw["architecture"] == "vit_base_patch16_224" and raw["num_classes"] == 5
    assert raw["id2label"] == {str(i): c for i, c in enumerate("abcde")} and raw["label_names"] == list("abcde")
    assert raw["pretrained_cfg"]["input_size"] == [3, 16, 16] and raw["pretrained_cfg"]["std"] == [0.25] * 3
    for file in directory.iterdir():
        assert str(tmp_path) not in file.read_text(errors="ignore"), f"absolute local path inside {file.name}"
    card = (directory / "README.md").read_text()
    assert card.startswith("---\nlicense: apache-2.0\nlibrary_name: patchplace") and "Position Prediction" in card
    assert "f00" in card
    assert "| epochs | 2 |" in card and "Not recorded in this checkpoint (written before its evaluation)" in card
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["backbone"]) == model.config.to_dict()
    (directory / "config.json").unlink()
    reloaded, metadata = load_pretrained(directory)
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(reloaded.eval()(x), model(x), atol=0, rtol=0)
    assert metadata == {}


def test_hub_mixin_save_load_and_push(micro, tmp_path, monkeypatch):
    """``save_pretrained`` / ``from_pretrained`` / ``push_to_hub`` (huggingface_hub's mixin) in our format; the Hub
    itself is replaced by a recorder (no network in tests)."""
    import huggingface_hub

    from patchplace.models import Backbone, VisionTransformer

    model = _trained_like(micro, pos_embed="sincos2d")
    paper = "He et al. 2022, Masked Autoencoders Are Scalable Vision Learners"
    out = model.save_pretrained(tmp_path / "ckpt", metadata={"classes": list("abcde"), "method": "mae", "paper": paper})
    assert out == tmp_path / "ckpt"
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    loaded = Backbone.from_pretrained(tmp_path / "ckpt")
    assert isinstance(loaded, VisionTransformer) and loaded.pretrained_metadata["method"] == "mae"
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(loaded.eval()(x), model(x), atol=0, rtol=0)
    assert "Masked Autoencoders" in (out / "README.md").read_text(), "our card, not the mixin's template"

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: str(tmp_path / "ckpt"))
    monkeypatch.setattr(huggingface_hub.hub_mixin, "hf_hub_download",
                        lambda repo_id, filename, **kw: str(tmp_path / "ckpt" / filename))
    assert Backbone.from_pretrained("someone/patchplace-mae").pretrained_metadata["method"] == "mae"

    uploaded = {}

    class FakeApi:
        def __init__(self, *a, **kw):
            pass

        def create_repo(self, repo_id, **kw):
            return type("Url", (), {"repo_id": repo_id})()

        def upload_folder(self, repo_id, folder_path, **kw):
            uploaded.update({p.name: p.read_bytes() for p in Path(folder_path).iterdir()}, repo=repo_id)
            return "https://huggingface.co/someone/patchplace-mae/commit/0"

    monkeypatch.setattr(huggingface_hub.hub_mixin, "HfApi", FakeApi)
    assert loaded.push_to_hub("someone/patchplace-mae").endswith("/commit/0")
    assert uploaded["repo"] == "someone/patchplace-mae"
    assert uploaded["config.json"] == (out / "config.json").read_bytes()
    from safetensors.torch import load as load_bytes

    sent, saved = load_bytes(uploaded["model.safetensors"]), load_bytes((out / "model.safetensors").read_bytes())
    assert sent.keys() == saved.keys() and all(torch.equal(sent[k], saved[k]) for k in sent)
    with pytest.raises(ModelError, match="not a AudioTransformer"):
        from patchplace.models import AudioTransformer

        AudioTransformer.from_pretrained(tmp_path / "ckpt")
