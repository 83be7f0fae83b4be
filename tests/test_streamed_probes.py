"""evaluate.py's streamed probes: features of streamed shards go through a store on disk, the papers' probe
protocols train from it, and the evaluation gives one result on 1 process and on 2 real processes
(``ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2``): classification, the linear probes of
the last layer and of the last-4 concatenation (MAE's LARS recipe), StoP's logistic-regression 1% probe, the
label-fraction and subset-list probes and the layer-wise kNN — exactly equal (both runs use one intra-op thread a
process: every sample is computed in the same batch, so the float sums are the same)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from pipeline_args import TINY, img, small_heads

from patchplace.data import ShardDataset
from patchplace.data.memory import InMemorySplit, MemoryReader
from patchplace.models import load_pretrained
from patchplace.pipelines import evaluate, pretrain
from patchplace.pipelines.evaluation import share_batches

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
ENV = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
LAUNCH = [ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
          "no", "--dynamo_backend", "no", "--main_process_port", "0"]
# MAE's linear-probe recipe shrunk to the toy split (the batch and epochs), the last-4 concatenation beside the
# last layer, StoP's logistic regression for the low-label probes
PROBES = ["eval.probe_layers=[last,last4]", "eval.probe_optimizer=lars", "eval.probe_lr=0.1",
          "eval.probe_lr_batch=256", "eval.probe_batch=16", "eval.probe_epochs=3", "eval.probe_warmup_epochs=1",
          "eval.probe_init_std=0.01", "eval.label_probe=logistic", "eval.low_label_fraction=0.1",
          "eval.label_fractions=[0.25]", "eval.probe_train_samples=40", "eval.max_eval_samples=8",
          "eval.consistency_ratios=[0.27]"]


@pytest.fixture(scope="module")
def classifier(shards, tmp_path_factory) -> Path:
    """A 4-block StoP backbone (one pretraining step) given a 3-class head: a checkpoint with every result."""
    root = tmp_path_factory.mktemp("streamed")
    assert pretrain.main(["method=stop", *img(shards), *TINY, *small_heads("stop"), "optim.max_steps=1",
                          "model.overrides={depth: 4}", f"run.output={root / 'pre'}"]) == 0
    backbone, metadata = load_pretrained(root / "pre" / "checkpoint")
    backbone.reset_classifier(3)
    backbone.save_pretrained(root / "cls", metadata={**metadata, "classes": ["a", "b", "c"]})
    return root / "cls"


def evaluate_args(shards: Path, checkpoint: Path, out: Path, subset: Path) -> list[str]:
    return [str(ROOT / "pipelines" / "evaluate.py"), *img(shards), "data.batch_size=8", "data.num_workers=1",
            "data.in_memory=false", f"model.checkpoint={checkpoint}", *PROBES, f"eval.label_subset_files=[{subset}]",
            "eval.keep_features=true", f"run.output={out}"]


@pytest.mark.slow
def test_streamed_probes_give_one_result_on_one_and_two_processes(shards, classifier, tmp_path, monkeypatch):
    """The one-process run in this process (one intra-op thread, as each launched process has), the two-process
    run launched."""
    subset = tmp_path / "1percent.txt"  # SimCLR-style names: the keys with an extension
    subset.write_text("".join(f"{i:04d}.png\n" for i in (3, 10, 17, 24, 31, 40)))
    result = subprocess.run([*LAUNCH, *evaluate_args(shards, classifier, tmp_path / "ev2", subset)],
                            capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert evaluate.main(evaluate_args(shards, classifier, tmp_path / "ev1", subset)[1:]) == 0
    finally:
        torch.set_num_threads(threads)
    runs = {n: json.loads((tmp_path / f"ev{n}" / "results.json").read_text()) for n in (1, 2)}
    one, two = runs[1], runs[2]
    assert one == two, {k: (v, two.get(k)) for k, v in one.items() if v != two.get(k)}
    assert one["classification"]["count"] == 32 and sum(map(sum, one["classification"]["confusion"])) == 32
    assert one["probe_train_samples"] == 40 and one["linear_probe"]["train_samples"] == 40
    assert one["linear_probe"]["recipe"]["optimizer"] == "lars"
    assert one["linear_probe"]["recipe"]["peak_lr"] == pytest.approx(0.1 * 16 / 256)
    assert one["linear_probe_last4"]["dim"] == 4 * one["linear_probe"]["dim"]
    low = one["linear_probe_low_label"]  # 10% of each class of the 40 samples, at least one
    assert low["solver"] == "logistic" and 3 <= low["train_samples"] <= 6 and low["iterations"] > 0
    assert one["linear_probe_label_fraction"]["0.25"]["train_samples"] == 16  # 64 train samples, balanced
    assert one["linear_probe_label_subset"]["1percent.txt"]["train_samples"] == 6
    assert sorted(one["knn_per_layer"]) == ["1", "2", "3", "4"]
    # the stores themselves: the same bytes, whichever process computed which sample
    for split in ("train", "val"):
        for name in ("last", "last4", "block1", "block4", "labels", "positions", "keys"):
            a, b = (np.load(tmp_path / f"ev{n}" / "features" / split / f"{name}.npy") for n in (1, 2))
            np.testing.assert_array_equal(a, b, err_msg=f"{split}/{name}")
    positions = np.load(tmp_path / "ev2" / "features" / "train" / "positions.npy")
    assert list(positions) == list(range(64)), "all of data.train (label fractions), each sample once, in order"
    assert not list((tmp_path / "ev2" / "features" / "train").glob("part-*")), "the parts are merged and removed"


def test_a_subset_list_naming_samples_the_split_lacks_is_one_line(shards, classifier, tmp_path, capsys):
    subset = tmp_path / "10percent.txt"
    subset.write_text("0001.png\nn01440764_10026.JPEG\n")
    args = [*img(shards), "data.batch_size=8", "data.num_workers=0", f"model.checkpoint={classifier}",
            "eval.knn=false", "eval.position_probe=false", "eval.linear_probe=false", "eval.max_eval_samples=4",
            "eval.consistency_ratios=[]", f"eval.label_subset_files=[{subset}]", f"run.output={tmp_path / 'ev'}"]
    assert evaluate.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "1 of the 2 names in eval.label_subset_files" in err, err
    assert "n01440764_10026.JPEG" in err and not (tmp_path / "ev" / "results.json").exists()
    assert not (tmp_path / "ev" / "features").exists(), "a failed evaluation leaves no features behind"


@pytest.mark.parametrize(("override", "message"), [
    ("eval.probe_layers=[last,last8]", "eval.probe_layers must be one of last, last4, got 'last8'"),
    ("eval.probe_optimizer=adam", "eval.probe_*: optimizer must be one of adamw, lars, sgd"),
    ("eval.probe_schedule=step", "eval.probe_*: milestones"),
    ("eval.label_probe=svm", "eval.label_probe must be one of linear, logistic, got 'svm'"),
    ("eval.probe_train_samples=-1", "eval.probe_train_samples must be >= 0")])
def test_probe_fields_are_checked_before_anything_runs(shards, capsys, override, message):
    assert evaluate.main([*img(shards), "model.checkpoint=unused", override]) == 2
    assert message in capsys.readouterr().err


def shares(reader, positions: torch.Tensor, world: int) -> list[list[tuple[int, ...]]]:
    """Each process's batches, as the positions they hold."""
    return [[tuple(p.tolist()) for _, _, p, _ in share_batches(reader, positions, 5, rank, world)]
            for rank in range(world)]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("wanted", ["all", "first 10", "random 23"])
def test_each_sample_is_read_once_across_processes_and_workers_in_the_same_batch(shards, workers, wanted):
    """4 shards of 16 samples: whole shards dealt out when there are enough of them for the slots, blocks of 5
    positions of a shard otherwise; any world size gives the same batches (so the same features, bit for bit)."""
    positions = {"all": torch.arange(64), "first 10": torch.arange(10),
                 "random 23": torch.randperm(64, generator=torch.Generator().manual_seed(0))[:23].sort().values}[wanted]
    streamed = ShardDataset(shards / "img" / "train", num_workers=workers)
    in_memory = MemoryReader(InMemorySplit.load(shards / "img" / "train"), None, shuffle=False)
    for reader in (streamed, in_memory):
        batches = {world: [b for share in shares(reader, positions, world) for b in share] for world in (1, 2, 3)}
        for world, found in batches.items():
            read = sorted(p for batch in found for p in batch)
            assert read == positions.tolist(), (type(reader).__name__, world)
            assert sorted(found) == sorted(batches[1]), "the same batches whatever the number of processes"
        assert all(len(b) <= 5 for b in batches[1])
    x, y, p, keys = next(share_batches(streamed, positions, 5))
    assert x.shape == (len(p), 1, 28, 28)
    assert keys == [f"{i:04d}" for i in p.tolist()] and y.tolist() == [i % 3 for i in p.tolist()]


@pytest.mark.slow
def test_the_probe_memory_benchmark_measures_each_size():
    from patchplace.research.benchmarks.probe_memory import probe_memory_suite

    rows = probe_memory_suite(argparse.Namespace(probe_sizes=[300], probe_epochs=1, feature_dims=[96],
                                                 width_samples=400), {})
    width, size = rows
    assert [r["train_samples"] for r in rows] == [400, 300] and {r["suite"] for r in rows} == {"probe_memory"}
    assert size["peak_rss_anon_mb"] > size["added_rss_anon_mb"] > 0 and size["store_mb"] > 0
    assert size["peak_rss_anon_fixed_mmap_mb"] > 0 and 0 <= size["linear_probe_top1"] <= 1
    # the width axis: three features of 400 + 1000 rows x 96 float32 on disk, every probe run on them
    assert width["feature_dim"] == 96 and width["store_mb"] >= 3 * 1400 * 96 * 4 / 2**20
    assert width["added_rss_anon_fixed_mmap_mb"] > 0 and width["half_labels_logistic_top1"] > 0.5


def test_a_streamed_and_an_in_memory_evaluation_give_one_answer(shards, classifier, tmp_path):
    """data.in_memory=true / false read the same samples: the position probe trains on the same batches (blocks of
    data.batch_size in manifest order, whatever the shards and the loader's workers) with the same masks, MJP's
    consistency reads the same first images, so every number is the same; results.json says which reader ran."""
    runs = {}
    for mode in ("true", "false"):
        out = tmp_path / f"in_memory_{mode}"
        args = [*img(shards), "data.batch_size=6", "data.num_workers=2", f"data.in_memory={mode}",
                f"model.checkpoint={classifier}", "eval.probe_train_samples=40", "eval.probe_epochs=2",
                "eval.max_eval_samples=20", "eval.consistency_ratios=[0.27,0.5]", "eval.low_label_fraction=0",
                f"run.output={out}"]
        assert evaluate.main(args) == 0
        runs[mode] = json.loads((out / "results.json").read_text())
    memory, streamed = runs["true"], runs["false"]
    assert memory.pop("data")["mode"] == "in_memory" and streamed.pop("data")["mode"] == "streamed"
    assert memory == streamed, {k: (v, streamed.get(k)) for k, v in memory.items() if v != streamed.get(k)}


FAULT_DRIVER = str(ROOT / "tests" / "evaluate_fault_driver.py")


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["sigterm", "own_output"])
def test_a_stopped_or_failed_evaluation_on_two_processes_leaves_no_features_on_any_machine(
        shards, classifier, tmp_path, fault):
    """Rank 1 SIGTERMed as soon as it wrote its first batch of features (a user's kill, the launcher then ending
    rank 0), or rank 1 given a run.output of its own (run.output not shared across machines: the merge fails on
    both): each rank removes its own part, so neither folder keeps features, and no results are written."""
    out = tmp_path / "ev"
    env = {**ENV, "EVAL_SIGTERM_RANK": "1"} if fault == "sigterm" else {**ENV, "EVAL_OWN_OUTPUT_RANK": "1"}
    args = [*img(shards), "data.batch_size=8", "data.num_workers=1", "data.in_memory=false",
            f"model.checkpoint={classifier}", "eval.probe_train_samples=40", "eval.max_eval_samples=8",
            "eval.consistency_ratios=[]", f"run.output={out}"]
    result = subprocess.run([*LAUNCH, FAULT_DRIVER, *args], capture_output=True, text=True, timeout=300, env=env,
                            cwd=ROOT)
    assert result.returncode != 0, result.stderr[-3000:]
    expected = "interrupted by SIGTERM" if fault == "sigterm" else "wrote no complete part of the features"
    assert expected in result.stderr, result.stderr[-3000:]
    for folder in (out, tmp_path / "ev-rank1"):
        assert not (folder / "features").exists(), (folder, sorted(folder.rglob("*")))
        assert not (folder / "results.json").exists()
