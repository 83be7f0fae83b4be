"""Deterministic epoch plans: which shards (and which samples of them) each rank x DataLoader worker reads.

Every rank computes the same plan from (seed, epoch, shard counts), so no communication is needed:

* the shard order of an epoch is one seeded permutation shared by all ranks;
* ``shard`` split: slot ``s = rank * num_workers + worker`` reads shards ``order[s::slots]`` whole (least I/O);
* ``sample`` split: every slot reads every shard and keeps sample ``i`` of the epoch stream when
  ``i % slots == s`` (for tiny datasets);
* ``auto`` (default): the first ``slots * (num_shards // slots)`` shards of the order are dealt out whole and
  the remaining ``num_shards % slots`` shards are read by every slot, split by sample — little extra I/O and
  almost nothing left out, whatever the shard count;
* quotas (when per-shard counts are known from the manifest): worker ``w`` of every rank yields the same
  number of samples, the minimum over ranks of what slot ``(r, w)`` can read. All ranks therefore see the same
  number of samples and batches per epoch (no DDP hang), no sample is seen twice in an epoch, and at most
  a few samples per slot are left out of an epoch (different ones each epoch, since the order changes).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import DataError

SPLIT_MODES = ("auto", "shard", "sample")


@dataclass(frozen=True)
class WorkerPlan:
    """What one (rank, worker) reads in one epoch."""

    own: tuple[int, ...]  # shards read whole, in this order
    shared: tuple[int, ...]  # shards read by every slot, then ...
    stride: int  # ... keeping sample i of their concatenated stream when i % stride == offset
    offset: int
    quota: int | None  # samples to yield; None = everything read (counts unknown)
    skip: int = 0  # even plans: samples of the first own shard that belong to the slot before
    take: int | None = None  # even plans: samples read in all (the slot's contiguous run of the epoch stream)


def shard_order(num_shards: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    order = list(range(num_shards))
    if shuffle:
        random.Random(f"patchplace-shards-{seed}-{epoch}").shuffle(order)
    return order


def dealt_shards(split_by: str, num_shards: int, slots: int) -> int:
    """How many shards (from the front of the epoch order) are dealt out whole; the rest are shared."""
    if split_by not in SPLIT_MODES:
        raise DataError(f"split_by={split_by!r} is not one of {SPLIT_MODES}")
    if split_by == "shard":
        if num_shards < slots:
            raise DataError(f"split_by='shard' needs at least {slots} shards (world_size x num_workers), "
                            f"found {num_shards}: write smaller shards (--max-count) or use split_by='auto'")
        return num_shards
    return 0 if split_by == "sample" else slots * (num_shards // slots)


def _slot_counts(counts: Sequence[int], order: list[int], dealt: int, slots: int) -> list[int]:
    shared = sum(counts[i] for i in order[dealt:])
    return [sum(counts[i] for i in order[s:dealt:slots]) + shared // slots + (1 if s < shared % slots else 0)
            for s in range(slots)]


def plan_epoch(
    num_shards: int,
    *,
    counts: Sequence[int] | None,
    epoch: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    worker: int = 0,
    num_workers: int = 1,
    shuffle_shards: bool = True,
    split_by: str = "auto",
    epoch_length: int | None = None,
) -> WorkerPlan:
    """Plan of ``(rank, worker)`` for ``epoch``; ``epoch_length`` caps the samples per rank."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise DataError(f"rank {rank} is outside world_size {world_size}")
    if num_workers < 1 or not 0 <= worker < num_workers:
        raise DataError(f"worker {worker} is outside num_workers {num_workers}")
    if num_shards < 1:
        raise DataError("no shards to read")
    if counts is not None and len(counts) != num_shards:
        raise DataError(f"{len(counts)} shard counts for {num_shards} shards: the urls do not match the manifest")
    slots = world_size * num_workers
    slot = rank * num_workers + worker
    dealt = dealt_shards(split_by, num_shards, slots)
    order = shard_order(num_shards, seed, epoch, shuffle_shards)
    quota = None
    if counts is not None:
        quota = worker_quotas(counts, order, dealt, world_size, num_workers, epoch_length)[worker]
    elif epoch_length is not None:
        raise DataError("epoch_length needs per-shard counts: pass the split's manifest")
    return WorkerPlan(own=tuple(order[slot:dealt:slots]), shared=tuple(order[dealt:]), stride=slots,
                      offset=slot, quota=quota)


def worker_quotas(
    counts: Sequence[int],
    order: list[int],
    dealt: int,
    world_size: int,
    num_workers: int,
    epoch_length: int | None = None,
) -> list[int]:
    """Samples each worker index yields, identical on every rank (so batch counts match across ranks)."""
    per_slot = _slot_counts(counts, order, dealt, world_size * num_workers)
    quotas = [min(per_slot[r * num_workers + w] for r in range(world_size)) for w in range(num_workers)]
    if epoch_length is not None:
        available = sum(quotas)
        if epoch_length < 1 or epoch_length > available:
            raise DataError(f"epoch_length={epoch_length} must be in [1, {available}]: each rank can see "
                            f"{available} distinct samples this epoch")
        quotas = _trim_balanced(quotas, epoch_length)
    return quotas


def _trim_balanced(quotas: list[int], total: int) -> list[int]:
    """Lower the largest quotas first until they sum to ``total`` (water-filling from the top)."""
    lo, hi = 0, max(quotas)
    while lo < hi:  # largest level L with sum(min(q, L)) <= total
        mid = (lo + hi + 1) // 2
        if sum(min(q, mid) for q in quotas) <= total:
            lo = mid
        else:
            hi = mid - 1
    out = [min(q, lo) for q in quotas]
    rest = total - sum(out)
    for i, q in enumerate(quotas):  # fewer than (#workers above level) remain: one more each
        if rest and q > out[i]:
            out[i] += 1
            rest -= 1
    return out


def worker_quotas_for_epoch(
    counts: Sequence[int], *, epoch: int, seed: int, world_size: int, num_workers: int,
    shuffle_shards: bool = True, split_by: str = "auto", epoch_length: int | None = None,
) -> list[int]:
    """Samples each worker index yields in ``epoch`` (the same on every rank)."""
    dealt = dealt_shards(split_by, len(counts), world_size * num_workers)
    order = shard_order(len(counts), seed, epoch, shuffle_shards)
    return worker_quotas(counts, order, dealt, world_size, num_workers, epoch_length)


def samples_per_rank(counts: Sequence[int], **kwargs) -> int:
    """Length of an epoch on every rank (what ``len(dataset)`` reports); kwargs as
    :func:`worker_quotas_for_epoch`."""
    return sum(worker_quotas_for_epoch(counts, **kwargs))


def even_quotas(total: int, num_workers: int, batch_size: int | None, drop_last: bool) -> list[int]:
    """Samples each worker index yields when a rank reads ``total`` samples: whole batches of ``batch_size`` dealt
    round-robin over the workers (the DataLoader collects them in that order), the ``total % batch_size`` left over
    dropped (``drop_last``) or given to the next worker in turn, so a rank's batches are all full but at most one."""
    if not batch_size:
        return [total // num_workers + (1 if w < total % num_workers else 0) for w in range(num_workers)]
    full, rest = divmod(total, batch_size)
    quotas = [batch_size * (full // num_workers + (1 if w < full % num_workers else 0)) for w in range(num_workers)]
    if rest and not drop_last:
        quotas[full % num_workers] += rest
    return quotas


def even_plan(counts: Sequence[int], *, epoch: int, seed: int, rank: int, world_size: int, worker: int,
              num_workers: int, shuffle_shards: bool, epoch_length: int | None, batch_size: int | None,
              drop_last: bool) -> WorkerPlan:
    """Plan of ``(rank, worker)`` that leaves no sample out but the fewest needed: the epoch's shard order is
    concatenated into one stream, rank ``r`` reads its ``len // world_size`` samples from ``r * (len //
    world_size)`` on (``epoch_length`` caps them), cut into contiguous runs per worker by :func:`even_quotas`. Each
    slot reads whole shards but for at most two at its run's ends. Left out per epoch: ``len % world_size``
    samples (so that every rank reads as many) and, with ``drop_last``, each rank's ``per-rank % batch_size``."""
    total = sum(counts)
    per_rank = total // world_size
    if per_rank < 1:
        raise DataError(f"{total} samples cannot be split over {world_size} ranks")
    if epoch_length is not None:
        if not 1 <= epoch_length <= per_rank:
            raise DataError(f"epoch_length={epoch_length} must be in [1, {per_rank}]: each rank can see "
                            f"{per_rank} distinct samples this epoch")
        per_rank = epoch_length
    quotas = even_quotas(per_rank, num_workers, batch_size, drop_last)
    start = rank * (total // world_size) + sum(quotas[:worker])
    order = shard_order(len(counts), seed, epoch, shuffle_shards)
    own, offset = [], 0
    skip = 0
    for shard in order:
        end = offset + counts[shard]
        if end > start and offset < start + quotas[worker]:
            if not own:
                skip = start - offset
            own.append(shard)
        offset = end
    return WorkerPlan(own=tuple(own), shared=(), stride=1, offset=0, quota=quotas[worker], skip=skip,
                      take=quotas[worker])
