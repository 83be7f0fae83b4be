"""Streamed epochs keep the recipe: on 2 real CPU processes x 2 DataLoader workers over uneven shards, every sample
is read once per epoch (but for the few a printed line names), every step has the full per-process batch under
data.drop_last, and a streamed run refuses to resume with another data.num_workers (it plans the epochs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from patchplace.data import ShardDataset, SplitWriter
from patchplace.pipelines.config import ConfigError
from patchplace.pipelines.engine import inputs
from patchplace.pipelines.engine.rundir import prepare_directory
from patchplace.pipelines.sections import DataSection

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
DRIVER = str(ROOT / "tests" / "streaming_epochs_driver.py")


def uneven(root: Path, n: int) -> Path:
    """``n`` samples in shards of 10: 6 x 10 + 4 for 64 (the issue's), 6 x 10 + 7 for 67."""
    rng = np.random.default_rng(0)
    with SplitWriter(root, "train", dataset="toy", modality="image", classes=["a", "b", "c"],
                     info={"image_size": [28, 28], "channels": 1}, source="test", recipe="test", recipe_version=1,
                     max_count=10) as w:
        for i in range(n):
            w.add_image(f"{i:04d}", i % 3, rng.integers(0, 256, (28, 28), dtype=np.uint8))
    return root / "train"


# (n, data.drop_last, samples seen per epoch, each rank's batch sizes)
CASES = [
    (64, True, 64, [8, 8, 8, 8]),  # the shards: before, 58 / 64 and 56 / 64 seen, batches [8, 8, 8, 4, 1]
    (67, True, 64, [8, 8, 8, 8]),  # 1 left out so both ranks read 33, 2 x 1 of ragged tails
    (67, False, 66, [8, 8, 8, 8, 1]),  # the ragged tail kept: one short batch per rank, the same on both
]


def read_epochs(reads: list[tuple[Path, Path, bool]], epochs: int = 2) -> list[list[dict]]:
    """Each ``(split, out, drop_last)`` read on 2 processes x 2 workers, all in one launch; per read, each rank's
    record."""
    command = [ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
               "no", "--dynamo_backend", "no", "--main_process_port", "0", DRIVER]
    for split, out, drop_last in reads:
        command += [str(split), str(out), "2", "8", "1" if drop_last else "0", str(epochs)]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return [[json.loads((out / f"rank{r}.json").read_text()) for r in range(2)] for _, out, _ in reads]


@pytest.fixture(scope="module")
def splits(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("uneven")
    return {n: uneven(root / str(n), n) for n in (64, 67)}


@pytest.fixture(scope="module")
def launched_reads(splits, tmp_path_factory) -> list[list[dict]]:
    """Every case of :data:`CASES` read in one launch of 2 processes."""
    root = tmp_path_factory.mktemp("epochs")
    return read_epochs([(splits[n], root / str(i), drop_last) for i, (n, drop_last, _, _) in enumerate(CASES)])


@pytest.mark.parametrize("n, drop_last, seen, sizes", CASES)
def test_two_processes_two_workers_read_every_sample_once_in_full_batches(launched_reads, n, drop_last, seen,
                                                                          sizes):
    ranks = launched_reads[CASES.index((n, drop_last, seen, sizes))]
    for epoch in range(2):
        keys = ranks[0]["keys"][epoch] + ranks[1]["keys"][epoch]
        assert len(keys) == len(set(keys)) == seen, f"epoch {epoch}"
        assert ranks[0]["sizes"][epoch] == ranks[1]["sizes"][epoch] == sizes, f"epoch {epoch}"
    assert ranks[0]["dropped"] == n - seen
    assert ranks[0]["batches"] == len(sizes)


def test_the_samples_left_out_are_printed_at_start(splits):
    cfg = DataSection(train=str(splits[67]), val=str(splits[67]), batch_size=8, num_workers=0, in_memory=False)
    lines: list[str] = []
    accelerator = SimpleNamespace(process_index=0, num_processes=1, device="cpu", print=lines.append)
    data = inputs.build_data(cfg, accelerator, seed=0)
    assert "data.train: 3 of 67 samples left out per epoch (0 so that 1 process(es) read as many, 3 of ragged " \
           "last batches under data.drop_last=true)" in lines
    assert data.train.num_batches(8) == 8 and data.val.num_batches(8) == 9  # evaluation reads every sample


def test_data_drop_last_is_validated():
    with pytest.raises(ConfigError, match=r"data\.drop_last: expected bool, got 'yes'"):
        DataSection(drop_last="yes").validate()


def test_the_plan_depends_on_num_workers(splits):
    """Why data.num_workers cannot change on resume: the epoch stream of a rank differs with it."""
    def stream(workers: int) -> list[str]:
        ds = ShardDataset(splits[64], shuffle_buffer=16, num_workers=workers, world_size=2, return_key=True,
                          decode=True, batch_size=8, drop_last=True)
        return [k for _, _, ks in ds.batches(8, 0) for k in ks]
    assert stream(0) != stream(2)


@pytest.mark.parametrize("train, resumable", [("streaming", False), ("memory", True)])
def test_a_streamed_run_resumes_only_with_its_num_workers(tmp_path, train, resumable):
    config = {"data": {"num_workers": 2, "in_memory": "auto"}, "run": {"resume": False}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "log.jsonl").write_text(json.dumps({"step": 1, "data": {"train": train, "val": "memory"}}) + "\n")
    changed = {"data": {"num_workers": 0, "in_memory": "auto"}, "run": {"resume": True}}
    if resumable:
        prepare_directory(tmp_path, resume=True, overwrite=False, config=changed)
        return
    with pytest.raises(ConfigError) as error:
        prepare_directory(tmp_path, resume=True, overwrite=False, config=changed)
    assert "data.num_workers was 2" in str(error.value) and "\n" not in str(error.value)
    prepare_directory(tmp_path, resume=True, overwrite=False, config={**changed, "data": config["data"]})
