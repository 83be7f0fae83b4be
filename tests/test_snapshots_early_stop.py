"""Learning-curve snapshots (``run.keep_epochs``) and early stopping on the validation split
(``run.early_stop_patience``): what they write, what they refuse, and that kills (SIGKILL at every optimizer step
and inside every line of the write protocol) change nothing of it. ``curve_driver.py`` scripts the evaluation and
places the kills."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from curve_driver import SCRIPT, folder_files, scripted_main, tensors
from pipeline_args import TINY, img, small_heads

from patchplace.pipelines import (
    engine,
    pretrain,
)
from patchplace.pipelines.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # end to end: real runs of the pipelines

DRIVER = str(ROOT / "tests" / "curve_driver.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# 64 training samples, batches of 8: 8 steps per epoch
CURVE = ["run.keep_epochs=[0,0.5,1.25,2]", "run.eval_every=2", "run.early_stop_patience=3", "optim.epochs=3"]


def log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def metadata(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())["metadata"]


def record_checkpoints(monkeypatch) -> dict[int, dict]:
    """The tensors of ``checkpoint/model.safetensors`` after every checkpoint save, by step."""
    saved: dict[int, dict] = {}
    save = engine.Trainer.save_checkpoint

    def recording(trainer, step, **kwargs):
        save(trainer, step, **kwargs)
        saved[step] = tensors(trainer.rundir.out / "checkpoint" / "model.safetensors")

    monkeypatch.setattr(engine.Trainer, "save_checkpoint", recording)
    return saved


def weights_of(state: dict) -> dict:
    return {k: v for k, v in state.items() if k != "metadata"}


def test_snapshots_keep_the_backbone_after_each_epoch(shards, tmp_path, monkeypatch, capsys):
    """MAE (its decoder goes to objective.safetensors), 2 epochs of 8 steps, snapshots after 0, 0.5, 1 and 2."""
    out = tmp_path / "mae"
    args = ["method=mae", *img(shards), *TINY, *small_heads("mae"), "optim.epochs=2", "run.keep_epochs=[0,0.5,1,2]",
            f"run.output={out}"]
    saved = record_checkpoints(monkeypatch)
    assert pretrain.main(args) == 0
    printed = capsys.readouterr().out
    names = {"epoch-0": (0, 0.0), "epoch-0.5": (4, 0.5), "epoch-1": (8, 1.0), "epoch-2": (16, 2.0)}
    assert sorted(p.name for p in (out / "snapshots").iterdir()) == sorted(names)
    for name, (step, epoch) in names.items():
        folder = out / "snapshots" / name
        assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json", "model.safetensors",
                                                            "objective.safetensors"], "the backbone, no state"
        assert (metadata(folder)["step"], metadata(folder)["epoch"]) == (step, epoch), name
        assert f"snapshot: epoch {epoch:g} (step {step}) in {folder}" in printed
        if step:  # a snapshot step is a checkpoint step, with the same weights
            assert weights_of(tensors(folder / "model.safetensors")) == weights_of(saved[step]), name
    assert sorted(saved) == [4, 8, 16]
    assert [r for r in log(out) if "snapshot" in r] == [{"step": s, "snapshot": f"snapshots/{n}"}
                                                        for n, (s, _) in names.items()]
    # epoch 0: the initial weights (the same seed builds the same model), which training then changed
    cfg, _, data = engine.start(pretrain.PretrainConfig, "", args)
    _, backbone = pretrain.build_objective(cfg, 3, 1, "image", data)
    from patchplace.models import load_pretrained

    initial = load_pretrained(out / "snapshots" / "epoch-0")[0].state_dict()
    assert initial.keys() == backbone.state_dict().keys()
    assert all(torch.equal(initial[k], v) for k, v in backbone.state_dict().items())
    assert weights_of(tensors(out / "snapshots" / "epoch-0" / "model.safetensors")) != \
        weights_of(tensors(out / "snapshots" / "epoch-0.5" / "model.safetensors"))


@pytest.mark.parametrize(("extra", "message"), [
    (["run.keep_epochs=[0.5,0.55]"], "run.keep_epochs: epochs 0.5 and 0.55 are both step 4 (8 steps per epoch): "
                                     "keep one of them"),
    (["run.keep_epochs=[1,3,4]"], "run.keep_epochs: epoch(s) 3, 4 lie beyond this run's budget of 16 steps (2 "
                                  "epochs of 8 steps): drop them, or train longer"),
    (["run.keep_epochs=[-1]"], "run.keep_epochs holds -1: epochs must be finite and >= 0"),
    (["run.early_stop_patience=2"], "run.early_stop_patience=2 counts evaluations, and run.eval_every=0"),
], ids=["same-step", "beyond-budget", "negative", "patience-without-eval_every"])
def test_bad_settings_are_refused_in_one_line_before_anything_is_written(shards, tmp_path, capsys, extra, message):
    out = tmp_path / "run"
    assert pretrain.main(["method=supervised", *img(shards), *TINY, "optim.epochs=2", *extra,
                          f"run.output={out}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not (out / "log.jsonl").exists() and not (out / "snapshots").exists()


def test_early_stopping_is_refused_where_the_pipeline_has_no_evaluation(shards, tmp_path, capsys):
    """A script that hands the Trainer no ``evaluate`` callback has nothing to stop on: one line, nothing written."""
    out = tmp_path / "run"
    assert scripted_main(["method=supervised", *img(shards), *TINY, "optim.epochs=2", "run.early_stop_patience=2",
                          "run.eval_every=2", f"run.output={out}"], None) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run.early_stop_patience=2: this pipeline does not evaluate" in err, err
    assert not (out / "log.jsonl").exists()


def test_the_best_tracker_follows_the_metric_and_replays_exactly():
    loss = engine.BestTracker("val_loss", patience=2)  # a loss: lower is better
    assert [loss.update(s, {"val_loss": v}) for s, v in ((1, 0.9), (2, 0.5), (3, 0.5), (4, 0.7))] == \
        [True, True, False, False]
    assert (loss.best_step, loss.best, loss.since, loss.exhausted) == (2, 0.5, 2, True)
    top1 = engine.BestTracker("top1", patience=3)
    top1.replay([{"step": s, "eval": {"top1": v}} for s, v in SCRIPT.items() if s <= 12] + [{"step": 12, "loss": 1}])
    assert (top1.best_step, top1.best, top1.since, top1.exhausted) == (8, 0.55, 2, False)
    with pytest.raises(ConfigError) as missing:
        engine.BestTracker("top5", patience=1).update(3, {"top1": 0.1, "count": 3})
    assert str(missing.value) == "run.early_stop_metric=top5: the evaluation at step 3 gives None for it; it " \
                                 "reports count, top1"


def test_early_stopping_stops_keeps_the_best_and_a_resume_finds_it_complete(shards, tmp_path, monkeypatch, capsys):
    """The scripted top-1 (curve_driver.SCRIPT) peaks at step 8; three evaluations without a better one (10, 12:
    a tie, 14) stop the run at step 14 of 24."""
    out = tmp_path / "run"
    args = ["method=supervised", *img(shards), *TINY, *CURVE, f"run.output={out}"]
    saved = record_checkpoints(monkeypatch)
    assert scripted_main(args, SCRIPT) == 0
    printed = capsys.readouterr().out
    summary = {"best_step": 8, "metric": "top1", "best": 0.55, "patience": 3}
    records = log(out)
    assert [r for r in records if "early_stop" in r] == [{"step": 14, "early_stop": summary}]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 15))
    assert [r["step"] for r in records if "eval" in r] == [2, 4, 6, 8, 10, 12, 14]
    assert "early stop at step 14 of 24: no better top1 than 0.55 (step 8) in 3 evaluation(s); run.keep_epochs 2 " \
           "not reached" in printed
    assert f"best: {out / 'best'} (step 8, top1 0.55): the checkpoint to evaluate" in printed
    assert os.readlink(out / "checkpoint") == os.path.join("checkpoints", "step-00000014", "checkpoint")
    trainer = json.loads((out / "checkpoints" / "step-00000014" / "state" / "trainer.json").read_text())
    assert trainer["stopped_early"] == summary and metadata(out / "checkpoint")["metrics"]["top1"] == 0.54
    # best/: the weights of step 8 (a new best is a checkpoint step: 2, 4, 8; snapshots 4 and 10; the stop 14)
    assert sorted(saved) == [2, 4, 8, 10, 14]
    best = metadata(out / "best")
    assert (best["step"], best["best_metric"], best["best_value"], best["metrics"]) == (
        8, "top1", 0.55, {"top1": 0.55, "count": 32})
    assert weights_of(tensors(out / "best" / "model.safetensors")) == weights_of(saved[8])
    assert sorted(p.name for p in (out / "snapshots").iterdir()) == ["epoch-0", "epoch-0.5", "epoch-1.25"]
    # resumed: complete, nothing rewritten
    files = {p: (p.stat().st_mtime_ns, p.read_bytes()) for d in ("checkpoints", "best", "snapshots")
             for p in (out / d).rglob("*") if p.is_file()}
    text = (out / "log.jsonl").read_text()
    assert scripted_main([*args, "run.resume=true"], SCRIPT) == 0
    printed = capsys.readouterr().out
    assert f"run.resume=true: {out} is complete (stopped early at step 14 of 24); nothing to do" in printed
    assert f"best: {out / 'best'} (step 8, top1 0.55)" in printed
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in files} == files
    assert {p for d in ("checkpoints", "best", "snapshots") for p in (out / d).rglob("*") if p.is_file()} == set(files)
    assert (out / "log.jsonl").read_text() == text


def test_the_closing_evaluation_competes_for_best(shards, tmp_path, monkeypatch):
    """No early stop (the budget ends first): the closing evaluation (step 8) is the best one."""
    out = tmp_path / "run"
    saved = record_checkpoints(monkeypatch)
    assert scripted_main(["method=supervised", *img(shards), *TINY, "optim.epochs=1", "run.eval_every=2",
                          "run.early_stop_patience=5", f"run.output={out}"], {2: 0.5, 4: 0.4, 6: 0.5, 8: 0.6}) == 0
    assert not [r for r in log(out) if "early_stop" in r]
    assert metadata(out / "best")["step"] == 8 and metadata(out / "best")["best_value"] == 0.6
    assert weights_of(tensors(out / "best" / "model.safetensors")) == weights_of(saved[8])
    assert sorted(saved) == [2, 8], "a new best is a checkpoint step (step 6 ties step 2: no better)"


@pytest.mark.parametrize(("sweep", "count", "least"), [("step", 2, 14 + 2), ("best,snapshot", 0, 30)])
def test_a_kill_anywhere_resumes_to_the_same_snapshots_best_and_stop(shards, tmp_path, sweep, count, least):
    """SIGKILL as each optimizer step begins, or at every line of the write protocol (engine/protocol.py) in the last
    best/ write (step 8: it replaces step 4's) or in the last snapshot, plus random lines of any write: each killed run
    resumes, stops at step 14 like the uninterrupted run, with bit-identical snapshots, best/ and final weights,
    every step logged once, and no partial / replaced folder left; a further resume (every 4th kill) says it is
    complete."""
    report = tmp_path / "report.json"
    args = ["method=supervised", *img(shards), *TINY, *CURVE, f"run.output={tmp_path / 'unused'}"]
    result = subprocess.run([sys.executable, DRIVER, "kills", str(report), str(tmp_path), "7", str(count), sweep,
                             "--", *args], capture_output=True, text=True, timeout=600, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["expected"]["steps"][-1] == 14 and data["expected"]["early_stop"][0]["step"] == 14
    assert data["expected"]["snapshots"] == ["epoch-0", "epoch-0.5", "epoch-1.25"]
    kills = data["kills"]
    kinds = {k["kind"] for k in kills[:len(kills) - count]}  # the sweep's own points, before the COUNT random ones
    assert len(kills) >= least and kinds == set(sweep.split(",")), [k["kind"] for k in kills]
    for kill in kills:
        assert kill["killed"] and kill["resume_code"] == 0 and kill["again_code"] == 0, kill
        assert kill["differs"] == [] and kill["steps_logged_once"] and kill["strays"] == [], kill


def test_two_processes_snapshot_and_stop_early_at_the_same_step(shards, tmp_path):
    """finetune.py under ``accelerate launch`` (2 CPU processes, 4 steps per epoch each): early stopping on the
    evaluation's sample count (constant: no evaluation after the first is better) stops both ranks at step 4."""
    from test_ddp import log as ddp_log
    from test_ddp import run as launch

    out = tmp_path / "ddp"
    result = launch([str(ROOT / "pipelines" / "finetune.py"), *img(shards), *TINY, "finetune.mixup=0",
                     "finetune.cutmix=0", "optim.epochs=2", "run.keep_epochs=[0,0.5,1]", "run.eval_every=2",
                     "run.early_stop_patience=1", "run.early_stop_metric=count", f"run.output={out}"], timeout=120)
    closing = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"final"')]
    assert [(c["checkpoint"], c["best"]) for c in closing] == [(f"{out}/checkpoint", str(out / "best"))]
    records = ddp_log(out, everything=True)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and {r["world_size"] for r in steps} == {2}
    assert [r for r in records if "early_stop" in r] == [
        {"step": 4, "early_stop": {"best_step": 2, "metric": "count", "best": 32, "patience": 1}}]
    assert [(r["step"], r["snapshot"]) for r in records if "snapshot" in r] == [(0, "snapshots/epoch-0"),
                                                                               (2, "snapshots/epoch-0.5"),
                                                                               (4, "snapshots/epoch-1")]
    assert metadata(out / "best")["step"] == 2 and folder_files(out / "best")["model.safetensors"]
    state = out / "checkpoints" / "step-00000004" / "state"
    assert json.loads((state / "trainer.json").read_text())["world_size"] == 2
    assert sorted(p.name for p in state.glob("random_states_*.pkl")) == ["random_states_0.pkl",
                                                                         "random_states_1.pkl"]
