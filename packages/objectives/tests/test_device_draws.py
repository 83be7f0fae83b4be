"""Masks and segment orders are drawn where the step runs: on a ``meta`` model no op of a training step (forward and
backward) yields a CPU tensor — every random draw, index and table lives on the step's device, nothing is built
on the host — and without a generator the draws follow the global RNG (what a checkpoint saves and restores)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from patchplace.models import create_model
from patchplace.objectives import get_method

METHODS = ["randsac", "droppos", "mae", "mp3", "mp3_speech", "supervised"]


class _HostOutputs(TorchDispatchMode):
    """Records every op whose output holds a CPU tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tree_flatten(out)[0]):
            self.ops.append(str(func))
        return out


def _objective(name: str, tiny_config):
    spec = get_method(name)
    torch.manual_seed(0)
    if spec.modality == "audio":
        backbone = create_model("audio_mp3", pos_embed=spec.pos_embed, num_classes=0)
    else:  # a 14 x 14 grid, the ImageNet ViT-B/16 one
        backbone = create_model("vit_micro", in_chans=3, img_size=56, patch_size=4, pos_embed=spec.pos_embed,
                                num_classes=3 if spec.needs_head else 0)
    return spec.objective_cls(backbone, tiny_config(spec)).train()


def _batch(objective, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    config = objective.backbone.config
    shape = (config.num_frames, config.in_features) if config.modality == "audio" else (
        config.in_chans, config.img_size, config.img_size)
    return torch.randn(2, *shape, device=device), torch.randint(0, 3, (2,), device=device)


@pytest.mark.parametrize("name", METHODS)
def test_a_step_on_a_device_builds_nothing_on_the_host(name, tiny_method_config):
    objective = _objective(name, tiny_method_config).to("meta")
    batch = _batch(objective, "meta")
    with _HostOutputs() as mode:
        out = objective(batch, progress=torch.full((), 0.5, device="meta"))
        out["loss"].backward()
    assert not mode.ops, f"{name}: ops that built CPU tensors in the step: {mode.ops}"
    assert all(value.device.type == "meta" for value in out.values()), "logged outputs stay device tensors"


@pytest.mark.parametrize("name", METHODS)
def test_without_a_generator_the_draws_follow_the_global_rng(name, tiny_method_config):
    objective = _objective(name, tiny_method_config)
    batch = _batch(objective, "cpu")
    losses = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        losses.append(objective(batch, progress=0.5)["loss"].detach())
    assert torch.equal(losses[0], losses[1])
    if name != "supervised":  # the only method without random masks
        assert not torch.equal(losses[0], losses[2])
