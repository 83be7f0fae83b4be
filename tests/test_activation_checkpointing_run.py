"""``run.activation_checkpointing=true`` through the pipelines: pretrainings (RandSAC: the backbone's blocks and
the decoder's; I-JEPA: and its EMA target encoder) and a fine-tuning (drop path 0.1, replayed in every
recomputation) train the very weights of the same runs without it, and say how many blocks recompute."""

from __future__ import annotations

import pytest
import torch
from pipeline_args import TINY, img, method_args, run_log
from safetensors.torch import load_file

from patchplace.pipelines import finetune, pretrain


def trained(tmp_path, name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    return [r["loss"] for r in run_log(tmp_path / name)], load_file(str(tmp_path / name / "checkpoint" /
                                                                         "model.safetensors"))


def assert_same_runs(tmp_path) -> None:
    (losses, weights), (losses_ckpt, weights_ckpt) = trained(tmp_path, "plain"), trained(tmp_path, "ckpt")
    assert len(losses) == 3 and losses_ckpt == losses
    assert weights.keys() == weights_ckpt.keys()
    assert all(torch.equal(weights[k], weights_ckpt[k]) for k in weights), "bit-identical weights"


@pytest.mark.parametrize("pipeline", ["randsac", "ijepa", "finetune"])
def test_a_run_with_checkpointing_trains_the_weights_of_one_without(shards, tmp_path, capsys, pipeline):
    if pipeline == "finetune":
        main, args, blocks = finetune.main, [*img(shards), *TINY], 2
    else:  # vit_micro's 2 blocks, the decoder's / predictor's 1; I-JEPA's frozen target encoder recomputes nothing
        main, args, blocks = pretrain.main, method_args(shards, pipeline), 2 + 1
    for name, knobs in {"plain": [], "ckpt": ["run.activation_checkpointing=true"]}.items():
        assert main([*args, "optim.max_steps=3", *knobs, f"run.output={tmp_path / name}"]) == 0
    assert f"run.activation_checkpointing: {blocks} Transformer blocks recompute" in capsys.readouterr().out
    assert_same_runs(tmp_path)
