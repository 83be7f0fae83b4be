"""The harness around the methods, through the real pipelines: the optimizer each run really builds (layer decay,
weight decay), the feature each checkpoint's probes read, and every recipe knob having its effect."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from pipeline_args import TINY, audio, img, method_args, state_dir

from patchplace.finetune import extract_features, probe_feature_of
from patchplace.models import load_pretrained
from patchplace.objectives import get_method, method_names
from patchplace.pipelines import config as pipeline_config
from patchplace.pipelines import (
    finetune,
    pretrain,
)

ROOT = Path(__file__).resolve().parents[1]

FT_CONFIG = str(ROOT / "pipelines" / "configs" / "finetune_fashion_mnist.yaml")
# What must never be weight-decayed (docs/design.md): PE tables, class / mask / unknown tokens, relative bias tables;
# timm adds every 1-D tensor (norms, biases).
NO_DECAY = ("cls_token", "pos_table", "unknown_pos_embed", "mask_token", "mask_pos_token",
            "relative_position_bias_table")
# The tokens each objective adds and must exempt (beside the backbone's).
OWN_TOKENS = {"mae": "mask_token", "ijepa": "mask_token", "droppos": "mask_pos_token",
              "mjp": "backbone.unknown_pos_embed"}
def optimizer_state(run: Path) -> dict:
    """The optimizer state Accelerate saved (param groups with their lr / initial_lr / lr_scale / weight_decay)."""
    return torch.load(state_dir(run) / "optimizer.bin", weights_only=False)


# ---------------------------------------------------------------------------------------------- optimizer
@pytest.mark.parametrize("method", method_names())
def test_pretraining_never_decays_pes_tokens_norms_or_biases(shards, tmp_path, method):
    out = tmp_path / method
    assert pretrain.main([*method_args(shards, method), "optim.max_steps=1", f"run.output={out}"]) == 0
    written = json.loads((out / "optimizer.json").read_text())
    params = written["parameters"]
    assert params, "optimizer.json lists every trained parameter"
    for name, p in params.items():
        exempt = len(p["shape"]) <= 1 or name.split(".")[-1] in NO_DECAY
        assert p["weight_decay"] == (0.0 if exempt else written["weight_decay"]), (name, p)
        assert p["lr_scale"] == 1.0, "no layer decay in pretraining unless asked"
    assert params["backbone.patch_embed.proj.weight"]["weight_decay"] == 0.05  # something is decayed
    if method in OWN_TOKENS:
        assert params[OWN_TOKENS[method]]["weight_decay"] == 0.0
    if "backbone.cls_token" in params:
        assert params["backbone.cls_token"]["weight_decay"] == 0.0
    assert not any(n.startswith("target_encoder.") for n in params), "the EMA target encoder is not optimized"
    groups = optimizer_state(out)["param_groups"]
    assert sorted(i for g in groups for i in g["params"]) == list(range(len(params)))


def test_finetuning_applies_layer_decay_to_the_learning_rate_of_every_block(shards, tmp_path):
    """The shipped fine-tuning recipe (layer_decay 0.75): block i trains at lr 0.75^(L - i), the embeddings at
    0.75^(L + 1), the final norm and the head at 1 — in the groups the optimizer holds and in the lr it stepped."""
    assert pretrain.main(["method=mp3", *img(shards), *TINY, "optim.max_steps=1",
                          f"run.output={tmp_path / 'pre'}"]) == 0
    out = tmp_path / "ft"
    assert finetune.main(["--config", FT_CONFIG, *img(shards), *TINY, "optim.max_steps=3",
                          f"model.checkpoint={tmp_path / 'pre' / 'checkpoint'}", "finetune.pos_embed=relbias2d",
                          "optim.warmup_fraction=0.0", f"run.output={out}"]) == 0
    written = json.loads((out / "optimizer.json").read_text())
    params, depth = written["parameters"], 2  # vit_micro
    assert written["layer_decay"] == 0.75
    for name, p in params.items():
        if name.startswith("backbone.blocks."):
            i = int(name.split(".")[2])
            expected = 0.75 ** (depth - i)
        elif name.startswith(("backbone.patch_embed", "backbone.cls_token", "backbone.pos_table")):
            expected = 0.75 ** (depth + 1)
        else:
            assert name.startswith(("backbone.norm", "backbone.head")), name
            expected = 1.0
        assert p["lr_scale"] == pytest.approx(expected), (name, p)
        exempt = len(p["shape"]) <= 1 or name.split(".")[-1] in NO_DECAY
        assert p["weight_decay"] == (0.0 if exempt else 0.05), (name, p)
    tables = [p for n, p in params.items() if n.endswith("relative_position_bias_table")]
    assert len(tables) == depth and all(p["weight_decay"] == 0.0 for p in tables)
    # What the scheduler really stepped: every group at lr * lr_scale * the same schedule factor.
    groups = optimizer_state(out)["param_groups"]
    factors = {round(g["lr"] / g["initial_lr"], 9) for g in groups}
    assert len(factors) == 1, "one schedule for every group"
    assert {round(g["initial_lr"] / 1e-3, 9) for g in groups} == {round(g["lr_scale"], 9) for g in groups}
    assert len({g["lr_scale"] for g in groups}) == depth + 2, "embeddings, each block, top: distinct lr"


def test_layer_decay_that_cannot_act_is_an_error(capsys):
    from patchplace.finetune import build_optimizer

    with pytest.raises(ValueError, match="has no group_matcher"):
        build_optimizer(torch.nn.Linear(2, 2), lr=1e-3, layer_decay=0.75)

    class OneLayer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)

        def group_matcher(self, coarse=False):
            return {"stem": r"^nothing"}

    with pytest.raises(ValueError, match="has no effect"):
        build_optimizer(OneLayer(), lr=1e-3, layer_decay=0.75)


def test_warmup_and_cosine_shape_the_logged_learning_rate(shards, tmp_path):
    out = tmp_path / "sup"
    assert pretrain.main([*method_args(shards, "supervised"), "optim.max_steps=8", "optim.lr=1e-3",
                          "optim.warmup_fraction=0.5", "optim.min_lr_ratio=0.0", f"run.output={out}"]) == 0
    lrs = [r["lr"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "lr" in r]
    # Logged with each step: the lr that step trained with. Warm-up over round(0.5 * 8) = 4 steps ((k + 1) / 4),
    # then cosine to 0 over the other 4.
    cosine = [0.5 * (1 + math.cos(math.pi * t / 4)) for t in range(4)]
    assert lrs == pytest.approx([1e-3 * f for f in (0.25, 0.5, 0.75, 1.0, *cosine)], abs=1e-12), lrs


# ---------------------------------------------------------------------------------------------- probes
def _batch(method: str, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if get_method(method).modality == "audio":
        return torch.randn(n, 101, 40, generator=g), torch.arange(n) % 12
    return torch.randn(n, 1, 32, 32, generator=g), torch.arange(n) % 3


@pytest.mark.parametrize("method", method_names())
def test_probes_read_a_feature_that_pretraining_trained(shards, method):
    """One training step of the pipeline's objective: a ``cls`` or ``mean`` probe (a sequence holding the class
    token) needs a class token that received gradient; a ``patch_mean`` probe must not read or attend to the
    (untrained) class token at all."""
    cfg = pipeline_config.load(pretrain.PretrainConfig, None, method_args(shards, method))
    spec = get_method(method)
    torch.manual_seed(0)
    objective, backbone = pretrain.build_objective(cfg, 12 if spec.modality == "audio" else 3, 1, spec.modality)
    assert objective.probe_feature == spec.probe_feature_for(backbone)
    x, y = _batch(method)
    objective.train()
    objective((x, y), progress=0.5)["loss"].backward()
    grad = backbone.cls_token.grad if backbone.cls_token is not None else None
    cls_trained = grad is not None and bool(grad.abs().sum() > 0)
    feature = probe_feature_of({"method": method, "probe_feature": objective.probe_feature}, backbone)
    assert backbone.blocks[-1].attn.qkv.weight.grad.abs().sum() > 0, "the patch tokens' path is trained"
    if feature in ("cls", "mean"):
        assert cls_trained, f"{method}: probes run the class token, which its pretraining never trained"
        return
    assert not cls_trained, f"{method} trains its class token: probe it"
    batches = [(x, y)]
    before, _ = extract_features(backbone, batches, pool=feature)
    with torch.no_grad():
        backbone.cls_token.normal_(0, 10.0)  # the untrained token, made large: the probe must not see it
    after, _ = extract_features(backbone, batches, pool=feature)
    assert torch.equal(before[max(before)], after[max(after)])
    legacy = probe_feature_of({"method": method}, backbone)  # a checkpoint from before the metadata had it
    assert legacy == feature


# ---------------------------------------------------------------------------------------------- fine-tuning pooling
def test_every_method_declares_the_pooling_of_its_own_finetuning(shards):
    """The pooling each registration declares (the papers' own: tests/test_registry.py), on the backbones the
    pipeline builds (the checkpoint records it: test_pipelines)."""
    for method in method_names():
        cfg = pipeline_config.load(pretrain.PretrainConfig, None, method_args(shards, method))
        spec = get_method(method)
        objective, backbone = pretrain.build_objective(cfg, 12 if spec.modality == "audio" else 3, 1, spec.modality)
        assert objective.finetune_pool == spec.finetune_pool_for(backbone), method
        expected = "cls" if spec.finetune_pool in ("cls", "head") else spec.finetune_pool
        assert objective.finetune_pool == expected, method


def test_finetune_pools_like_the_checkpoints_method_unless_told(shards, tmp_path, capsys):
    """``finetune.global_pool: null`` (the shipped configs): the checkpoint's ``finetune_pool`` (MAE: the mean through
    a fresh fc_norm, MP3: cls),
    recorded in the fine-tuned checkpoint with the matching probe feature; set, it wins; older checkpoints fall back
    to the backbone's ``global_pool``; from scratch, the class token."""
    for method in ("mae", "mp3"):
        args = [*method_args(shards, method), "optim.max_steps=1", f"run.output={tmp_path / method}"]
        assert pretrain.main(args) == 0
    mae = tmp_path / "mae" / "checkpoint"
    capsys.readouterr()
    out = tmp_path / "ft"
    assert finetune.main(["--config", FT_CONFIG, *img(shards), *TINY, "optim.max_steps=1", "finetune.mixup=0",
                          "finetune.cutmix=0", f"model.checkpoint={mae}", f"run.output={out}"]) == 0
    assert ("finetune.global_pool: mean_fc_norm (the checkpoint's finetune_pool: mae fine-tunes on average-pooled "
            "patch tokens through a LayerNorm") in capsys.readouterr().out
    written = json.loads((out / "checkpoint" / "config.json").read_text())
    assert written["backbone"]["global_pool"] == "mean" and written["backbone"]["fc_norm"]
    assert written["metadata"]["finetune_pool"] == written["metadata"]["probe_feature"] == "mean"
    assert written["metadata"]["pretrain_metadata"]["finetune_pool"] == "mean_fc_norm"
    assert written["metadata"]["preset"] == written["metadata"]["pretrain_metadata"]["preset"], "its checkpoint's"
    backbone, metadata = load_pretrained(out / "checkpoint")
    assert probe_feature_of(metadata, backbone) == "mean", "evaluate's probes read the fine-tuned head's pooling"

    def pool(*overrides: str) -> str:
        cfg = pipeline_config.load(finetune.FinetuneConfig, FT_CONFIG, [*img(shards), *TINY, *overrides])
        return finetune.build_backbone(cfg, 3, 1, "image")[0].config.global_pool

    assert pool(f"model.checkpoint={tmp_path / 'mp3' / 'checkpoint'}") == "cls"
    assert pool(f"model.checkpoint={mae}", "finetune.global_pool=cls") == "cls"
    assert pool() == "cls"  # from scratch
    legacy = load_pretrained(mae)[0]  # a checkpoint that records no finetune_pool
    assert finetune.finetune_pool(None, legacy, {"method": "mae"}, True)[0] == legacy.config.global_pool == "cls"
    with pytest.raises(pipeline_config.ConfigError, match=r"finetune\.global_pool must be one of"):
        pipeline_config.load(finetune.FinetuneConfig, FT_CONFIG, [*img(shards), "finetune.global_pool=avg"])


# ---------------------------------------------------------------------------------------------- recipe knobs
def _recipe(shards, *overrides):
    cfg = pipeline_config.load(finetune.FinetuneConfig, FT_CONFIG, [*img(shards), *TINY, *overrides])
    torch.manual_seed(0)
    backbone, _ = finetune.build_backbone(cfg, 3, 1, "image")
    objective, transform = finetune.build_recipe(cfg.finetune, backbone, 3, "image")
    return cfg, backbone, objective, transform


def test_drop_path_knob_makes_training_forwards_stochastic(shards):
    x = torch.randn(4, 1, 32, 32)
    _, backbone, _, _ = _recipe(shards, "finetune.drop_path=0.5")
    backbone.train()
    assert not torch.equal(backbone(x), backbone(x)), "drop path 0.5 drops residual branches"
    _, backbone, _, _ = _recipe(shards, "finetune.drop_path=0.0")
    backbone.train()
    assert torch.equal(backbone(x), backbone(x))


def test_mixup_cutmix_knobs_mix_images_and_soften_labels(shards, capsys):
    x, y = torch.randn(4, 1, 32, 32), torch.tensor([0, 1, 2, 0])
    _, _, objective, transform = _recipe(shards)  # shipped: mixup 0.8, cutmix 1.0, label smoothing 0.1
    objective.train()
    mixed, soft = transform(x.clone(), y)  # timm mixes in place
    assert soft.shape == (4, 3) and not torch.equal(mixed, x) and soft.max() < 1.0
    _, _, objective, transform = _recipe(shards, "finetune.mixup=0.0", "finetune.cutmix=0.0")
    objective.train()
    same, hard = transform(x, y)
    assert same is x and hard is y
    _, _, objective, transform = _recipe(shards)
    objective.train()
    odd, labels = transform(x[:3].clone(), y[:3])  # timm mixes pairs: an odd batch passes unmixed, says so once
    assert torch.equal(odd, x[:3]) and torch.equal(labels, y[:3])
    assert "mixup/cutmix skipped on a batch of 3" in capsys.readouterr().err
    cfg = pipeline_config.load(finetune.FinetuneConfig, None, [*audio(shards), "finetune.mixup=0.8"])
    with pytest.raises(pipeline_config.ConfigError, match="mix images only"):
        finetune.build_batch_transform(cfg.finetune, 12, "audio", objective)


def test_label_smoothing_knob_changes_the_loss(shards):
    x, y = torch.randn(4, 1, 32, 32), torch.tensor([0, 1, 2, 0])
    losses = {}
    for smoothing in (0.0, 0.3):
        _, backbone, objective, _ = _recipe(shards, f"finetune.label_smoothing={smoothing}", "finetune.mixup=0.0",
                                            "finetune.cutmix=0.0", "finetune.drop_path=0.0")
        with torch.no_grad():
            backbone.head.weight.zero_()
            backbone.head.bias.copy_(torch.tensor([9.0, 0.0, 0.0]))  # confident in class 0
        objective.eval()
        logp = torch.log_softmax(backbone.head.bias, 0)
        expected = -((1 - smoothing) * logp[y] + smoothing * logp.mean()).mean()
        losses[smoothing] = float(objective((x, y))["loss"].detach())
        assert losses[smoothing] == pytest.approx(float(expected.detach()), rel=1e-5)
    assert losses[0.3] != pytest.approx(losses[0.0])


def test_ema_knob_moves_the_target_encoder_through_the_pipeline(shards, tmp_path):
    """I-JEPA's EMA through pretrain.py: momentum 0 makes the target encoder the context encoder after every step;
    momentum 1 leaves it where it started (so it differs from the trained context encoder)."""
    from safetensors.torch import load_file

    states = {}
    for momentum in (0.0, 1.0):
        out = tmp_path / f"ema{momentum}"
        assert pretrain.main([*method_args(shards, "ijepa"), "optim.max_steps=3", f"objective.ema_start={momentum}",
                              f"objective.ema_end={momentum}", f"run.output={out}"]) == 0
        states[momentum] = load_file(str(state_dir(out) / "model.safetensors"))
    for momentum, state in states.items():
        target = {k.removeprefix("target_encoder."): v for k, v in state.items() if k.startswith("target_encoder.")}
        online = {k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")}
        shared = sorted(set(target) & set(online))
        assert len(shared) > 10, "the saved state holds both encoders"
        same = all(torch.equal(target[k], online[k]) for k in shared)
        assert same == (momentum == 0.0), f"momentum {momentum}: target == context encoder is {same}"

