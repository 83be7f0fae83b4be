"""A run resumed on another layout: another process count, per-process batch or ``run.grad_accum`` at the same
global batch (a 64-GPU job going on with 32 GPUs and ``run.grad_accum=2``, or a smaller batch per GPU for
memory).

The weights, the optimizer state and the lr schedule are the checkpoint's (none depends on the layout). The
interrupted epoch is finished with the samples the checkpoint's layout had left: each optimizer step consumes the
same global batch of samples it would have consumed, dealt over the new layout's (rank, micro-batch) slots, so no
sample of that epoch is read twice or left out, and each step's gradient (a mean over the global batch) is the
same sum. The later epochs are planned for the new layout. Each rank's random stream (masks, noise, drop path)
cannot be carried to another layout: it restarts from (seed, rank, step).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Layout:
    """How an optimizer step's global batch is laid out: ``processes`` x ``grad_accum`` micro-batches of
    ``batch_size`` samples."""

    processes: int
    batch_size: int
    grad_accum: int

    @property
    def global_batch(self) -> int:
        return self.processes * self.batch_size * self.grad_accum

    @property
    def per_rank(self) -> int:
        """Samples one rank reads per optimizer step."""
        return self.batch_size * self.grad_accum

    def words(self) -> str:
        return (f"{self.processes} process(es) x data.batch_size={self.batch_size} x run.grad_accum="
                f"{self.grad_accum} = global batch {self.global_batch}")

    @classmethod
    def of_checkpoint(cls, trainer: dict[str, Any]) -> Layout | None:
        """The layout a checkpoint's ``state/trainer.json`` was written with (None: it does not record one)."""
        config = trainer.get("config") or {}
        batch, accum = (config.get("data") or {}).get("batch_size"), (config.get("run") or {}).get("grad_accum")
        if batch is None or accum is None or trainer.get("world_size") is None:
            return None
        return cls(int(trainer["world_size"]), int(batch), int(accum))


def reader_as_rank(reader: Any, rank: int, world_size: int) -> Any:
    """A shallow copy of a training reader (``ShardDataset`` / ``MemoryReader``) that reads rank ``rank``'s share
    of ``world_size`` ranks (the same data, shards and seed)."""
    clone = copy.copy(reader)
    clone.rank, clone.world_size = rank, world_size
    return clone


def _joined(parts: list[Any]) -> Any:
    """Micro-batches (tuples of tensors, or of lists such as the samples' keys) joined along the batch."""
    fields = []
    for values in zip(*parts, strict=True):
        first = values[0]
        fields.append(torch.cat(values) if isinstance(first, torch.Tensor) else [v for part in values for v in part])
    return type(parts[0])(fields) if isinstance(parts[0], tuple | list) else fields


def _sliced(batch: Any, start: int, end: int) -> Any:
    return type(batch)(field[start:end] for field in batch)


def relaid_batches(reader: Any, old: Layout, new: Layout, rank: int, epoch: int, steps_done: int) -> Iterator[Any]:
    """Rank ``rank``'s micro-batches (of ``new.batch_size``) for the rest of ``epoch`` after ``steps_done`` of its
    optimizer steps, read as layout ``old`` planned the epoch: each step's global batch is the old ranks' micro-
    batches in rank-major order, and this rank takes its contiguous ``new.per_rank`` slice of it (reading only the
    old ranks that slice covers)."""
    if old.global_batch != new.global_batch:
        raise ValueError(f"layouts of different global batches: {old.words()} vs {new.words()}")
    start, end = rank * new.per_rank, (rank + 1) * new.per_rank
    covering = range(start // old.per_rank, (end - 1) // old.per_rank + 1)
    streams = {p: iter(reader_as_rank(reader, p, old.processes).batches(
        old.batch_size, epoch, skip=steps_done * old.grad_accum)) for p in covering}
    offset = covering[0] * old.per_rank
    while True:
        try:
            parts = [next(streams[p]) for p in covering for _ in range(old.grad_accum)]
        except StopIteration:  # the old layout's epoch is over
            return
        mine = _sliced(_joined(parts), start - offset, end - offset)
        for m in range(new.grad_accum):
            yield _sliced(mine, m * new.batch_size, (m + 1) * new.batch_size)


def relaid_seed(seed: int, rank: int, step: int) -> int:
    """The random stream of rank ``rank`` resumed at ``step`` on another layout: distinct for every (seed, rank,
    step), within torch's and numpy's 32-bit seeds."""
    digest = hashlib.sha256(f"patchplace-relayout-{seed}-{rank}-{step}".encode()).digest()
    return int.from_bytes(digest[:4], "little")
