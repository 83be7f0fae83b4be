"""Evaluation helpers that several entry points share: the first images of a split (controls.py's probe set,
evaluate.py's method curves), the linear probe with a progress bar (controls.py), MJP's Fig. 5 grid of
gradient-inversion reconstructions (evaluate.py's ``privacy.png``, the study's privacy figure); and evaluate.py's
streamed probes across processes: each process's share of a split (:func:`share_batches`), the feature stores
built from the shares (:func:`store_split`) and the layer-wise kNN split over processes (:func:`knn_per_layer`)."""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from patchplace.data.memory import MemoryReader
from patchplace.finetune import FeatureStore, FeatureWriter, knn_vote_counts, linear_probe, merge_parts


def first_images(dataset, n: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys, seen = [], [], 0
    for x, y in dataset.batches(batch_size, epoch=0):
        xs.append(x)
        ys.append(y)
        seen += len(x)
        if seen >= n:
            break
    return torch.cat(xs)[:n], torch.cat(ys)[:n]


def probe(desc: str, *args: Any, epochs: int, **kwargs: Any) -> dict[str, float]:
    """:func:`linear_probe` with a progress bar over its epochs."""
    from tqdm import tqdm

    with tqdm(total=epochs, desc=desc, unit="epoch", leave=False) as bar:
        return linear_probe(*args, epochs=epochs, progress=bar.update, **kwargs)


def plot_privacy_grid(originals: np.ndarray, shuffled: np.ndarray, recs_a: dict[str, np.ndarray],
                      recs_b: dict[str, np.ndarray], path: Path, title: str) -> None:
    """MJP Fig. 5 style grid, one column per image (N, C, H, W in [0, 1]): the originals x, each reconstruction of
    the update on x (setting (a)), the jigsaw x~, each reconstruction of the update on x~ (setting (b))."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [("x", originals), *((f"(a) {k}", v) for k, v in recs_a.items()), ("x~ (jigsaw)", shuffled),
            *((f"(b) {k}", v) for k, v in recs_b.items())]
    n = len(originals)
    fig, axes = plt.subplots(len(rows), n, figsize=(0.9 * n + 1.6, 0.95 * len(rows)), squeeze=False)
    for r, (name, images) in enumerate(rows):
        for i in range(n):
            image = images[i].transpose(1, 2, 0)  # (H, W, C): one channel drawn gray, three as RGB
            axes[r, i].imshow(image[..., 0] if image.shape[-1] == 1 else image.clip(0, 1), cmap="gray", vmin=0,
                              vmax=1)
            axes[r, i].set_xticks([])
            axes[r, i].set_yticks([])
        axes[r, 0].set_ylabel(name, fontsize=6, rotation=0, ha="right", va="center")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- streamed probes
@dataclass
class Ranks:
    """The processes an evaluation runs on: this one's ``rank`` of ``world``, a ``barrier`` and ``total`` (the sum
    of a tensor over every process, back on the CPU)."""

    rank: int = 0
    world: int = 1
    barrier: Callable[[], None] = lambda: None
    total: Callable[[torch.Tensor], torch.Tensor] = lambda t: t

    @property
    def main(self) -> bool:
        return self.rank == 0


def split_size(reader) -> int:
    """Samples of the split a reader reads (the whole split, whichever process reads it)."""
    return len(reader.split) if isinstance(reader, MemoryReader) else sum(reader.counts)


def share_batches(reader, positions: torch.Tensor, batch_size: int, rank: int = 0, world: int = 1
                  ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]]:
    """This process's share of the samples at ``positions`` (sorted indices into the split's manifest order), as
    ``(inputs, labels, positions, keys)`` batches, every sample read once across processes and workers. The batches
    are fixed blocks of ``batch_size`` positions — of the split in memory, of each shard streamed — dealt out
    round-robin (whole shards to the slots when there are enough, else blocks), so a sample is computed in the same
    batch on any number of processes (and the same float sums: the same numbers)."""
    if isinstance(reader, MemoryReader):
        for block in positions.split(batch_size)[rank::world]:
            on_device = block.to(reader.device)
            x = reader.inputs[on_device]
            if reader.transform is not None:
                x = reader.transform(x, on_device, reader.seed, 0)
            yield x, reader.labels[on_device].cpu(), block, [reader.split.keys[i] for i in block.tolist()]
        return
    share = ShardShare(reader, positions, batch_size, rank, world)
    yield from DataLoader(share, batch_size=None, num_workers=reader.num_workers, persistent_workers=False,
                          pin_memory=getattr(reader, "pin_memory", False))


class ShardShare(IterableDataset):
    """Blocks of a streamed split for one process: block ``b`` of shard ``s`` holds the ``b``-th ``batch_size``
    wanted positions of ``s``; slot ``rank * workers + worker`` reads whole shards (the k-th shard with wanted
    samples goes to slot ``k % slots``) when there are at least as many as slots, else blocks (``j % slots``,
    each reader then skipping, undecoded, the samples that are not its own)."""

    def __init__(self, reader, positions: torch.Tensor, batch_size: int, rank: int, world: int) -> None:
        self.reader, self.workers = reader, max(reader.num_workers, 1)
        self.rank, slots = rank, world * self.workers
        starts = [0, *itertools.accumulate(reader.counts)]
        blocks = []  # (shard, shard's first position, local indices)
        for shard, (start, end) in enumerate(itertools.pairwise(starts)):
            local = positions[(positions >= start) & (positions < end)] - start
            blocks += [(shard, start, block) for block in local.split(batch_size) if len(block)]
        shards = sorted({shard for shard, _, _ in blocks})
        if len(shards) >= slots:
            slot_of = {shard: k % slots for k, shard in enumerate(shards)}
            self.slots = [[b for b in blocks if slot_of[b[0]] == s] for s in range(slots)]
        else:
            self.slots = [blocks[s::slots] for s in range(slots)]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]]:
        info = get_worker_info()
        mine = self.slots[self.rank * self.workers + (info.id if info is not None else 0)]
        for shard, group in itertools.groupby(mine, key=lambda b: b[0]):
            group = list(group)
            yield from self._shard_blocks(shard, group[0][1], [block for _, _, block in group])

    def _shard_blocks(self, shard: int, start: int, blocks: list[torch.Tensor]) -> Iterator[tuple]:
        """The wanted blocks of one shard, each yielded once its last sample is decoded."""
        where = {int(i): b for b, block in enumerate(blocks) for i in block}
        last, found = max(where), [[] for _ in blocks]
        for index, sample in enumerate(self.reader._read_shard(shard)):
            if index > last:
                break
            b = where.get(index)
            if b is None:
                continue
            x, label = self.reader._prepare(sample)[:2]
            found[b].append((x, label, start + index, sample["__key__"]))
            if len(found[b]) == len(blocks[b]):
                xs, labels, positions, keys = zip(*found[b], strict=True)
                yield torch.stack(xs), torch.tensor(labels), torch.tensor(positions), list(keys)
                found[b] = []


def ordered_batches(reader, positions: torch.Tensor, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(inputs, labels)`` of ``positions`` (sorted) in blocks of ``batch_size`` in manifest order, read on this
    process: the same batches, in the same order, from a split in memory and from streamed shards (whatever their
    sizes and the loader's workers), so that a probe trained batch by batch (the position probe, with its masks
    drawn batch by batch) gives one answer on either reader. Streamed, the samples read ahead of the block being
    filled wait (the loader's workers read their shards side by side: about a shard a worker at most)."""
    if isinstance(reader, MemoryReader):
        for x, y, _, _ in share_batches(reader, positions, batch_size):
            yield x, y
        return
    blocks, waiting, b = positions.split(batch_size), {}, 0
    for x, y, where, _ in share_batches(reader, positions, batch_size):
        waiting.update(zip(where.tolist(), zip(x, y.tolist(), strict=True), strict=True))
        while b < len(blocks) and all(int(p) in waiting for p in blocks[b]):
            samples = [waiting.pop(int(p)) for p in blocks[b]]
            yield torch.stack([x for x, _ in samples]), torch.tensor([y for _, y in samples])
            b += 1


def leading_images(reader, n: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` samples of a split in manifest order (:func:`ordered_batches`: the same on either reader)."""
    count = min(n, split_size(reader), reader.epoch_length or n)
    xs, ys = zip(*ordered_batches(reader, torch.arange(count), batch_size), strict=True)
    return torch.cat(xs), torch.cat(ys)


def split_keys(reader, rows: int, labels: list[np.ndarray], size: int = 4096
               ) -> Iterator[tuple[int, list[str]]] | None:
    """``(start, keys)`` chunks of the first ``rows`` samples of a split in manifest order, without decoding a
    sample: the keys of a split in memory, or the tar headers of local shards (each ``.cls`` member's few bytes
    appended to ``labels``). None for shards read by URL (their keys cost a download: they are matched once the
    features are stored)."""
    if isinstance(reader, MemoryReader):
        keys, found = reader.split.keys[:rows], reader.split.labels[:rows].cpu().numpy()
        labels.append(found)
        return ((start, keys[start:start + size]) for start in range(0, len(keys), size))
    if any("://" in str(url) for url in reader.urls):
        return None
    return _tar_keys(reader.urls, reader.manifest.fields.get("label", "cls"), rows, labels, size)


def _tar_keys(paths: list[str], label: str, rows: int, labels: list[np.ndarray], size: int
              ) -> Iterator[tuple[int, list[str]]]:
    import tarfile

    keys, found, start = [], [], 0
    for path in paths:
        with tarfile.open(path, "r") as tar:  # (a compressed shard too)
            for member in tar:  # headers only: the reader seeks over each member's data
                key, _, ext = member.name.rpartition("/")[2].partition(".")
                if ext == label:
                    keys.append(member.name.rpartition("/")[0] + ("/" if "/" in member.name else "") + key)
                    found.append(int(tar.extractfile(member).read()))
                if len(keys) == size or start + len(keys) == rows:
                    labels.append(np.asarray(found, dtype=np.int64))
                    yield start, keys
                    start, keys, found = start + len(keys), [], []
                    if start == rows:
                        return
    if keys:
        labels.append(np.asarray(found, dtype=np.int64))
        yield start, keys


class SharedBatches:
    """A share of a split behind the ``batches(batch_size, epoch)`` interface of the readers (for ``classify``)."""

    def __init__(self, reader, positions: torch.Tensor, ranks: Ranks) -> None:
        self.reader, self.positions, self.ranks = reader, positions, ranks

    def batches(self, batch_size: int, epoch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for x, y, _, _ in share_batches(self.reader, self.positions, batch_size, self.ranks.rank, self.ranks.world):
            yield x, y


def store_split(split: str, reader, positions: torch.Tensor, names: list[str], extract: Callable, folder: Path,
                ranks: Ranks, batch_size: int) -> FeatureStore:
    """The features ``names`` of ``positions`` of a split in a :class:`FeatureStore` under ``folder``: every process
    extracts its share (``extract(inputs) -> {name: rows}``), then each merges its share of the features (the
    main process the labels / keys) in manifest order; the parts are removed once merged."""
    from tqdm import tqdm

    with FeatureWriter(folder, ranks.rank) as writer, tqdm(
            total=-(-len(positions) // ranks.world), desc=f"features of {split}", unit="sample", leave=False,
            disable=not ranks.main) as bar:
        for x, y, where, keys in share_batches(reader, positions, batch_size, ranks.rank, ranks.world):
            writer.append(extract(x), y, where, keys)
            bar.update(len(y))
    ranks.barrier()
    merge_parts(folder, ranks.world, len(positions), split, rank=ranks.rank, names=names, meta=ranks.main)
    ranks.barrier()
    shutil.rmtree(folder / f"part-{ranks.rank}", ignore_errors=True)
    return FeatureStore(folder)


KNN_TEST_BYTES = 512 << 20  # test features a kNN pass holds (more: the training features are read again)


def knn_per_layer(train: FeatureStore, rows: np.ndarray, test: FeatureStore, layers: int, num_classes: int,
                  ranks: Ranks, device, block: int = 256, chunk: int | None = None) -> dict[int, float]:
    """MP3 App. C's layer-wise kNN top-1 from the stores: the test samples in fixed blocks of ``block`` dealt
    round-robin to the processes, each block voted on against the training ``rows`` ``chunk`` at a time
    (default: :meth:`FeatureStore.chunk_rows`; :func:`knn_vote_counts`); a process holds at most
    :data:`KNN_TEST_BYTES` of its test features at once (one pass over the training rows each), so memory is
    bounded whatever the splits' sizes. The correct counts are summed over processes (the same as one process: a
    test sample's vote does not depend on its group)."""
    mine = [np.arange(s, min(s + block, len(test))) for s in range(0, len(test), block)][ranks.rank::ranks.world]
    counts = []
    for layer in range(1, layers + 1):
        name = f"block{layer}"
        per_pass = max(1, KNN_TEST_BYTES // (4 * block * max(int(test.dims[name]), 1)))
        correct = 0
        for start in range(0, len(mine), per_pass):
            correct += knn_vote_counts(train.chunks(name, rows, chunk),
                                       [test.rows(name, b) for b in mine[start:start + per_pass]],
                                       num_classes=num_classes, device=device)[1]
        counts.append(correct)
    summed = ranks.total(torch.tensor(counts, dtype=torch.int64))
    return {layer: int(n) / max(len(test), 1) for layer, n in zip(range(1, layers + 1), summed.tolist(), strict=True)}
