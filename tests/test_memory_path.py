"""The in-memory data path through the pipelines: the memory budget picks the path (and says so), the
two paths feed evaluation bit-identical inputs, and in-memory training is bit-identical across runs, worker
counts and a resume point inside the second epoch."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fault_driver import sigterm_at
from pipeline_args import TINY, img, run_log
from safetensors.torch import load_file

from patchplace.data import ShardDataset
from patchplace.data.memory import MemoryReader
from patchplace.pipelines import (
    engine,
    pretrain,
)
from patchplace.pipelines.config import ConfigError
from patchplace.pipelines.sections import DataSection

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # end to end: real runs of the pipelines

log = run_log  # a run's training-step records


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoint" / "model.safetensors"))


def test_the_memory_budget_picks_the_path_and_says_so(shards, tmp_path, capsys):
    common = ["method=supervised", *img(shards), *TINY, "optim.max_steps=2"]
    assert pretrain.main([*common, f"run.output={tmp_path / 'auto'}"]) == 0
    printed = capsys.readouterr().out
    assert "data.train: in memory on cpu (toy/train, 64 samples, 0.0479 MiB decoded)" in printed, printed
    assert log(tmp_path / "auto")[-1]["data"] == {"train": "memory", "val": "memory"}
    # 0.06 MiB: the train split (64 x 28 x 28 bytes) fits, then too little is left for the test split
    assert pretrain.main([*common, "data.memory_budget_mb=0.06", f"run.output={tmp_path / 'budget'}"]) == 0
    printed = capsys.readouterr().out
    assert "data.val: streaming from 2 shard(s) with 0 worker(s) (it takes 0.0239 MiB decoded, more than the " \
           "0.0121 MiB left of data.memory_budget_mb=0.06)" in printed, printed
    assert log(tmp_path / "budget")[-1]["data"] == {"train": "memory", "val": "streaming"}
    assert pretrain.main([*common, "data.in_memory=false", f"run.output={tmp_path / 'off'}"]) == 0
    assert log(tmp_path / "off")[-1]["data"] == {"train": "streaming", "val": "streaming"}
    # insisting on memory that is not there: one line naming the split, its size and the fix
    assert pretrain.main([*common, "data.in_memory=true", "data.memory_budget_mb=0.01",
                          f"run.output={tmp_path / 'insist'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: data.in_memory=true but data.train (toy/train) cannot be held in memory: it takes "
                       "0.0479 MiB decoded, more than the 0.01 MiB left of data.memory_budget_mb=0.01; set "
                       "data.in_memory=auto to stream it"), err


def test_what_cannot_be_batched_streams():
    no_size = SimpleNamespace(dataset="x", split="train", info={}, modality="image", num_samples=10)
    small = SimpleNamespace(**{**vars(no_size), "info": {"image_size": [8, 8], "channels": 1}})
    cfg = DataSection(auto_augment="rand-m9-mstd0.5")
    assert engine.memory_choice(DataSection(), no_size, 2**30, "data.train", True) == \
        "its manifest gives no fixed image size / clip length"
    assert engine.memory_choice(DataSection(), small, 2**30, "data.train", True) is None
    assert engine.memory_choice(cfg, small, 2**30, "data.train", True) == \
        "data.auto_augment runs per sample on PIL images"
    assert engine.memory_choice(cfg, small, 2**30, "data.train", False) is None  # no augmentation: no RandAugment
    with pytest.raises(ConfigError, match=r"data\.in_memory=true but data\.train"):
        engine.memory_choice(DataSection(in_memory=True, auto_augment="rand-m9"), small, 2**30, "data.train", True)


def test_both_paths_feed_evaluation_the_same_inputs(shards):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    cfg = {path: DataSection(train=str(shards / "img" / "train"), val=str(shards / "img" / "test"), num_workers=0,
                             in_memory=path == "memory") for path in ("memory", "streaming")}
    data = {path: engine.build_data(c, accelerator, seed=0, augment=False, split_train=False)
            for path, c in cfg.items()}
    assert isinstance(data["memory"].val, MemoryReader) and isinstance(data["streaming"].val, ShardDataset)
    for split in ("val", "train"):
        memory = list(getattr(data["memory"], split).batches(8, epoch=0))
        streaming = list(getattr(data["streaming"], split).batches(8, epoch=0))
        if split == "val":  # both in manifest order: bit-identical batches
            assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                       for a, b in zip(memory, streaming, strict=True))
        else:  # train, not augmented: the same images, each path in its own shuffled order
            def by_image(batches):
                x = torch.cat([b[0] for b in batches])
                return sorted(map(tuple, x.flatten(1).tolist()))
            assert len(memory) == len(streaming) and by_image(memory) == by_image(streaming)


def test_in_memory_training_is_bit_identical_across_runs_workers_and_resume(shards, tmp_path):
    """64 samples / batch 8 = 8 steps an epoch; 12 steps. The resumed run stops at step 10, in the second epoch, so
    the resume jumps into an epoch (no replay), with random erasing, crops and flips keyed by sample index."""
    common = ["method=mp3", *img(shards), *TINY, "optim.max_steps=12", "data.re_prob=0.25"]
    assert pretrain.main([*common, f"run.output={tmp_path / 'a'}"]) == 0
    assert pretrain.main([*common, f"run.output={tmp_path / 'b'}"]) == 0
    assert pretrain.main([*common, "data.num_workers=2", f"run.output={tmp_path / 'workers'}"]) == 0
    with sigterm_at(10):
        assert pretrain.main([*common, f"run.output={tmp_path / 'resumed'}"]) == 143
    assert pretrain.main([*common, "run.resume=true", f"run.output={tmp_path / 'resumed'}"]) == 0
    reference = weights(tmp_path / "a")
    assert log(tmp_path / "a")[-1]["data"]["train"] == "memory" and log(tmp_path / "a")[-1]["epoch"] == 1
    for other in ("b", "workers", "resumed"):
        theirs = weights(tmp_path / other)
        assert reference.keys() == theirs.keys() and all(torch.equal(reference[k], theirs[k]) for k in reference), \
            other
    losses = {other: [r["loss"] for r in log(tmp_path / other)] for other in ("a", "resumed")}
    assert losses["a"] == losses["resumed"]


def test_label_fraction_trains_on_a_fixed_balanced_subset(shards, tmp_path, capsys):
    """The label-efficiency protocol: data.label_fraction=0.25 of the 64 toy images (3 classes) = 16 samples, an
    epoch of 2 batches of 8; the same subset every run; streaming cannot do it (one line)."""
    common = ["method=supervised", *img(shards), *TINY, "optim.epochs=2", "data.label_fraction=0.25"]
    assert pretrain.main([*common, f"run.output={tmp_path / 'a'}"]) == 0
    assert "data.train: 0.25 of the labels, 16 samples (5-6 per class, data.label_subset_seed=0)" in \
        capsys.readouterr().out
    assert [r["step"] for r in log(tmp_path / "a")] == [1, 2, 3, 4], "2 epochs of 16 samples at batch 8"
    assert pretrain.main([*common, f"run.output={tmp_path / 'b'}"]) == 0
    assert all(torch.equal(weights(tmp_path / "a")[k], weights(tmp_path / "b")[k]) for k in weights(tmp_path / "a"))
    assert pretrain.main([*common, "data.in_memory=false", f"run.output={tmp_path / 'c'}"]) == 2
    assert "data.label_fraction=0.25 needs data.train in memory" in capsys.readouterr().err


def test_a_validation_split_held_out_of_train_is_balanced_fixed_and_never_trained_on(shards, tmp_path, capsys):
    """``data.val=holdout data.holdout=N``: N class-balanced train samples chosen by ``data.holdout_seed`` alone;
    the train reader never yields them (label subsets are drawn from the rest); evaluation reads exactly them."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    train = str(shards / "img" / "train")

    def split(**kw):
        data = engine.build_data(DataSection(train=train, val="holdout", holdout=12, num_workers=0, **kw),
                                 accelerator, seed=0, augment=False, split_train=False)
        return data.train.split, data.val.split

    kept, held = split()
    assert len(held) == 12 and len(kept) == 52 and not set(held.keys) & set(kept.keys)
    assert torch.bincount(held.labels, minlength=3).tolist() == [4, 4, 4]
    assert split()[1].keys == held.keys, "the same samples every time"
    assert split(holdout_seed=1)[1].keys != held.keys
    few, _ = split(label_fraction=0.25)
    assert set(few.keys) <= set(kept.keys), "label subsets come from what remains"
    with pytest.raises(ConfigError, match=r"data\.val=holdout needs data\.holdout > 0"):
        DataSection(train=train, val="holdout").validate()
    test = engine.build_data(DataSection(train=train, val=str(shards / "img" / "test"), holdout=12, num_workers=0),
                             accelerator, seed=0, augment=False, split_train=False)
    assert test.train.split.keys == kept.keys and len(test.val.split) == 32, \
        "a final evaluation on the test split keeps the same samples out of data.train"
    from patchplace.pipelines import finetune

    out = tmp_path / "ft"
    assert finetune.main([f"data.train={train}", "data.val=holdout", "data.holdout=12", "model.preset=vit_micro",
                          "data.batch_size=8", "data.num_workers=0", "optim.max_steps=2", "finetune.mixup=0",
                          "finetune.cutmix=0", "run.tensorboard=false", f"run.output={out}"]) == 0
    assert "12 class-balanced samples of data.train held out for validation" in capsys.readouterr().out
    evals = [json.loads(line)["eval"] for line in (out / "log.jsonl").read_text().splitlines() if '"eval"' in line]
    assert evals[-1]["count"] == 12, "the final evaluation read the held-out samples"
