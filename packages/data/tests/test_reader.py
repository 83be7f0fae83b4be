"""ShardDataset + epoch plans: exact coverage, determinism, rank/worker splits, corrupt shards, URL forms."""

from __future__ import annotations

import itertools
import json
import warnings

import pytest
import torch

from patchplace.data import DataError, Manifest, ShardDataset, make_loader
from patchplace.data.plan import plan_epoch, samples_per_rank


def keys_of(ds: ShardDataset, batch_size: int = 4) -> list[str]:
    return [k for batch in make_loader(ds, batch_size) for k in batch[2]]


def test_one_process_sees_every_sample_once_in_manifest_order_without_shuffle(toy_split):
    split_dir, _ = toy_split
    ds = ShardDataset(split_dir, return_key=True)
    assert len(ds) == 23 and keys_of(ds) == [f"{i:05d}" for i in range(23)]


def test_shuffle_is_deterministic_per_seed_and_epoch_and_changes_across_epochs(toy_split):
    split_dir, _ = toy_split
    ds = ShardDataset(split_dir, return_key=True, shuffle_buffer=8, seed=3)
    first = keys_of(ds)
    assert sorted(first) == [f"{i:05d}" for i in range(23)] and first != sorted(first)
    assert keys_of(ShardDataset(split_dir, return_key=True, shuffle_buffer=8, seed=3)) == first
    ds.set_epoch(1)
    second = keys_of(ds)
    assert second != first and sorted(second) == sorted(first)
    assert keys_of(ShardDataset(split_dir, return_key=True, shuffle_buffer=8, seed=4)) != first


@pytest.mark.parametrize(("world_size", "num_workers", "split_by"), [
    (2, 0, "auto"), (2, 2, "auto"), (3, 1, "sample"), (2, 1, "shard"), (4, 2, "auto"),
])
def test_ranks_and_workers_read_disjoint_equal_length_parts(toy_split, world_size, num_workers, split_by):
    split_dir, _ = toy_split
    per_rank = []
    for rank in range(world_size):
        ds = ShardDataset(split_dir, return_key=True, shuffle_buffer=4, seed=0, rank=rank, world_size=world_size,
                          num_workers=num_workers, split_by=split_by)
        ds.set_epoch(2)
        per_rank.append(keys_of(ds))
        assert len(per_rank[-1]) == len(ds)
    assert len({len(k) for k in per_rank}) == 1, "every rank must see the same number of samples"
    seen = list(itertools.chain(*per_rank))
    assert len(seen) == len(set(seen)), "no sample may be read twice in an epoch"
    # Only what cannot be spread evenly is left out: with 'shard' whole shards, otherwise a few samples.
    slots = world_size * max(num_workers, 1)
    assert 23 - len(seen) <= (8 if split_by == "shard" else 2 + slots)


def test_plans_leave_out_only_the_remainder_of_an_even_spread():
    counts = [4] * 12
    for world_size, num_workers in [(1, 1), (2, 3), (3, 2), (4, 1), (5, 1), (6, 2), (7, 2)]:
        got = []
        for rank, worker in itertools.product(range(world_size), range(num_workers)):
            plan = plan_epoch(12, counts=counts, epoch=5, seed=1, rank=rank, world_size=world_size,
                              worker=worker, num_workers=num_workers)
            shared = [(s, i) for s in plan.shared for i in range(4)][plan.offset::plan.stride]
            got += ([(s, i) for s in plan.own for i in range(4)] + shared)[: plan.quota]
        assert len(got) == len(set(got)) and set(got) <= set(itertools.product(range(12), range(4)))
        assert 48 - len(got) == 48 % (world_size * num_workers)


def test_epoch_length_caps_every_rank(toy_split):
    split_dir, _ = toy_split
    ds = ShardDataset(split_dir, return_key=True, world_size=2, rank=1, num_workers=2, epoch_length=7)
    assert len(ds) == 7 and len(keys_of(ds, batch_size=3)) == 7
    with pytest.raises(DataError, match="epoch_length=50 must be in"):
        ShardDataset(split_dir, world_size=2, epoch_length=50)
    assert samples_per_rank([5, 5, 5, 5, 3], epoch=0, seed=0, world_size=1, num_workers=1) == 23


def test_corrupt_shard_is_named_or_skipped_and_counted(toy_split):
    split_dir, _ = toy_split
    shard = split_dir / Manifest.load(split_dir).shards[2].name
    shard.write_bytes(shard.read_bytes()[:2500])
    with pytest.raises(DataError, match=rf"corrupt shard .*{shard.name}.*skip_corrupt=True"):
        list(ShardDataset(split_dir))
    ds = ShardDataset(split_dir, skip_corrupt=True, return_key=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keys = [k for _, _, k in ds]
    assert ds.skipped == [str(shard)] and any(shard.name in str(w.message) for w in caught)
    assert set(range(10)) | set(range(15, 23)) <= {int(k) for k in keys}


def test_shard_shorter_than_its_manifest_is_corrupt(toy_split, tmp_path, make_toy_split):
    split_dir, _ = toy_split
    other, _ = make_toy_split(tmp_path / "other", n=4, max_count=5)
    first = split_dir / Manifest.load(split_dir).shards[0].name
    first.write_bytes((other / Manifest.load(other).shards[0].name).read_bytes())
    with pytest.raises(DataError, match=r"\d+ bytes, the manifest says \d+ for train-000000.tar"):  # its size
        list(ShardDataset(split_dir))
    with pytest.raises(DataError, match="holds 4 samples, the manifest says 5"):  # unverified: its count
        list(ShardDataset(split_dir, verify=False))


def test_label_outside_the_manifest_classes_is_an_error(toy_split):
    split_dir, _ = toy_split
    raw = json.loads((split_dir / "manifest.json").read_text())
    raw.update(classes=["c0", "c1"], class_counts=None)
    (split_dir / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(DataError, match=r"label 2 is outside the 2 classes"):
        list(ShardDataset(split_dir))


def test_brace_patterns_and_pipe_urls_read_the_same_samples(toy_split):
    split_dir, _ = toy_split
    expected = [k for _, _, k in ShardDataset(split_dir, return_key=True)]
    brace = str(split_dir / "train-{000000..000004}.tar")
    assert [k for _, _, k in ShardDataset(split_dir, urls=brace, return_key=True)] == expected
    pipes = [f"pipe:cat {split_dir / s.name}" for s in Manifest.load(split_dir).shards]
    assert [k for _, _, k in ShardDataset(split_dir, urls=pipes, return_key=True)] == expected
    with pytest.raises(DataError, match="2 shard URLs given but the manifest of toy/train lists 5"):
        ShardDataset(split_dir, urls=pipes[:2])


def test_a_pipe_commands_variables_are_left_to_its_shell(toy_split, monkeypatch):
    """``${VAR}`` in a ``pipe:`` command is the shell's (webdataset's expansion would read WDS_VAR): set, the
    shards read as the local ones; unset, one line naming it; assigned by the command itself, left alone. Elsewhere
    ``${VAR}`` stays webdataset's WDS_VAR, an unset one a line naming it."""
    from patchplace.data.reader import expand_urls

    split_dir, _ = toy_split
    expected = [k for _, _, k in ShardDataset(split_dir, return_key=True)]
    urls = "pipe:cat ${SDIR}/train-{000000..000004}.tar"
    monkeypatch.delenv("WDS_SDIR", raising=False)
    monkeypatch.setenv("SDIR", str(split_dir))
    assert expand_urls(urls)[1] == "pipe:cat ${SDIR}/train-000001.tar"
    assert [k for _, _, k in ShardDataset(split_dir, urls=urls, return_key=True)] == expected
    monkeypatch.delenv("SDIR")
    with pytest.raises(DataError, match=r"^pipe:cat \$\{SDIR\}.*: the pipe: command uses \$\{SDIR\}, which is not set "
                                        r"in this environment .*export SDIR=\.\.\. before the run"):
        ShardDataset(split_dir, urls=urls)
    assert expand_urls(f"pipe:D={split_dir}; cat ${{D}}/a.tar") == [f"pipe:D={split_dir}; cat ${{D}}/a.tar"]
    with pytest.raises(DataError, match=r"\$\{SDIR\} is read from the environment variable WDS_SDIR .*not set"):
        expand_urls("${SDIR}/train-{000000..000004}.tar")
    monkeypatch.setenv("WDS_SDIR", str(split_dir))
    assert expand_urls("${SDIR}/train-{000000..000004}.tar")[0] == f"{split_dir}/train-000000.tar"


def test_loader_worker_count_must_match_the_plan(toy_split):
    split_dir, _ = toy_split
    ds = ShardDataset(split_dir, num_workers=2)
    with pytest.raises(DataError, match="planned for num_workers=2 but the DataLoader runs 1"):
        next(iter(torch.utils.data.DataLoader(ds, batch_size=2, num_workers=0)))


def test_raw_mode_yields_undecoded_webdataset_samples(toy_split):
    split_dir, _ = toy_split
    sample = next(iter(ShardDataset(split_dir, decode=False)))
    assert sample["__key__"] == "00000" and sample["png"][:4] == b"\x89PNG" and sample["cls"] == b"0"


def test_seeded_transforms_do_not_depend_on_worker_count_or_global_rng(toy_split):
    split_dir, _ = toy_split
    noise = lambda x: x.float() + torch.rand(1)  # noqa: E731 - uses the global torch RNG

    def run(workers: int, global_seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(global_seed)
        ds = ShardDataset(split_dir, transform=noise, seeded_transforms=True, return_key=True, seed=5,
                          num_workers=workers)
        return {k: x for batch in make_loader(ds, 4) for x, k in zip(batch[0], batch[2], strict=True)}

    a, b = run(0, 1), run(2, 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    torch.manual_seed(3)
    before = torch.rand(1)
    torch.manual_seed(3)
    ds = ShardDataset(split_dir, transform=noise, seeded_transforms=True)
    ds._prepare(next(iter(ShardDataset(split_dir, decode=False))))
    assert torch.equal(torch.rand(1), before), "the caller's RNG state is restored"


def test_num_batches_matches_the_loader(toy_split):
    split_dir, _ = toy_split
    for workers in (0, 2):
        ds = ShardDataset(split_dir, num_workers=workers, world_size=2, rank=1)
        assert ds.num_batches(3) == len(list(make_loader(ds, 3)))
