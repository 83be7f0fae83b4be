"""In-memory splits: the same samples as streaming, the memory budget, corrupt shards by
name, and per-rank epoch indices that are disjoint, deterministic and change with the epoch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from patchplace.data import DataError, Manifest
from patchplace.data.memory import InMemorySplit, decoded_bytes, epoch_indices, fits_in_memory


def test_an_in_memory_split_holds_exactly_the_streamed_samples(toy_split):
    split_dir, images = toy_split
    split = InMemorySplit.load(split_dir)
    assert split.inputs.dtype == torch.uint8 and tuple(split.inputs.shape) == (23, 1, 8, 8)
    assert split.keys == [f"{i:05d}" for i in range(23)]
    assert split.labels.tolist() == [i % 3 for i in range(23)]
    for i, image in enumerate(images):  # PNG is lossless: bit-identical to what was written
        assert np.array_equal(split.inputs[i, 0].numpy(), image)


def test_the_memory_budget_decides(toy_split):
    split_dir, _ = toy_split
    manifest = Manifest.load(split_dir)
    assert decoded_bytes(manifest) == 23 * 1 * 8 * 8
    assert fits_in_memory(manifest, 23 * 64) and not fits_in_memory(manifest, 23 * 64 - 1)
    with pytest.raises(DataError, match=r"toy/train takes 0 MiB decoded, more than the memory budget"):
        InMemorySplit.load(manifest, budget_bytes=100)


def test_a_corrupt_shard_fails_the_load_with_its_name(toy_split):
    split_dir, _ = toy_split
    shard = sorted(split_dir.glob("*.tar"))[1]
    shard.write_bytes(shard.read_bytes()[:3000])
    with pytest.raises(DataError, match=f"corrupt shard {shard}"):
        InMemorySplit.load(split_dir)


def test_epoch_indices_are_disjoint_per_rank_deterministic_and_new_each_epoch():
    n, world = 103, 4
    ranks = [epoch_indices(n, seed=7, epoch=2, rank=r, world_size=world) for r in range(world)]
    flat = torch.cat(ranks)
    assert all(len(r) == n // world for r in ranks) and len(set(flat.tolist())) == len(flat) == 100
    assert torch.equal(ranks[1], epoch_indices(n, seed=7, epoch=2, rank=1, world_size=world))
    assert not torch.equal(ranks[1], epoch_indices(n, seed=7, epoch=3, rank=1, world_size=world))
    left_out = [set(range(n)) - set(torch.cat([epoch_indices(n, seed=7, epoch=e, rank=r, world_size=world)
                                               for r in range(world)]).tolist()) for e in range(3)]
    assert all(len(s) == 3 for s in left_out) and len(set.union(*left_out)) > 3, "a different remainder each epoch"
    with pytest.raises(DataError, match="cannot be split over 8 ranks"):
        epoch_indices(5, seed=0, epoch=0, rank=0, world_size=8)


def test_decoding_in_worker_processes_gives_the_same_split_and_errors(toy_split):
    split_dir, _ = toy_split  # 23 samples in 5 shards
    one, three = InMemorySplit.load(split_dir), InMemorySplit.load(split_dir, num_workers=2)
    assert one.keys == three.keys and torch.equal(one.inputs, three.inputs) and torch.equal(one.labels, three.labels)
    shard = sorted(split_dir.glob("*.tar"))[3]
    shard.write_bytes(shard.read_bytes()[:3000])
    with pytest.raises(DataError, match=f"^corrupt shard {shard}: "):  # one line, not the worker's traceback
        InMemorySplit.load(split_dir, num_workers=2)
    with pytest.warns(UserWarning, match="skipping corrupt shard"):
        kept = InMemorySplit.load(split_dir, skip_corrupt=True)
    assert kept.skipped == [str(shard)] and len(kept) == 23 - 5 and "00015" not in kept.keys


def test_balanced_subsets_are_fixed_per_class_and_nested_by_seed_only():
    from patchplace.data.memory import balanced_subset

    labels = torch.arange(1000) % 10  # 100 per class
    one = balanced_subset(labels, 0.01)
    assert len(one) == 10 and torch.bincount(labels[one]).tolist() == [1] * 10
    ten = balanced_subset(labels, 0.1)
    assert torch.bincount(labels[ten]).tolist() == [10] * 10 and torch.equal(ten, ten.sort().values)
    assert torch.equal(ten, balanced_subset(labels, 0.1)), "the same subset for every method and run"
    assert not torch.equal(ten, balanced_subset(labels, 0.1, seed=1))
    skewed = torch.cat([torch.zeros(300, dtype=torch.int64), torch.ones(20, dtype=torch.int64)])
    assert torch.bincount(skewed[balanced_subset(skewed, 0.01)]).tolist() == [3, 1], "at least one per class"
    with pytest.raises(DataError, match="label fraction"):
        balanced_subset(labels, 0.0)


def test_a_load_shows_its_progress_on_the_main_process(toy_split, capsys, monkeypatch):
    """A large split decodes for a minute: a start and an end line when stderr is no terminal (a log), a tqdm bar
    over the samples on stderr when it is one; nothing from the other ranks of a launch or with progress=False."""
    import io
    import sys

    split_dir, _ = toy_split  # 23 samples in 5 shards
    monkeypatch.delenv("RANK", raising=False)
    InMemorySplit.load(split_dir, num_workers=2)
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == ("toy/train: decoding 23 samples from 5 shard(s) into memory (2 worker "
                                   "process(es)) ...")
    assert out.splitlines()[1].startswith("toy/train: decoded 23 samples in ") and len(out.splitlines()) == 2, out
    assert err == ""

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    InMemorySplit.load(split_dir)
    shown = terminal.getvalue()
    assert "toy/train: decoding into memory" in shown and "23/23" in shown and "100%" in shown, shown
    assert capsys.readouterr().out == ""
    terminal.truncate(0)

    InMemorySplit.load(split_dir, progress=False)
    monkeypatch.setenv("RANK", "1")  # another rank of `accelerate launch` / torchrun: rank 0 reports
    InMemorySplit.load(split_dir)
    assert capsys.readouterr().out == "" and terminal.getvalue() == ""
    corrupt = sorted(split_dir.glob("*.tar"))[2]
    corrupt.write_bytes(corrupt.read_bytes()[:3000])
    monkeypatch.delenv("RANK")
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with pytest.raises(DataError, match="corrupt shard"):
        InMemorySplit.load(split_dir)
    assert "decoded" not in capsys.readouterr().out, "no end line after an error"
