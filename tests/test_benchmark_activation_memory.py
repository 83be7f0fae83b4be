"""The activation_memory suite's counter measures what it says: live bytes of the storages a step allocates (views
and in-place results not again, weights not at all), the forward's held bytes equal to what autograd's saved-tensor
hooks see without checkpointing, and fewer held bytes with it."""

from __future__ import annotations

import json

import torch

from patchplace.models import create_model
from patchplace.models.backbone import set_grad_checkpointing
from patchplace.objectives import MAE, MAEConfig, Supervised
from patchplace.research.benchmarks.activation_memory import MIB, LiveBytes, step_bytes, trained_blocks
from patchplace.research.benchmarks.steps import saved_bytes


def test_live_bytes_counts_allocations_until_they_are_freed():
    weight = torch.ones(256, 256)  # made before: never counted, nor its views
    with LiveBytes() as counter:
        a = torch.ones(1024)  # 4 KiB
        view, _ = a[10:], weight.t()
        a.add_(1)
        assert counter.live == counter.peak == 4096
        b = a * 2
        assert counter.live == counter.peak == 8192
        del a
        assert counter.live == 8192, "the view keeps its storage alive"
        del view, b
        assert counter.live == 0 and counter.peak == 8192


def test_held_bytes_are_the_saved_tensors_and_checkpointing_cuts_them():
    torch.manual_seed(0)
    # 10 classes: saved_bytes draws its labels in [0, 10)
    objective = Supervised(create_model("vit_micro", in_chans=1, img_size=32, num_classes=10))
    images = objective.backbone.config.in_chans * 32 * 32 * 4 * 4  # the input batch: saved, made before the count
    hooks = saved_bytes(objective, 4, amp="no") - images
    plain = step_bytes(objective, 4)
    assert abs(plain["held_mib"] - hooks / MIB) < 0.1 + 0.01 * hooks / MIB
    assert plain["grads_mib"] > 0 and plain["peak_mib"] >= plain["held_mib"]
    set_grad_checkpointing(objective, True)
    ckpt = step_bytes(objective, 4)
    assert ckpt["held_mib"] < plain["held_mib"] / 2


def test_frozen_blocks_are_not_counted_as_recomputing():
    torch.manual_seed(0)
    mae = MAE(create_model("vit_micro", in_chans=1, img_size=32, pos_embed="sincos2d", num_classes=0),
              MAEConfig(decoder_dim=32, decoder_depth=1, decoder_heads=2))
    assert trained_blocks(mae) == 3
    mae.backbone.blocks[0].requires_grad_(False)
    assert trained_blocks(mae) == 2


def test_the_suite_writes_its_table(tmp_path):
    from patchplace.research import benchmark

    assert benchmark.main(["--suite", "activation_memory", "--methods", "supervised", "mae", "--memory-widths", "vit_b",
                           "--memory-depth", "1", "--memory-batch", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "benchmark_activation_memory.json").read_text())["results"]
    assert [r["name"] for r in rows] == ["activation_memory/vit_b supervised", "activation_memory/vit_b mae"]
    assert [r["blocks"] for r in rows] == [1, 1 + 8]  # MAE: its paper's 8 decoder blocks
    assert all(r["held_ckpt_mib"] < r["held_mib"] and r["peak_ckpt_mib"] <= r["peak_mib"] for r in rows)
    assert "| vit_b mae | 9 |" in (tmp_path / "benchmark_activation_memory.md").read_text()
