"""Write a split from a planned sample order with ``workers`` processes, byte-identical to one process.

The order of the samples and their assignment to shards are fixed before anything is written (:func:`plan_shards`:
``max_count`` samples, or ``max_size`` payload bytes as :class:`SplitWriter` counts them, per shard), so each worker
writes whole shards (``<split>-NNNNNN.tar``, through a :class:`SplitWriter` of one shard: the same checks and the
same tar bytes) and the manifest is assembled in shard order: the shards, their sha256, the counts and the
statistics do not depend on how many processes wrote them.

    manifest = write_planned_split(out, "train", items, make_record, workers=8, sizes=file_sizes, dataset=...,
                                   modality="image", classes=names, info=info, source=src, recipe="image_folder",
                                   recipe_version=2, normalization=stats)

``make_record(item) -> (key, label, uint8 image, original bytes or None)`` runs in the workers: a module-level
function (it is pickled by name), as ``items`` must be picklable.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from .atomic import atomic_dir
from .errors import DataError
from .manifest import Manifest, ShardInfo
from .remote import refuse_url
from .writer import ChannelStats, SplitWriter


def plan_shards(sizes: Sequence[int], max_count: int, max_size: float) -> list[range]:
    """Consecutive ranges of sample positions, one per shard, as :class:`SplitWriter` (webdataset's
    ``ShardWriter``) cuts them: a new shard once the current one holds ``max_count`` samples or ``max_size`` bytes
    (``sizes``: each sample's tar payload bytes, e.g. its file size + the label's digits)."""
    if max_count < 1 or max_size <= 0:
        raise DataError(f"max_count must be >= 1 and max_size > 0, got {max_count}, {max_size}")
    shards, start, count, size = [], 0, 0, 0
    for i, n in enumerate(sizes):
        if count >= max_count or size >= max_size:
            shards.append(range(start, i))
            start, count, size = i, 0, 0
        count += 1
        size += int(n)
    if count:
        shards.append(range(start, len(sizes)))
    return shards


def _write_shard(job: tuple) -> dict[str, Any]:
    """One shard, written into ``tmp`` by a one-shard SplitWriter (in a worker process, or in this one)."""
    index, tmp, split, items, make_record, kwargs = job
    scratch = Path(tmp) / f".shard-{index:06d}"
    with SplitWriter(scratch, split, max_count=len(items) + 1, max_size=float("inf"), **kwargs) as writer:
        for item in items:
            key, label, image, encoded = make_record(item)
            writer.add_image(key, label, image, encoded)
    (shard,) = writer.manifest.shards
    name = f"{split}-{index:06d}.tar"
    os.replace(scratch / split / shard.name, Path(tmp) / name)
    shutil.rmtree(scratch)
    stats = writer.stats
    return {"shard": ShardInfo(name=name, count=shard.count, sha256=shard.sha256, bytes=shard.bytes),
            "class_counts": writer.manifest.class_counts, "keys": sorted(writer._keys),
            "stats": None if stats is None else (stats.n, stats.sum, stats.sumsq)}


def write_planned_split(
    out_dir: str | os.PathLike,
    split: str,
    items: Sequence[Any],
    make_record: Callable[[Any], tuple[str, int, np.ndarray, bytes | None]],
    *,
    workers: int = 1,
    sizes: Sequence[int] | None = None,
    max_count: int = 10_000,
    max_size: float = 256e6,
    progress: bool = True,
    **writer_kwargs: Any,
) -> Manifest:
    """Write ``items`` (in this order) as image split ``<out_dir>/<split>/`` with ``workers`` processes; returns
    its manifest. ``sizes``: each item's payload bytes for the ``max_size`` cut (default: counts only);
    ``writer_kwargs``: :class:`SplitWriter`'s (``dataset``, ``classes``, ``info``, ``normalization``, ...).
    Without ``normalization`` the statistics are summed per shard, then over shards in shard order."""
    if workers < 1:
        raise DataError(f"workers must be >= 1, got {workers}")
    refuse_url(out_dir)
    if not items:
        raise DataError(f"no samples to write for {writer_kwargs.get('dataset', '?')}/{split}: check the source data")
    if sizes is not None and len(sizes) != len(items):
        raise DataError(f"{len(sizes)} sizes given for {len(items)} items")
    plan = plan_shards(sizes if sizes is not None else [0] * len(items), max_count, max_size)
    kwargs = {"modality": "image", **writer_kwargs}
    final = Path(out_dir) / split
    with atomic_dir(final) as tmp:
        jobs = [(i, str(tmp), split, [items[j] for j in shard], make_record, kwargs) for i, shard in enumerate(plan)]
        with tqdm(total=len(items), desc=f"{kwargs.get('dataset', '?')}/{split}", disable=not progress) as bar:
            results = _run_jobs(jobs, workers, bar)
        manifest = _merged_manifest(results, split, kwargs)
        manifest.save(tmp / "manifest.json")
    manifest.path = final / "manifest.json"
    return manifest


def _run_jobs(jobs: list[tuple], workers: int, bar: tqdm) -> list[dict[str, Any]]:
    """Each job's shard (:func:`_write_shard`), in shard order: in this process, or in a pool of ``workers``."""
    results = []
    if workers == 1 or len(jobs) == 1:
        for job in jobs:
            results.append(_write_shard(job))
            bar.update(results[-1]["shard"].count)
        return results
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with context.Pool(min(workers, len(jobs))) as pool:
        for result in pool.imap(_write_shard, jobs):  # shard order, whatever order they finish in
            results.append(result)
            bar.update(result["shard"].count)
    return results


def _merged_manifest(results: list[dict[str, Any]], split: str, kwargs: dict[str, Any]) -> Manifest:
    """The split's manifest from its shards' results in shard order: a key in two shards refused, the class counts
    and (without ``normalization``) the channel statistics summed."""
    seen: set[str] = set()
    class_counts = np.zeros(len(kwargs["classes"]), dtype=np.int64)
    stats = None
    for result in results:
        if duplicate := seen.intersection(result["keys"]):
            raise DataError(f"duplicate sample key {sorted(duplicate)[0]!r} in {kwargs.get('dataset')}/{split}")
        seen.update(result["keys"])
        class_counts += result["class_counts"]
        if result["stats"] is not None:
            stats = stats or ChannelStats(int(kwargs["info"].get("channels", 1)))
            stats.n += result["stats"][0]
            stats.sum += result["stats"][1]
            stats.sumsq += result["stats"][2]
    normalization = kwargs.get("normalization")
    if normalization is None and stats is not None:
        normalization = stats.result(computed_on=split)
    return Manifest(
        dataset=kwargs["dataset"], split=split, modality=kwargs["modality"], classes=list(kwargs["classes"]),
        num_samples=len(seen), shards=[r["shard"] for r in results],
        fields={"input": kwargs.get("input_ext") or "png", "label": "cls"}, info=dict(kwargs["info"]),
        source=kwargs["source"], recipe=kwargs["recipe"], recipe_version=kwargs["recipe_version"],
        normalization=normalization, class_counts=[int(c) for c in class_counts],
    )
