"""run.log_with: Accelerate's experiment trackers beside run.tensorboard, in their local-store modes (TensorBoard's
event files, MLflow's file store), read back with each tracker's own client: the resolved config as params /
hparams, the run named after run.output, the run's files as artifacts / text, MLflow's system metrics; the default
stays TensorBoard alone in output/tensorboard/; a tracker that is unknown or not installed is one line before
anything runs, and one that does not start is one line that leaves no file of the run behind."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml
from pipeline_args import TINY, files_of, img, method_args

from patchplace.pipelines import finetune, pretrain
from patchplace.pipelines.commands import PretrainConfig
from patchplace.pipelines.config import ConfigError, command_args, load
from patchplace.pipelines.engine.logs import RunMLflow, RunTensorBoard, accelerator_log_with, trackers
from patchplace.pipelines.sections import TRACKERS, RunSection

mlflow = pytest.importorskip("mlflow", reason="the pipelines' [test] extra installs mlflow-skinny")


def test_the_names_are_accelerates_trackers():
    from accelerate.utils import LoggerType

    assert set(TRACKERS) == {str(t) for t in LoggerType} - {"all"}


def test_by_default_tensorboard_alone_in_output_tensorboard():
    run = RunSection(output="runs/x")
    assert run.log_with == () and trackers(run) == ["tensorboard"]
    (tracker,) = accelerator_log_with(run)
    assert isinstance(tracker, RunTensorBoard) and (tracker.logging_dir_param, tracker.run_name) == ("runs/x",
                                                                                                  "tensorboard")
    off = RunSection(tensorboard=False)
    assert trackers(off) == [] and accelerator_log_with(off) is None


@pytest.mark.parametrize(("value", "expected"), [
    ("mlflow", ["tensorboard", "mlflow"]),
    ("[mlflow,tensorboard]", ["tensorboard", "mlflow"]),
    ("all", None),
])
def test_a_name_a_list_or_all_on_the_command_line(shards, value, expected):
    """A name alone is a list of one (as Accelerate takes it); "all" is every tracker installed here, which
    Accelerate's own filter would pick (its get_available_trackers), TensorBoard first."""
    from accelerate.tracking import get_available_trackers

    run = load(PretrainConfig, *command_args([*img(shards), f"run.log_with={value}"])).run
    names = trackers(run)
    if expected is None:
        expected = ["tensorboard", *[str(t) for t in get_available_trackers() if str(t) != "tensorboard"]]
    assert names == expected and "all" not in names
    assert [t.name for t in accelerator_log_with(run)] == names


def test_an_unknown_or_missing_tracker_is_one_line(monkeypatch):
    with pytest.raises(ConfigError, match="unknown tracker") as raised:
        RunSection(log_with=("tensorbored",)).validate()
    assert "\n" not in str(raised.value) and "wandb" in str(raised.value)
    monkeypatch.setattr("accelerate.tracking.get_available_trackers", lambda: [])
    with pytest.raises(ConfigError) as raised:
        RunSection(log_with=("comet_ml",)).validate()
    assert "\n" not in str(raised.value) and "pip install comet-ml" in str(raised.value)


def file_store(tmp_path, monkeypatch) -> str:
    """A local MLflow store MLflow 3 opens without sqlalchemy: its file store, kept only on request."""
    store = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return store


def test_mlflow_params_within_its_limits(tmp_path, monkeypatch):
    """More params than MLflow takes in one call, and a value longer than it takes: all logged (MLflow's own
    validation refuses either), the long one clipped to MLflow's limit, saying so."""
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

    client = mlflow.MlflowClient(file_store(tmp_path, monkeypatch))
    values = {f"group.key_{i}": i for i in range(2 * MAX_PARAMS_TAGS_PER_BATCH + 7)}
    values["data.train_urls"] = json.dumps([f"s3://bucket/shard-{i:06d}.tar" for i in range(400)])
    assert len(values["data.train_urls"]) > MAX_PARAM_VAL_LENGTH
    tracker = RunMLflow("limits", run_name="limits")
    tracker.start()
    try:
        tracker.store_init_configuration(values)
    finally:
        tracker.finish()
    params = client.get_run(tracker.active_run.info.run_id).data.params
    assert set(params) == set(values) and params["group.key_5"] == "5"
    long = params["data.train_urls"]
    assert len(long) <= MAX_PARAM_VAL_LENGTH and long.endswith("characters: config.yaml)")
    assert values["data.train_urls"].startswith(long.split(" ... (")[0])


def leaves(tree: dict, prefix: str = "") -> dict:
    """A nested config's leaves by dotted key (an empty section is a leaf)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def tensorboard_run(folder):
    """The scalars, hparams (session start info) and texts of the TensorBoard run in ``folder``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    acc = EventAccumulator(str(folder)).Reload()
    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)
    start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    experiment = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
    hparams = {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}
    texts = {tag.split("/")[0]: acc.Tensors(tag)[-1].tensor_proto.string_val[0].decode()
             for tag in acc.Tags()["tensors"] if tag.endswith("/text_summary")}
    scalars = {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    return scalars, hparams, [m.name.tag for m in experiment.metric_infos], texts


def test_a_pretrain_run_as_mlflow_and_tensorboard_show_it(shards, tmp_path, monkeypatch):
    """run.log_with=[mlflow] beside run.tensorboard on a tiny pretraining: each tracker read back with its client
    holds the config.yaml the run wrote (MLflow: one param per leaf, dotted; TensorBoard: the same keys as hparams
    of the run's own events, and the YAML as text), a run named after run.output, the model card (TensorBoard text,
    MLflow artifact, with config.yaml, optimizer.json and the final checkpoint's config.json), the scalars at the
    logged steps and MLflow's system/* metrics."""
    store = file_store(tmp_path, monkeypatch)
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")  # (MLflow samples every 10 s by default)
    started = []
    start_run = mlflow.start_run
    monkeypatch.setattr(mlflow, "start_run", lambda *a, **k: started.append(k) or start_run(*a, **k))
    out = tmp_path / "mae_tiny"
    args = [a for a in method_args(shards, "mae") if not a.startswith("run.tensorboard")]
    assert pretrain.main([*args, "optim.max_steps=4", "run.log_every=2", "run.tensorboard=true",
                          "run.log_with=mlflow", "run.log_project=trackers_test", f"run.output={out}"]) == 0
    config = leaves(yaml.safe_load((out / "config.yaml").read_text()))

    client = mlflow.MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("trackers_test").experiment_id])
    assert run.info.run_name == "mae_tiny" and run.info.status == "FINISHED"
    assert run.data.tags["patchplace.output"] == str(out)
    params = run.data.params
    assert set(params) == set(config), set(params) ^ set(config)
    assert params["method"] == "mae" and float(params["optim.lr"]) == config["optim.lr"]
    assert json.loads(params["run.log_with"]) == ["mlflow"] and params["optim.warmup_epochs"] == "null"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"config.yaml", "optimizer.json", "checkpoint"}, artifacts
    assert {a.path for a in client.list_artifacts(run.info.run_id, "checkpoint")} == {"checkpoint/README.md",
                                                                                     "checkpoint/config.json"}
    local = client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path / "got"))
    assert Path(local).read_text() == (out / "config.yaml").read_text()
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [2, 4]
    assert "val/loss" in run.data.metrics
    # MLflow's monitor thread publishes its first sample one interval after the run starts, if the run still runs
    # then: a 4-step run on a loaded machine may end first, so the start is what is held here
    assert [k.get("log_system_metrics") for k in started] == [True]
    system = {k for k in run.data.metrics if k.startswith("system/")}
    assert not system or "system/cpu_utilization_percentage" in system, system

    events = {p.parent for p in (out / "tensorboard").rglob("events.out.tfevents.*")}
    assert events == {out / "tensorboard"}, "one TensorBoard run: the hparams beside the scalars"
    scalars, hparams, metrics, texts = tensorboard_run(out / "tensorboard")
    assert scalars["train/loss"] == [2, 4] and "val/loss" in scalars
    assert set(hparams) == set(params), "the same config keys in both trackers"
    assert hparams["optim.lr"] == config["optim.lr"] and hparams["method"] == "mae"
    assert metrics == ["train/loss"]
    assert yaml.safe_load(textwrap.dedent(texts["config"])) == yaml.safe_load((out / "config.yaml").read_text())
    assert texts["model_card"] == (out / "checkpoint" / "README.md").read_text()


def test_tensorboard_and_mlflow_log_the_same_scalars_in_their_local_stores(shards, tmp_path, monkeypatch):
    """Fine-tuning: the events stay in <output>/tensorboard/, MLflow's store holds the run under run.log_project
    with train/* and val/*."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    store = file_store(tmp_path, monkeypatch)
    out = tmp_path / "ft"
    args = [a for a in TINY if not a.startswith("run.tensorboard")]
    assert finetune.main([*img(shards), *args, "optim.max_steps=4", "run.log_every=2", "run.eval_every=2",
                          "run.tensorboard=true", "run.log_with=[mlflow]", "run.log_project=trackers_test",
                          f"run.output={out}"]) == 0
    events = sorted((out / "tensorboard").glob("events.out.tfevents.*"))
    assert events and not (out / "trackers_test").exists(), "TensorBoard keeps its folder"
    tags = set(EventAccumulator(str(events[0].parent)).Reload().Tags()["scalars"])
    assert {"train/loss", "train/lr", "val/top1"} <= tags, tags
    client = mlflow.MlflowClient(store)
    experiment = client.get_experiment_by_name("trackers_test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert {"train/loss", "train/lr", "val/top1"} <= set(run.data.metrics), run.data.metrics
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [2, 4]
    assert run.info.status == "FINISHED", "end_training closes it"


def refused_store(tmp_path, monkeypatch) -> None:
    """MLflow 3 refusing its file store (no MLFLOW_ALLOW_FILE_STORE)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'refused'}")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)


def test_a_tracker_that_does_not_start_is_one_line_and_leaves_no_folder(shards, tmp_path, monkeypatch, capsys):
    """TensorBoard starts (its events file written), then MLflow refuses its store: one line naming MLflow and
    the setting, exit 2, and run.output gone, so the next run starts from an empty folder."""
    refused_store(tmp_path, monkeypatch)
    out = tmp_path / "runs" / "refused"
    args = [a for a in method_args(shards, "mae") if not a.startswith("run.tensorboard")]
    assert pretrain.main([*args, "optim.max_steps=2", "run.tensorboard=true", "run.log_with=[mlflow]",
                          f"run.output={out}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: run.log_with: mlflow did not start"), lines
    assert "MLFLOW_ALLOW_FILE_STORE=true" in lines[0] and "leave mlflow out of run.log_with" in lines[0]
    assert not (tmp_path / "runs").exists(), "the folders this launch created are removed"
    assert mlflow.active_run() is None


def test_a_resume_whose_tracker_does_not_start_changes_no_file(shards, tmp_path, monkeypatch, capsys):
    """A resume (here extending the budget) whose tracker fails: every file of the run as it was (the lock
    file's holder aside), TensorBoard's new events file removed again."""
    out = tmp_path / "run"
    args = [*[a for a in method_args(shards, "mae") if not a.startswith("run.tensorboard")], "run.tensorboard=true",
            f"run.output={out}"]
    assert pretrain.main([*args, "optim.max_steps=2"]) == 0
    before = files_of(out)
    refused_store(tmp_path, monkeypatch)
    assert pretrain.main([*args, "optim.max_steps=4", "run.resume=true", "run.log_with=mlflow"]) == 2
    assert "mlflow did not start" in capsys.readouterr().err
    after = files_of(out)
    before.pop(".lock"), after.pop(".lock")
    assert after == before


def test_a_resumed_run_may_change_its_trackers():
    """run.log_with is how a run is watched, not what it trains: a resume may add or drop trackers."""
    from patchplace.pipelines.engine.rundir import RESUMABLE_CHANGES

    assert {"run.log_with", "run.log_project", "run.tensorboard"} <= set(RESUMABLE_CHANGES)


def test_an_interrupted_run_is_killed_in_mlflow_and_its_resume_continues_the_same_run(shards, tmp_path, monkeypatch):
    """SIGTERM's checkpoint-and-stop (``Interrupted``) marks the MLflow run KILLED, not FINISHED; the resume (here
    extending the budget too) continues that run (run.output/tracker_runs.json names it): one MLflow run holding
    both sessions' steps, FINISHED, its params the first session's (MLflow keeps a param's first value)."""
    from patchplace.pipelines.engine import launch
    from patchplace.pipelines.engine.logs import TRACKER_RUNS
    from patchplace.pipelines.engine.trainer import Trainer

    store = file_store(tmp_path, monkeypatch)
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")
    out = tmp_path / "run"
    args = [*method_args(shards, "mae"), "run.log_every=1", "run.log_with=mlflow", "run.log_project=resumed",
            f"run.output={out}"]
    after_step = Trainer.after_step

    def interrupted_at_2(self, step, *rest):
        done = after_step(self, step, *rest)
        if step == 2:
            self.save_checkpoint(step)
            raise launch.Interrupted("interrupted at step 2 (test)", 143)
        return done

    monkeypatch.setattr(Trainer, "after_step", interrupted_at_2)
    assert pretrain.main([*args, "optim.max_steps=3"]) != 0
    client = mlflow.MlflowClient(store)
    experiment = client.get_experiment_by_name("resumed").experiment_id
    (first,) = client.search_runs([experiment])
    assert first.info.status == "KILLED"
    assert json.loads((out / TRACKER_RUNS).read_text()) == {"mlflow": first.info.run_id}

    monkeypatch.setattr(Trainer, "after_step", after_step)
    assert pretrain.main([*args, "optim.max_steps=4", "run.resume=true"]) == 0
    (run,) = client.search_runs([experiment])
    assert run.info.run_id == first.info.run_id and run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2, 3, 4]
    assert run.data.params["run.resume"] == "False" and run.data.params["optim.max_steps"] == "3"
