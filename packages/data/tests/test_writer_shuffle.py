"""write_planned_split: whole shards per worker process, byte-identical to one process and to SplitWriter."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from patchplace.data import DataError, SplitWriter
from patchplace.data.parallel import plan_shards, write_planned_split

KW = dict(dataset="toy", classes=["a", "b", "c"], info={"image_size": [6, 6], "channels": 1}, source="test",
          recipe="test", recipe_version=1)


def toy_record(i: int) -> tuple[str, int, np.ndarray, None]:
    """Module level: pickled by name into the worker processes."""
    return f"{i:05d}", i % 3, np.random.default_rng(i).integers(0, 256, (6, 6), dtype=np.uint8), None


def tree(root: Path) -> dict[str, str]:
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(root.rglob("*"))
            if f.is_file()}


def test_plan_cuts_as_the_shard_writer_does():
    assert plan_shards([1] * 7, 3, 1e9) == [range(0, 3), range(3, 6), range(6, 7)]
    assert plan_shards([5, 5, 5, 1, 1], 10, 10) == [range(0, 2), range(2, 5)]  # a shard ends once >= max_size
    with pytest.raises(DataError, match="max_count must be >= 1"):
        plan_shards([1], 0, 1)


def test_workers_give_the_bytes_of_one_process_and_of_split_writer(tmp_path):
    items = list(np.random.default_rng(0).permutation(50).tolist())
    manifests = [write_planned_split(tmp_path / f"w{n}", "train", items, toy_record, workers=n, max_count=8,
                                     progress=False, **KW) for n in (1, 2)]
    assert tree(tmp_path / "w1") == tree(tmp_path / "w2") and len(manifests[0].shards) == 7
    assert manifests[0].class_counts == [17, 17, 16] and manifests[0].normalization["computed_on"] == "train"
    with SplitWriter(tmp_path / "seq", "train", modality="image", max_count=8, **KW) as w:
        for i in items:
            w.add_image(*toy_record(i)[:3])
    assert w.manifest.shards == manifests[0].shards and w.manifest.class_counts == manifests[0].class_counts
    assert np.allclose(w.manifest.normalization["mean"], manifests[0].normalization["mean"], atol=2e-6)


def test_a_failing_worker_leaves_no_split(tmp_path):
    with pytest.raises(DataError, match="duplicate sample key '00001'"):
        write_planned_split(tmp_path, "train", [1, 2, 1], toy_record, workers=2, max_count=1, progress=False,
                            **KW)
    assert not (tmp_path / "train").exists() and not list(tmp_path.iterdir())
