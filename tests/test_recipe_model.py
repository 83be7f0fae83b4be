"""The model side of the papers' ImageNet recipes through the real pipelines: MAE's / DropPos's fine-tuning pool
(``finetune.global_pool=mean_fc_norm``: the mean of the patch tokens through a fresh LayerNorm, the final norm
dropped — "Masked Autoencoders Are Scalable Vision Learners", arXiv:2111.06377, models_vit.py) written to the
checkpoint and exported to ONNX; a learned PE started from the fixed 2-D sin-cos table (MAE's main_finetune); and
drop path in pretraining (MP3's ImageNet recipe keeps DeiT's 0.1, docs/design.md §5b)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pipeline_args import TINY, img, method_args
from timm.layers import DropPath
from torch import nn

from patchplace.models import create_model, load_pretrained, save_pretrained, sincos_2d
from patchplace.pipelines import config as pipeline_config
from patchplace.pipelines import finetune, pretrain

FT_CONFIG = str(Path(__file__).resolve().parents[1] / "pipelines" / "configs" / "finetune_fashion_mnist.yaml")
NO_MIX = ["finetune.mixup=0", "finetune.cutmix=0"]


@pytest.fixture(scope="module")
def mae_checkpoint(tmp_path_factory):
    """A pretraining checkpoint as MAE's leaves it: fixed sin-cos PE, a final norm, ``finetune_pool`` mean."""
    torch.manual_seed(0)
    model = create_model("vit_micro", in_chans=1, pos_embed="sincos2d")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # trained-like: LayerNorm ones / zeros would hide a swapped norm
    metadata = {"method": "mae", "finetune_pool": "mean", "probe_feature": "cls"}
    return save_pretrained(model, tmp_path_factory.mktemp("mae") / "checkpoint", metadata=metadata)


def _backbone(shards, *overrides):
    cfg = pipeline_config.load(finetune.FinetuneConfig, FT_CONFIG, [*img(shards), *TINY, *overrides])
    torch.manual_seed(0)
    return finetune.build_backbone(cfg, 3, 1, "image")[0]


# ---------------------------------------------------------------------------------------------- fc_norm pooling
def test_mean_fc_norm_drops_the_final_norm_and_adds_a_fresh_fc_norm(shards, mae_checkpoint):
    pretrained, _ = load_pretrained(mae_checkpoint)
    backbone = _backbone(shards, f"model.checkpoint={mae_checkpoint}", "finetune.global_pool=mean_fc_norm")
    c = backbone.config
    assert (c.global_pool, c.fc_norm) == ("mean", True)
    assert isinstance(backbone.norm, nn.Identity) and isinstance(backbone.fc_norm, nn.LayerNorm)
    assert torch.equal(backbone.fc_norm.weight, torch.ones(c.embed_dim))  # fresh, as MAE's
    assert torch.equal(backbone.fc_norm.bias, torch.zeros(c.embed_dim))
    kept = pretrained.state_dict()
    assert all(torch.equal(v, kept[k]) for k, v in backbone.state_dict().items() if k.startswith("blocks."))
    plain = _backbone(shards, f"model.checkpoint={mae_checkpoint}")  # null: the checkpoint's own pooling (mean)
    assert (plain.config.global_pool, plain.config.fc_norm) == ("mean", False)
    assert torch.equal(plain.norm.weight, pretrained.norm.weight)


def test_fc_norm_finetune_is_saved_reloaded_kept_and_exported(shards, mae_checkpoint, tmp_path, capsys):
    from patchplace.export import export_checkpoint

    out = tmp_path / "ft"
    assert finetune.main(["--config", FT_CONFIG, *img(shards), *TINY, *NO_MIX, "optim.max_steps=1",
                          "finetune.global_pool=mean_fc_norm", f"model.checkpoint={mae_checkpoint}",
                          f"run.output={out}"]) == 0
    written = json.loads((out / "checkpoint" / "config.json").read_text())
    assert written["backbone"]["fc_norm"] is True and written["model_args"]["fc_norm"] is True
    backbone, metadata = load_pretrained(out / "checkpoint")
    assert backbone.config.fc_norm and isinstance(backbone.norm, nn.Identity)
    pool, _ = finetune.finetune_pool(None, backbone, metadata, True)
    assert pool == "mean_fc_norm", "fine-tuning the fine-tuned checkpoint again keeps its trained fc_norm"
    sidecar = export_checkpoint(out / "checkpoint", tmp_path / "onnx" / "model.onnx")
    assert sidecar["backbone"]["fc_norm"] is True
    assert max(sidecar["parity"]["max_abs_diff"].values()) <= 1e-4


# ---------------------------------------------------------------------------------------------- PE start
def test_a_learned_pe_starts_from_the_sincos_table_and_trains(shards, mae_checkpoint):
    backbone = _backbone(shards, f"model.checkpoint={mae_checkpoint}", "finetune.pos_embed=learned",
                         "finetune.pos_embed_init=sincos2d")
    table = backbone.pos_table
    assert isinstance(table, nn.Parameter) and table.requires_grad
    expected = torch.cat([torch.zeros(1, backbone.embed_dim), sincos_2d(backbone.grid, backbone.embed_dim)])
    assert torch.equal(table.detach()[0], expected), "step 0: the fixed 2-D sin-cos values, CLS row 0 (as MAE)"
    backbone.train()
    backbone(torch.randn(4, 1, 32, 32)).logsumexp(-1).sum().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0
    from_checkpoint = _backbone(shards, f"model.checkpoint={mae_checkpoint}", "finetune.pos_embed=learned",
                                "finetune.pos_embed_init=checkpoint")
    assert torch.equal(from_checkpoint.pos_table.detach()[0], expected)  # the checkpoint's table is sin-cos


def test_pe_start_defaults_and_refusals(shards, mae_checkpoint, tmp_path):
    random = _backbone(shards, f"model.checkpoint={mae_checkpoint}", "finetune.pos_embed=learned")
    assert random.pos_table.detach().std() < 0.05, "default: trunc-normal .02"
    fixed = _backbone(shards, f"model.checkpoint={mae_checkpoint}", "finetune.pos_embed=sincos2d")  # DropPos's
    assert not isinstance(fixed.pos_table, nn.Parameter) and "pos_table" not in dict(fixed.named_parameters())
    with pytest.raises(pipeline_config.ConfigError, match=r"pos_embed_init=sincos2d starts a learned PE"):
        pipeline_config.load(finetune.FinetuneConfig, FT_CONFIG, [*img(shards), "finetune.pos_embed=sincos2d",
                                                                  "finetune.pos_embed_init=sincos2d"])
    with pytest.raises(pipeline_config.ConfigError, match=r"finetune\.pos_embed_init must be one of"):
        pipeline_config.load(finetune.FinetuneConfig, FT_CONFIG, [*img(shards), "finetune.pos_embed_init=zeros"])
    no_pe = save_pretrained(create_model("vit_micro", in_chans=1, pos_embed="none"), tmp_path / "mp3",
                            metadata={"method": "mp3", "finetune_pool": "cls"})
    with pytest.raises(pipeline_config.ConfigError, match="no additive PE table"):
        _backbone(shards, f"model.checkpoint={no_pe}", "finetune.pos_embed_init=checkpoint")


# ---------------------------------------------------------------------------------------------- drop path
def test_pretraining_sets_drop_path_with_the_linear_rule(shards):
    cfg = pipeline_config.load(pretrain.PretrainConfig, None,
                               [*method_args(shards, "mp3"), "model.overrides={drop_path_rate: 0.1}"])
    _, backbone = pretrain.build_objective(cfg, 3, 1, "image")
    expected = torch.linspace(0, 0.1, len(backbone.blocks)).tolist()
    for block, rate in zip(backbone.blocks, expected, strict=True):
        for branch in (block.drop_path1, block.drop_path2):
            if rate == 0:
                assert isinstance(branch, nn.Identity)
            else:
                assert isinstance(branch, DropPath) and branch.drop_prob == pytest.approx(rate)
    assert backbone.config.drop_path_rate == 0.1
