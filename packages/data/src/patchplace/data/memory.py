"""In-memory splits: a split whose decoded size fits a memory budget is read once from its shards (with the same
checks as streaming: each shard's size and sha256 and its count against the manifest, each image's size against the
manifest's ``image_size``, the shard named on error) into one tensor of inputs
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
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from tqdm import tqdm

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
    skipped: list[str] = field(default_factory=list)  # corrupt shards left out (``skip_corrupt=True``)

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, indices: torch.Tensor) -> InMemorySplit:
        """The samples at ``indices`` (e.g. :func:`balanced_subset`), in that order."""
        index = indices.tolist()
        return InMemorySplit(self.inputs[indices], self.labels[indices], [self.keys[i] for i in index],
                             self.manifest, self.skipped)

    @classmethod
    def load(cls, manifest: str | os.PathLike | Manifest, budget_bytes: int | None = None, *,
             urls: str | list[str] | None = None, skip_corrupt: bool = False, num_workers: int = 0,
             verify: bool = True, progress: bool | None = None) -> InMemorySplit:
        """Read every shard once into manifest order. ``budget_bytes``: refuse (DataError) a split that does not
        fit. ``urls``: the same shards elsewhere (as :class:`ShardDataset`); ``skip_corrupt``: leave out unreadable
        or altered shards (warned, listed in ``skipped``) instead of failing on the first one; ``num_workers``:
        decode that many shards at once in worker processes; ``verify``: check each shard's size and sha256 against
        the manifest before decoding it (``False`` trusts the bytes). ``progress`` (None: on the main process only,
        rank 0 of a distributed run): a tqdm bar over the samples on stderr when it is a terminal, else a line on
        stdout when the decoding starts and one when it ends (a large split takes a minute)."""
        m = manifest if isinstance(manifest, Manifest) else Manifest.load(manifest)
        need = decoded_bytes(m)
        if need is None:
            raise DataError(f"{m.dataset}/{m.split}: its manifest gives no fixed image size / clip length, so it "
                            "cannot be held as one tensor; stream it from its shards")
        if budget_bytes is not None and need > budget_bytes:
            raise DataError(f"{m.dataset}/{m.split} takes {need / 2**20:.0f} MiB decoded, more than the memory "
                            f"budget of {budget_bytes / 2**20:.0f} MiB; stream it from its shards or raise the budget")
        reader = ShardDataset(m, urls=urls, return_key=True, skip_corrupt=skip_corrupt, verify=verify)
        decoded = _decode_shards(reader, min(num_workers, len(reader.urls)),
                                 _main_process() if progress is None else progress)
        shards = [decoded[i] for i in sorted(decoded) if decoded[i].keys]
        skipped = [url for i in sorted(decoded) for url in decoded[i].skipped]
        keys = [k for shard in shards for k in shard.keys]
        if not keys:
            raise DataError(f"{m.dataset}/{m.split}: no readable sample (skipped shards: {skipped})")
        if len(keys) != m.num_samples and not skipped:
            raise DataError(f"{m.dataset}/{m.split}: read {len(keys)} samples, the manifest says {m.num_samples}")
        shapes = {tuple(shard.inputs.shape[1:]) for shard in shards}
        if len(shapes) != 1:
            raise DataError(f"{m.dataset}/{m.split}: samples of {len(shapes)} shapes ({sorted(shapes)[:3]}...); "
                            "stream it from its shards")
        return cls(torch.cat([s.inputs for s in shards]), torch.cat([s.labels for s in shards]), keys, m, skipped)


@dataclass
class _Shard:
    """One shard, decoded: stacked inputs (one tensor to pass between processes), labels, keys, skipped URLs."""

    index: int
    inputs: torch.Tensor
    labels: torch.Tensor
    keys: list[str]
    skipped: list[str]
    error: DataError | None = None  # what stopped the decoding (the worker stops there), e.g. a RemoteError


def _decode_shards(reader: ShardDataset, workers: int, progress: bool = False) -> dict[int, _Shard]:
    """Every shard of ``reader``, decoded (in ``workers`` processes), its progress shown (:func:`_progress`) when
    ``progress``. Workers hand a DataError back as a shard's ``error`` rather than raising it, so the loader ends
    normally and shuts its workers down at once (an exception from a worker left them to the garbage collector,
    which stalled for 5 s)."""
    decoded: dict[int, _Shard] = {}
    with _progress(reader.manifest, len(reader.urls), workers, progress) as advance:
        for shard in DataLoader(_ShardDecoder(reader), batch_size=None, num_workers=workers):
            decoded[shard.index] = shard
            advance(len(shard.keys))
        errors = [decoded[i].error for i in sorted(decoded) if decoded[i].error is not None]
        if errors:  # (before the progress ends: no "decoded" line)
            raise errors[0]
    return decoded


def _main_process() -> bool:
    """Whether this process is the one that reports: rank 0 of a distributed run (torch.distributed, else the
    ``RANK`` a launcher sets), or a process on its own."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


@contextmanager
def _progress(manifest: Manifest, shards: int, workers: int, show: bool) -> Iterator[Callable[[int], None]]:
    """``advance(samples)`` for each decoded shard: a tqdm bar over the split's samples on stderr when it is a
    terminal; else a line on stdout as the decoding starts and one as it ends (none after an error)."""
    if not show:
        yield lambda samples: None
        return
    name = f"{manifest.dataset}/{manifest.split}"
    if getattr(sys.stderr, "isatty", lambda: False)():
        with tqdm(total=manifest.num_samples, desc=f"{name}: decoding into memory", unit="sample",
                  file=sys.stderr) as bar:
            yield bar.update
        return
    done, started = [0], time.perf_counter()
    print(f"{name}: decoding {manifest.num_samples} samples from {shards} shard(s) into memory "
          f"({workers or 'no'} worker process(es)) ...", flush=True)
    yield lambda samples: done.__setitem__(0, done[0] + samples)
    print(f"{name}: decoded {done[0]} samples in {time.perf_counter() - started:.1f} s", flush=True)


class _ShardDecoder(IterableDataset):
    """Decodes whole shards (worker w of W: shards w, w + W, ...) with the reader's corruption checks."""

    def __init__(self, reader: ShardDataset) -> None:
        self.reader = reader

    def __iter__(self) -> Iterator[_Shard]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for index in range(worker, len(self.reader.urls), workers):
            try:
                yield self._decode(index)
            except DataError as exc:  # handed back, not raised: see _decode_shards
                yield _Shard(index, torch.empty(0), torch.empty(0, dtype=torch.int64), [], [], error=exc)
                return

    def _decode(self, index: int) -> _Shard:
        reader, image = self.reader, self.reader.manifest.modality == "image"
        before = len(reader.skipped)
        samples = [reader._prepare(sample) for sample in reader._read_shard(index)]
        skipped = reader.skipped[before:]
        if skipped:  # a corrupt shard left out whole (the samples before the damage too)
            samples = []
        if not samples:
            return _Shard(index, torch.empty(0), torch.empty(0, dtype=torch.int64), [], skipped)
        if len({tuple(x.shape) for x, _, _ in samples}) != 1:
            m = reader.manifest
            if m.modality == "audio":  # clips are brought to clip_samples where they are written, not here
                raise DataError(f"{reader.urls[index]}: clips of several lengths, though the manifest's clip_samples "
                                f"is {m.info.get('clip_samples')}: rebuild the split with its data/ recipe (data/"
                                "speech_commands.py pads every clip to 1 s since its recipe_version 2; this one is "
                                f"{m.recipe} {m.recipe_version}), or stream it (data.in_memory=false)")
            raise DataError(f"{reader.urls[index]}: samples of several shapes; stream this split")
        inputs = torch.stack([x if image else x.to(torch.float32) for x, _, _ in samples])
        return _Shard(index, inputs, torch.tensor([y for _, y, _ in samples], dtype=torch.int64),
                      [k for _, _, k in samples], skipped)


def balanced_subset(labels: torch.Tensor, fraction: float, seed: int = 0) -> torch.Tensor:
    """Sorted indices of a class-balanced ``fraction`` of a split (the SSL label-efficiency protocol: 1% / 10% of
    the labels): from each class ``max(1, round(fraction * its count))`` samples, drawn by a permutation seeded by
    ``seed`` and the class alone — the same subset for every method and run that asks for it."""
    if not 0 < fraction <= 1:
        raise DataError(f"a label fraction must be in (0, 1], got {fraction}")
    chosen = []
    for cls in labels.unique().tolist():
        members = (labels == cls).nonzero().squeeze(1)
        order = torch.randperm(len(members), generator=torch.Generator().manual_seed(seed * 1_000_003 + cls))
        chosen.append(members[order[:max(1, round(fraction * len(members)))]])
    return torch.cat(chosen).sort().values


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


class MemoryReader:
    """The in-memory counterpart of :class:`ShardDataset` for training / evaluation loops: the same
    ``batches(batch_size, epoch, skip)`` interface, ``num_batches``, ``len``, ``manifest``, ``skipped``,
    ``epoch_length`` and ``return_key``; batches come out on ``device``, already transformed.

    ``transform(inputs, index, seed, epoch)`` is a batched transform (:mod:`patchplace.data.batched`) whose
    randomness is keyed by each sample's index in the split. ``shuffle=True`` (training): each epoch a fresh
    permutation from (seed, epoch), this rank's slice of it (:func:`epoch_indices`); ``shuffle=False``
    (evaluation): the split in manifest order. ``epoch_length`` caps the samples per rank per epoch.
    """

    def __init__(self, split: InMemorySplit, transform: Callable[..., torch.Tensor] | None, *, seed: int = 0,
                 rank: int = 0, world_size: int = 1, shuffle: bool = True, device: torch.device | str = "cpu",
                 epoch_length: int | None = None, return_key: bool = False) -> None:
        self.split, self.seed, self.rank, self.world_size, self.shuffle = split, seed, rank, world_size, shuffle
        self.device = torch.device(device)
        self.inputs, self.labels = split.inputs.to(self.device), split.labels.to(self.device)
        self.transform = transform.to(self.device) if hasattr(transform, "to") else transform
        self.epoch_length, self.return_key = epoch_length, return_key
        self.num_workers = 0  # (no worker processes)
        self.drop_last = False  # training readers: no ragged last batch (``batches``, ``num_batches``)
        if len(split) // world_size < 1:
            raise DataError(f"{len(split)} samples cannot be split over {world_size} ranks")

    @property
    def manifest(self) -> Manifest:
        return self.split.manifest

    @property
    def skipped(self) -> list[str]:
        return self.split.skipped

    def __len__(self) -> int:
        """Samples this rank reads per epoch."""
        per_rank = len(self.split) // self.world_size if self.shuffle else len(self.split)
        return min(per_rank, self.epoch_length) if self.epoch_length is not None else per_rank

    def num_batches(self, batch_size: int, drop_last: bool | None = None) -> int:
        drop_last = self.drop_last if drop_last is None else drop_last
        return len(self) // batch_size if drop_last else -(-len(self) // batch_size)

    def indices(self, epoch: int) -> torch.Tensor:
        """This rank's sample indices for ``epoch``, in reading order."""
        if self.shuffle:
            order = epoch_indices(len(self.split), seed=self.seed, epoch=epoch, rank=self.rank,
                                  world_size=self.world_size)
        else:
            order = torch.arange(len(self.split))
        return order[:len(self)]

    def batches(self, batch_size: int, epoch: int, skip: int = 0) -> Iterator[Any]:
        """``(inputs, labels)`` (plus the samples' keys when ``return_key``) per batch, on ``device``; the first
        ``skip`` batches are not computed at all (a resume jumps straight to its step)."""
        order = self.indices(epoch)
        end = len(order) // batch_size * batch_size if self.drop_last else len(order)
        for start in range(skip * batch_size, end, batch_size):
            index = order[start:start + batch_size]
            on_device = index.to(self.device)
            x = self.inputs[on_device]
            if self.transform is not None:
                x = self.transform(x, on_device, self.seed, epoch)
            y = self.labels[on_device]
            yield (x, y, [self.split.keys[i] for i in index.tolist()]) if self.return_key else (x, y)
