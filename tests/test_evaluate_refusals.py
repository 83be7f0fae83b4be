"""What evaluate.py refuses before it computes anything, in one line (exit 2) and changing no file: label-subset
lists that name samples data.train lacks, a sample twice, or one class only (matched against the split's keys
before any feature is extracted, in memory and streamed); fewer probe samples than classes; a training run's
folder whose lock a live process holds. And what an evaluation into a training run's folder leaves of its lock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pipeline_args import TINY, img, small_heads

from patchplace.models import load_pretrained
from patchplace.pipelines import evaluate, pretrain

QUICK = ["data.batch_size=8", "data.num_workers=0", "eval.knn=false", "eval.position_probe=false",
         "eval.max_eval_samples=4", "eval.consistency_ratios=[]", "eval.low_label_fraction=0"]


@pytest.fixture(scope="module")
def classifier(shards, tmp_path_factory) -> Path:
    """A 2-block StoP backbone (one pretraining step) given a 3-class head."""
    root = tmp_path_factory.mktemp("refusals")
    assert pretrain.main(["method=stop", *img(shards), *TINY, *small_heads("stop"), "optim.max_steps=1",
                          f"run.output={root / 'pre'}"]) == 0
    backbone, metadata = load_pretrained(root / "pre" / "checkpoint")
    backbone.reset_classifier(3)
    backbone.save_pretrained(root / "cls", metadata={**metadata, "classes": ["a", "b", "c"]})
    return root / "cls"


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def no_extraction(monkeypatch):
    """Any feature extraction fails the test: the refusals come before it."""
    def extracted(*args, **kwargs):
        raise AssertionError("features were extracted before the refusal")

    monkeypatch.setattr(evaluate, "build_stores", extracted)


@pytest.mark.parametrize("in_memory", ["true", "false"])
@pytest.mark.parametrize(("lines", "message"), [
    ("0001.png\nn01440764_10026.JPEG\n", "1 of the 2 names in eval.label_subset_files"),
    ("0001.png\n0004.png\n0001\n", "name a sample an earlier line names too"),  # 0001 twice
    ("0000.png\n0003.png\n0006.png\n", "lists 3 samples, all of class 'a'"),
])
def test_a_subset_list_is_matched_to_the_split_before_any_feature_is_extracted(
        shards, classifier, tmp_path, capsys, no_extraction, in_memory, lines, message):
    subset = tmp_path / "1percent.txt"
    subset.write_text(lines)
    out = tmp_path / "ev"
    args = [*img(shards), *QUICK, f"data.in_memory={in_memory}", f"model.checkpoint={classifier}",
            "eval.linear_probe=false", f"eval.label_subset_files=[{subset}]", f"run.output={out}"]
    assert evaluate.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err
    assert not out.exists(), "a refused evaluation leaves nothing behind"


def test_fewer_probe_samples_than_classes_are_refused(shards, classifier, tmp_path, capsys, no_extraction):
    args = [*img(shards), *QUICK, f"model.checkpoint={classifier}", "eval.probe_train_samples=2",
            f"run.output={tmp_path / 'ev'}"]
    assert evaluate.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "eval.probe_train_samples=2 is fewer than the 3 classes" in err, err


HOLD = """
import sys, time
from pathlib import Path
from patchplace.pipelines.engine.protocol import RunLock
RunLock(Path(sys.argv[1])).acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_a_training_run_folder_locked_by_a_live_process_is_refused_and_left_as_it_was(
        shards, classifier, tmp_path, capsys, no_extraction):
    run = tmp_path / "run"
    run.mkdir()
    (run / "log.jsonl").write_text('{"step": 1}\n')
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = files_of(run)
        args = [*img(shards), *QUICK, f"model.checkpoint={classifier}", f"run.output={run}"]
        assert evaluate.main(args) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"is in use by process {holder.pid}" in err, err
        assert files_of(run) == before, "a refused evaluation changes no file"
    finally:
        holder.kill()
        holder.wait()


def test_an_evaluation_into_an_unfinished_training_run_holds_its_lock_and_gives_it_back(
        shards, classifier, tmp_path, monkeypatch):
    """A run killed mid-training (its lock free, its content a dead process's): the evaluation holds the lock
    while it writes (a resume meanwhile would be refused) and leaves the lock file as it found it."""
    from patchplace.pipelines.engine.protocol import LOCK, RunLock

    run = tmp_path / "run"
    run.mkdir()
    (run / "log.jsonl").write_text('{"step": 1}\n')
    (run / LOCK).write_text('{"pid": 1, "host": "gone", "since": "earlier"}')
    seen = []
    real = evaluate.evaluation

    def evaluation(*args, **kwargs):
        with pytest.raises(Exception, match="is in use by process"):
            RunLock(run).acquire()
        seen.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluate, "evaluation", evaluation)
    args = [*img(shards), *QUICK, "eval.linear_probe=false", f"model.checkpoint={classifier}", f"run.output={run}"]
    assert evaluate.main(args) == 0 and seen
    assert (run / "results.json").is_file()
    assert (run / LOCK).read_text() == '{"pid": 1, "host": "gone", "since": "earlier"}'
    RunLock(run).acquire().release(restore=True)  # free again
