"""Activation checkpointing (``run.activation_checkpointing``) recomputes every Transformer block's activations in
the backward — the backbone's and the objective's decoders / predictors — and changes nothing else: for every
method one step with it gives the loss and the gradients of one step without it, with dropout, attention dropout and
drop path on (their masks replayed in the recomputation), eagerly and under ``torch.compile`` (aot_eager)."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from torch._dynamo.utils import counters

from patchplace.models import create_model
from patchplace.models.backbone import CheckpointedBlock, set_grad_checkpointing
from patchplace.objectives import get_method, method_names
from patchplace.objectives.randsac import DecoderBlock

METHODS = method_names()
BATCH = 4
# every random op of a block on: the recomputation must draw the forward's masks
DROPS = {"drop_rate": 0.1, "attn_drop_rate": 0.1, "drop_path_rate": 0.2}
FIELDS = {"mjp": {"ratio": 0.1, "apply_prob": 0.5, "warmup_fraction": 0.0}}  # a jigsaw at 8 x 8 positions


def objective_of(name: str, tiny_config) -> torch.nn.Module:
    spec = get_method(name)
    torch.manual_seed(0)
    if spec.modality == "audio":
        backbone = create_model("audio_mp3", pos_embed=spec.pos_embed, num_classes=0, **DROPS)
    else:
        backbone = create_model("vit_micro", in_chans=1, img_size=32, pos_embed=spec.pos_embed,
                                num_classes=3 if spec.needs_head else 0, **DROPS)
    names = {f.name for f in fields(spec.config_cls)}
    # two decoder / predictor blocks: one's output feeds the other's recomputation
    deep = {part: 2 for part in ("decoder_depth", "predictor_depth") if part in names}
    return spec.objective_cls(backbone, tiny_config(spec, **deep, **FIELDS.get(name, {}))).train()


def batch_for(objective: torch.nn.Module, batch_of) -> tuple[torch.Tensor, torch.Tensor]:
    return batch_of(objective, BATCH, generator=torch.Generator().manual_seed(1))


def one_step(objective: torch.nn.Module, batch, forward=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients of one step from a fixed global RNG state (masks, dropout and drop path draw from it)."""
    objective.zero_grad(set_to_none=True)
    torch.manual_seed(2)
    loss = (forward or objective)(batch, progress=torch.full((), 0.5))["loss"]
    loss.backward()
    grads = {n: p.grad.clone() for n, p in objective.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def blocks_of(objective: torch.nn.Module) -> list[CheckpointedBlock]:
    return [m for m in objective.modules() if isinstance(m, CheckpointedBlock)]


def test_the_switch_reaches_every_block_of_the_backbone_and_of_the_decoders(tiny_method_config):
    objective = objective_of("randsac", tiny_method_config)
    blocks = blocks_of(objective)
    assert set_grad_checkpointing(objective, True) == len(blocks) == 2 + 2
    assert any(isinstance(b, DecoderBlock) for b in blocks) and all(b.grad_checkpointing for b in blocks)
    objective.backbone.set_grad_checkpointing(False)  # timm's method: the backbone's blocks alone
    assert [b.grad_checkpointing for b in blocks] == [False, False, True, True]
    mae = objective_of("mae", tiny_method_config)
    assert set_grad_checkpointing(mae) == len(mae.backbone.blocks) + len(mae.decoder.blocks)


def test_checkpointed_blocks_keep_fewer_tensors_for_the_backward(tiny_method_config, batch_of):
    """The point of the switch: a checkpointed block keeps its input only, not its attention / MLP activations."""
    objective = objective_of("mae", tiny_method_config)
    batch = batch_for(objective, batch_of)

    def saved() -> int:
        count = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal count
            count += t.numel()
            return t

        torch.manual_seed(2)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            objective(batch, progress=0.5)["loss"]
        return count

    plain = saved()
    set_grad_checkpointing(objective, True)
    assert saved() < plain / 2


@pytest.mark.parametrize("name", METHODS)
def test_a_step_with_checkpointing_equals_one_without(tiny_method_config, batch_of, name):
    objective = objective_of(name, tiny_method_config)
    batch = batch_for(objective, batch_of)
    loss, grads = one_step(objective, batch)
    assert set_grad_checkpointing(objective, True) == len(blocks_of(objective)) > 0
    loss_ckpt, grads_ckpt = one_step(objective, batch)
    # the same ops on the same inputs (the recomputation replays the forward's RNG state): bit-identical on a CPU
    assert torch.equal(loss, loss_ckpt), f"{name}: {loss.item()} vs {loss_ckpt.item()}"
    assert grads.keys() == grads_ckpt.keys()
    for key, grad in grads.items():
        assert torch.equal(grad, grads_ckpt[key]), f"{name}: gradient of {key} differs"
    # and the dropout masks were live: another RNG state gives another loss
    torch.manual_seed(3)
    assert not torch.equal(objective(batch, progress=torch.full((), 0.5))["loss"].detach(), loss)


@pytest.mark.parametrize("scope", ["blocks", "step"])
@pytest.mark.parametrize("name", ["mae", "randsac", "ijepa"])
def test_checkpointing_composes_with_compile(tiny_method_config, batch_of, name, scope):
    """run.compile=aot_eager with either run.compile_scope: the checkpointed step compiles (``step``: one graph,
    no break) and gives the eager step's loss and gradients without checkpointing (aot_eager runs the eager aten
    ops, so only their order of summation may differ)."""
    from patchplace.pipelines.engine.optim import compile_objective

    objective = objective_of(name, tiny_method_config)
    loss, grads = one_step(objective, batch_for(objective, batch_of))
    torch._dynamo.reset()
    counters.clear()
    objective = objective_of(name, tiny_method_config)
    set_grad_checkpointing(objective, True)
    compile_objective(objective, "aot_eager", scope)
    loss_ckpt, grads_ckpt = one_step(objective, batch_for(objective, batch_of))
    assert not counters["graph_break"], f"{name}: graph breaks {dict(counters['graph_break'])}"
    torch.testing.assert_close(loss_ckpt, loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == grads_ckpt.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grads_ckpt[key], grad, rtol=1e-4, atol=1e-6, msg=f"{name}: gradient of {key}")
