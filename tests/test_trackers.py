"""run.log_with: Accelerate's experiment trackers beside run.tensorboard, in their local-store modes (TensorBoard's
event files, MLflow's file store); the default stays TensorBoard alone in output/tensorboard/, and a tracker that is
unknown or not installed is one line before anything runs."""

from __future__ import annotations

import pytest
from pipeline_args import TINY, img

from patchplace.pipelines import finetune
from patchplace.pipelines.config import ConfigError
from patchplace.pipelines.engine.logs import accelerator_log_with, tracker_project, trackers
from patchplace.pipelines.sections import TRACKERS, RunSection


def test_the_names_are_accelerates_trackers():
    from accelerate.utils import LoggerType

    assert set(TRACKERS) == {str(t) for t in LoggerType} - {"all"}


def test_by_default_tensorboard_alone_as_before():
    run = RunSection()
    assert run.log_with == () and trackers(run) == ["tensorboard"]
    assert accelerator_log_with(run) == "tensorboard" and tracker_project(run) == "tensorboard"
    off = RunSection(tensorboard=False)
    assert trackers(off) == [] and accelerator_log_with(off) is None


def test_an_unknown_or_missing_tracker_is_one_line(monkeypatch):
    with pytest.raises(ConfigError, match="unknown tracker") as raised:
        RunSection(log_with=("tensorbored",)).validate()
    assert "\n" not in str(raised.value) and "wandb" in str(raised.value)
    monkeypatch.setattr("accelerate.tracking.get_available_trackers", lambda: [])
    with pytest.raises(ConfigError) as raised:
        RunSection(log_with=("comet_ml",)).validate()
    assert "\n" not in str(raised.value) and "pip install comet-ml" in str(raised.value)


def test_tensorboard_and_mlflow_log_the_same_scalars_in_their_local_stores(shards, tmp_path, monkeypatch):
    """run.log_with=[mlflow] beside run.tensorboard: the events stay in <output>/tensorboard/, MLflow's file store
    (MLFLOW_TRACKING_URI, as MLflow is set up) holds the run under run.log_project with train/* and val/*."""
    pytest.importorskip("mlflow", reason="the pipelines' [test] extra installs mlflow-skinny")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    store = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store only on request
    out = tmp_path / "ft"
    args = [a for a in TINY if not a.startswith("run.tensorboard")]
    assert finetune.main([*img(shards), *args, "optim.max_steps=4", "run.log_every=2", "run.eval_every=2",
                          "run.tensorboard=true", "run.log_with=[mlflow]", "run.log_project=trackers_test",
                          f"run.output={out}"]) == 0
    events = sorted((out / "tensorboard").glob("events.out.tfevents.*"))
    assert events and not (out / "trackers_test").exists(), "TensorBoard keeps its folder"
    tags = set(EventAccumulator(str(events[0].parent)).Reload().Tags()["scalars"])
    assert {"train/loss", "train/lr", "val/top1"} <= tags, tags
    client = MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("trackers_test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert {"train/loss", "train/lr", "val/top1"} <= set(run.data.metrics), run.data.metrics
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [2, 4]
    assert run.info.status == "FINISHED", "end_training closes it"


def test_a_resumed_run_may_change_its_trackers():
    """run.log_with is how a run is watched, not what it trains: a resume may add or drop trackers."""
    from patchplace.pipelines.rundir import RESUMABLE_CHANGES

    assert {"run.log_with", "run.log_project", "run.tensorboard"} <= set(RESUMABLE_CHANGES)
