"""In-memory splits: a split whose decoded size fits a memory budget is read once from its shards (with the same
corruption checks as streaming: counts against the manifest, the shard named on error) into one tensor of inputs
and one of labels, then served by index — no worker processes, no per-sample decoding after the first read.

Fashion-MNIST train is 60,000 x 1 x 28 x 28 uint8 = 47 MB; the keyword corpus as float32 waveforms is
clips x 16,000 x 4 bytes. Batches are drawn by :func:`epoch_indices`: one permutation per (seed, epoch), shared
by every rank, each rank taking its own contiguous slice (disjoint, equal length).

    split = InMemorySplit.load("shards/fashion_mnist/train", budget_bytes=1 << 30)
    for index in epoch_indices(len(split), seed=0, epoch=0, rank=0, world_size=1).split(128):
        images, labels = split.inputs[index], split.labels[index]       # uint8 (B, 1, 28, 28), int64 (B,)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .errors import DataError
from .manifest import Manifest
from .reader import ShardDataset


def decoded_bytes(manifest: Manifest) -> int | None:
    """Bytes the decoded split takes in memory (uint8 images, float32 waveforms); None when the manifest does not
    say (images of varying size, clips of varying length)."""
    info, n = manifest.info, manifest.num_samples
    if manifest.modality == "image":
        size = info.get("image_size")
        return n * int(info.get("channels", 3)) * size[0] * size[1] if size else None
    clip = info.get("clip_samples")
    return n * int(clip) * 4 if clip else None


def fits_in_memory(manifest: Manifest, budget_bytes: int) -> bool:
    """Whether the decoded split is known to fit ``budget_bytes``."""
    need = decoded_bytes(manifest)
    return need is not None and need <= budget_bytes


@dataclass
class InMemorySplit:
    """A decoded split: ``inputs`` uint8 (N, C, H, W) images or float32 (N, T) waveforms, ``labels`` int64 (N,),
    ``keys`` in manifest (shard) order."""

    inputs: torch.Tensor
    labels: torch.Tensor
    keys: list[str]
    manifest: Manifest

    def __len__(self) -> int:
        return len(self.labels)

    @classmethod
    def load(cls, manifest: str | os.PathLike | Manifest, budget_bytes: int | None = None) -> InMemorySplit:
        """Read every shard once, in order. ``budget_bytes``: refuse (DataError) a split that does not fit."""
        m = manifest if isinstance(manifest, Manifest) else Manifest.load(manifest)
        need = decoded_bytes(m)
        if need is None:
            raise DataError(f"{m.dataset}/{m.split}: its manifest gives no fixed image size / clip length, so it "
                            "cannot be held as one tensor; stream it from its shards")
        if budget_bytes is not None and need > budget_bytes:
            raise DataError(f"{m.dataset}/{m.split} takes {need / 2**20:.0f} MiB decoded, more than the memory "
                            f"budget of {budget_bytes / 2**20:.0f} MiB; stream it from its shards or raise the budget")
        inputs, labels, keys = [], [], []
        for x, label, key in ShardDataset(m, return_key=True):  # manifest order; corrupt shards raise by name
            inputs.append(x if m.modality == "image" else x.to(torch.float32))
            labels.append(label)
            keys.append(key)
        if len(keys) != m.num_samples:
            raise DataError(f"{m.dataset}/{m.split}: read {len(keys)} samples, the manifest says {m.num_samples}")
        shapes = {tuple(x.shape) for x in inputs}
        if len(shapes) != 1:
            raise DataError(f"{m.dataset}/{m.split}: samples of {len(shapes)} shapes ({sorted(shapes)[:3]}...); "
                            "stream it from its shards")
        return cls(torch.stack(inputs), torch.tensor(labels, dtype=torch.int64), keys, m)


def epoch_indices(n: int, *, seed: int, epoch: int, rank: int = 0, world_size: int = 1) -> torch.Tensor:
    """This rank's sample indices for ``epoch``: a permutation of ``range(n)`` drawn from (seed, epoch) — the same
    on every rank — cut into ``world_size`` equal contiguous slices (the ``n % world_size`` last ones are left out
    of this epoch, different ones each epoch). Disjoint across ranks; deterministic."""
    if not 0 <= rank < world_size:
        raise DataError(f"rank {rank} is not in [0, {world_size})")
    per_rank = n // world_size
    if per_rank < 1:
        raise DataError(f"{n} samples cannot be split over {world_size} ranks")
    generator = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**63)
    order = torch.randperm(n, generator=generator)
    return order[rank * per_rank:(rank + 1) * per_rank]
