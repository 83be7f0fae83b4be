"""Every method's training step is one static, capturable graph (what makes it fast on a GPU), checked on a CPU:

* no host synchronisation: no op reads a device value on the host (``.item()``, ``nonzero``, boolean indexing);
* no host-built data copied to the device mid-step: the forward run on a fake CUDA device (``FakeTensorMode``)
  copies nothing from the host and meets no data-dependent op
  (autograd's engine needs a real CUDA context, so the backward is checked by the two other tests: its ops are
  derived from the forward's, on the forward's devices);
* one graph: ``torch.compile(fullgraph=True)`` captures forward and backward without a graph break, and 5 further
  steps with fresh masks and a moving ``progress`` (a 0-d tensor, as the trainer passes it) reuse that graph.

The backbone has a 14 x 14 grid (the ImageNet ViT-B/16 grid) so the masks meet their real shapes.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from patchplace.models import create_model
from patchplace.objectives import get_method, method_names
from patchplace.objectives.audit import count_step, counting, fake_cuda

METHODS = method_names()
BATCH = 4
# MJP at the paper's ratio, its jigsaw possible from the first step (the coin is tossed on the device every step)
FIELDS = {"mjp": {"ratio": 0.03, "apply_prob": 0.5, "warmup_fraction": 0.0}}


@pytest.fixture
def build(tiny_method_config):
    """Factory: ``name``'s objective on a 2-block ViT with a 14 x 14 grid (56 px, patch 4) or the speech backbone,
    at the conftest's tiny decoder / predictor widths."""
    return lambda name: objective_of(name, tiny_method_config)


def objective_of(name: str, tiny_config):
    spec = get_method(name)
    torch.manual_seed(0)
    if spec.modality == "audio":
        backbone = create_model("audio_mp3", pos_embed=spec.pos_embed, num_classes=0)
    else:
        backbone = create_model("vit_micro", in_chans=3, img_size=56, patch_size=4, pos_embed=spec.pos_embed,
                                num_classes=3 if spec.needs_head else 0)
    return spec.objective_cls(backbone, tiny_config(spec, **FIELDS.get(name, {}))).train()


def step(objective, batch, progress: torch.Tensor) -> torch.Tensor:
    """Forward and backward of one training step; returns the loss."""
    loss = objective(batch, progress=progress)["loss"]
    loss.backward()
    return loss


@pytest.mark.parametrize("name", METHODS)
def test_a_step_never_waits_for_the_device(build, batch_of, name):
    objective = build(name)
    batch = batch_of(objective, BATCH)
    progress = torch.full((), 0.5)
    counts = count_step(lambda: step(objective, batch, progress))
    assert counts.ops > 0
    assert counts.num_syncs == 0, f"{name}: host synchronisations in one step: {dict(counts.syncs)}"


@pytest.mark.parametrize("name", METHODS)
def test_a_step_on_cuda_copies_nothing_from_the_host(build, batch_of, name):
    objective = build(name)
    with fake_cuda(objective):
        batch = batch_of(objective, BATCH, "cuda")
        progress = torch.full((), 0.5, device="cuda")
        with counting() as counts:  # (torch disables autocast on a fake CUDA device)
            objective(batch, progress=progress)
    assert not counts.host_copies, f"{name}: host-to-device copies in one step: {dict(counts.host_copies)}"


@pytest.mark.parametrize("name", METHODS)
def test_a_step_is_one_graph_that_fresh_masks_reuse(build, batch_of, name):
    torch._dynamo.reset()
    counters.clear()
    objective = build(name)
    batch = batch_of(objective, BATCH)
    compiled = torch.compile(objective, backend="aot_eager", fullgraph=True)
    for i in range(6):
        loss = compiled(batch, progress=torch.full((), i / 10))["loss"]
        loss.backward()
        assert torch.isfinite(loss)
        if i == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1, f"{name}: the first step compiled into {graphs} graphs"
    assert counters["stats"]["unique_graphs"] == graphs, f"{name}: recompiled over 5 steps of fresh masks"
    assert not counters["graph_break"], f"{name}: graph breaks {dict(counters['graph_break'])}"
