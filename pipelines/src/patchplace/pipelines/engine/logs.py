"""What a run writes as it goes: the JSON-lines log (:class:`JsonlLog`; read back, and cut back on resume), the
per-step throughput record (:class:`Throughput`), lines printed clear of the progress bar, and the command line a
resume hint repeats."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
from accelerate.tracking import LOGGER_TYPE_TO_CLASS, MLflowTracker, TensorBoardTracker, get_available_trackers
from tqdm.auto import tqdm

from patchplace.data.atomic import atomic_file
from patchplace.pipelines.config import ConfigError, dump_yaml, one_line, to_dict


def say(text: str, file: Any = None) -> None:
    """Print a line clear of the progress bars (``tqdm.write``: the Trainer's bar is cleared, the line printed,
    the bar drawn again below it), flushed; ``file``: default stdout. For what prints while a bar runs, e.g. the
    ``evaluate`` callbacks a pipeline hands the :class:`Trainer`."""
    stream = sys.stdout if file is None else file
    tqdm.write(text, file=stream)
    stream.flush()


class Console:
    """The main process's lines during a training, clear of the Trainer's progress bar once it runs (``bar``)."""

    def __init__(self, main: bool) -> None:
        self.main = main
        self.bar: tqdm | None = None

    def print(self, text: str) -> None:
        if self.main:
            (self.bar.write if self.bar is not None else print)(text)


class JsonlLog:
    """Append-only JSON-lines log, written by the main process only. Each record is one ``write`` of a whole line;
    a line torn by a full disk or a kill is dropped on resume (:func:`truncate_log`)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path, self.enabled = path, enabled

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            try:
                with open(self.path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError as exc:  # a buffered write's error names no file: name it
                raise OSError(exc.errno, exc.strerror, str(self.path)) from None


def command_line(script: str, argv: list[str] | None) -> str:
    """``pipelines/<script> <arguments>`` as the user typed them (``run.resume`` / ``run.overwrite`` left out), for
    the resume hint printed on SIGTERM / Ctrl-C."""
    args = sys.argv[1:] if argv is None else argv
    kept = [a for a in args if not a.startswith(("run.resume=", "run.overwrite="))]
    return " ".join(shlex.quote(a) for a in [f"pipelines/{Path(script).name}", *kept])


def read_log(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The records of a ``log.jsonl`` and how many lines could not be read (a line torn by a full disk or a kill,
    or damaged later): those are skipped, never a traceback."""
    records, torn = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            torn += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("step", 0), int):
            records.append(record)
        else:
            torn += 1
    return records, torn


def truncate_log(path: Path, step: int) -> None:
    """Keep the records of ``log.jsonl`` up to ``step`` (a resumed run logs the later steps again: each once);
    unreadable lines are dropped with a warning."""
    if not path.is_file():
        return
    records, torn = read_log(path)
    if torn:
        print(f"warning: {path}: dropped {torn} unreadable line(s) (torn by a full disk or a kill)", file=sys.stderr)
    with atomic_file(path) as tmp:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records if r.get("step", 0) <= step))


class Throughput:
    """The throughput a training step's log record reports: samples/s and the share of the time spent waiting for
    data (``data_share``), measured from the end of this session's first step; what came before it (reading the
    data from ``started`` on, building the model, spawning workers, that first step) is ``startup_s``."""

    def __init__(self, started: float) -> None:
        self.started = started  # when reading the data began
        self.start = self.fetch = time.perf_counter()
        self.startup = self.waited = 0.0
        self.samples = 0  # samples this process trained on since ``start`` (a last batch may be short)

    def waiting(self) -> None:
        """The loop waits for its next batch from now on (logging, checkpoints and evaluation are not data time)."""
        self.fetch = time.perf_counter()

    def arrived(self, samples: int) -> None:
        """A batch of ``samples`` arrived."""
        self.samples += samples
        self.waited += time.perf_counter() - self.fetch

    def first_step_done(self) -> None:
        """The session's first optimizer step ended: the rates count from here."""
        self.start = time.perf_counter()
        self.waited, self.samples = 0.0, 0
        self.startup = self.start - self.started

    def record(self, processes: int) -> dict[str, float]:
        """``startup_s``, and from the second step of the session on ``data_share`` and ``samples_per_s`` over
        ``processes`` (every rank reads as many samples)."""
        elapsed = time.perf_counter() - self.start
        seen = self.samples * processes
        found = {"startup_s": round(self.startup, 2)}
        if seen:
            found.update(data_share=round(self.waited / elapsed, 4), samples_per_s=round(seen / elapsed, 1))
        return found


# ---------------------------------------------------------------------------------------------- experiment trackers
# what the Trainer's run directory shows a tracker that keeps files (MLflow's artifacts), at the run's end
RUN_FILES = (("config.yaml", None), ("optimizer.json", None), ("checkpoint/README.md", "checkpoint"),
             ("checkpoint/config.json", "checkpoint"))
# the packages whose errors name their tracker (a failed start is reported under that name)
ERROR_PACKAGES = {"torch": "tensorboard", "tensorboardX": "tensorboard"}


def trackers(run: Any) -> list[str]:
    """Every experiment tracker a run logs train/* and val/* to: TensorBoard (``run.tensorboard``) first, then
    ``run.log_with``, whose "all" is every tracker installed here (an evaluation's run section has neither: none)."""
    asked = list(getattr(run, "log_with", ()))
    if "all" in asked:
        asked = [str(t) for t in get_available_trackers()]
    return list(dict.fromkeys([*(["tensorboard"] if run.tensorboard else []), *asked]))


def run_name(run: Any) -> str:
    """The name a tracker gives the run: run.output's folder name (runs/mae_tiny: "mae_tiny")."""
    return Path(run.output).absolute().name


class RunTensorBoard(TensorBoardTracker):
    """TensorBoard in ``<output>/tensorboard/``, the config as the hparams of that same run (Accelerate's own
    writes them to a run of their own, apart from the scalars), so that the HParams dashboard shows them beside the
    run's train/loss."""

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        writer = self.writer._get_file_writer()  # the events file of train/* and val/*
        for summary in hparams(values, {"train/loss": None}):  # (experiment, session start, session end)
            writer.add_summary(summary)
        self.writer.flush()

    def abort(self) -> None:
        self.writer.close()


class RunMLflow(MLflowTracker):
    """MLflow as Accelerate starts it, with the system metrics MLflow samples (CPU, memory, disk, network, GPU:
    ``log_system_metrics``, psutil's, an Accelerate dependency) unless MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING says
    otherwise, and the config's long values clipped to MLflow's limit rather than dropped."""

    def start(self) -> None:
        import mlflow

        found = mlflow.get_experiment_by_name(self.experiment_name)
        experiment = found.experiment_id if found is not None else mlflow.create_experiment(
            self.experiment_name, artifact_location=self.logging_dir)
        system = None if "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING" in os.environ else True
        self.active_run = mlflow.start_run(run_id=self.run_id, experiment_id=experiment, run_name=self.run_name,
                                           nested=self.nested_run, tags=self.tags, description=self.description,
                                           log_system_metrics=system)
        self.logged = set(mlflow.MlflowClient().get_run(self.active_run.info.run_id).data.params)

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        import mlflow
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        # a resumed run's params stay its first session's (MLflow refuses changing one; config.yaml, the artifact, is
        # the session's own)
        params = list({key: clip(str(value), MAX_PARAM_VAL_LENGTH) for key, value in values.items()
                       if key not in self.logged}.items())
        for at in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):  # MLflow takes so many per call
            mlflow.log_params(dict(params[at:at + MAX_PARAMS_TAGS_PER_BATCH]))

    def abort(self, status: str = "FAILED") -> None:
        import mlflow

        mlflow.end_run(status=status)


def clip(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters, a clipped one saying so (the whole value is in config.yaml)."""
    if len(text) <= limit:
        return text
    note = f" ... ({len(text)} characters: config.yaml)"
    return text[:limit - len(note)] + note


def accelerator_log_with(run: Any) -> list[Any] | None:
    """``Accelerator(log_with=...)`` for ``run``: None, or the trackers built here. TensorBoard writes to
    output/tensorboard/, MLflow names its experiment run.log_project and its run after run.output, W&B / Comet /
    Aim / ... take run.log_project as their project as Accelerate gives it (those with a run name, W&B, SwanLab,
    Trackio, ClearML, the run.output's)."""
    names, name = trackers(run), run_name(run)
    built: list[Any] = []
    for tracker in names:
        if tracker == "tensorboard":
            built.append(RunTensorBoard("tensorboard", run.output))
        elif tracker == "mlflow":
            built.append(RunMLflow(run.log_project, run_name=name, run_id=resumed_run_id(run),
                                   tags={"patchplace.output": str(Path(run.output).absolute())}))
        else:
            cls = LOGGER_TYPE_TO_CLASS[tracker]
            place = (run.output,) if cls.requires_logging_directory else ()
            built.append(cls(run.log_project, *place, **named(tracker, name)))
    return built or None


TRACKER_RUNS = "tracker_runs.json"  # in run.output: the MLflow run a resume continues


def resumed_run_id(run: Any) -> str | None:
    """The MLflow run a resume of ``run`` continues (its id, recorded in run.output/tracker_runs.json when the run's
    first session started it); None for a new run (MLflow starts one)."""
    path = Path(run.output) / TRACKER_RUNS
    if not getattr(run, "resume", False) or not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get("mlflow")
    except (ValueError, AttributeError):
        return None


def _record_run_ids(acc: Any, out: Path) -> None:
    """run.output/tracker_runs.json: the MLflow run this session logs to, for a resume to continue it."""
    for tracker in acc.trackers:
        if isinstance(tracker, RunMLflow):
            (out / TRACKER_RUNS).write_text(json.dumps({"mlflow": tracker.active_run.info.run_id}) + "\n")


def end_trackers(acc: Any, exc: BaseException) -> None:
    """A session that ends in ``exc`` (main process): MLflow's run marked KILLED (interrupted: SIGTERM / SIGINT,
    resumable) or FAILED (any other error, a diverged loss) instead of FINISHED at the interpreter's exit."""
    if not getattr(acc, "is_main_process", False):
        return
    status = "KILLED" if type(exc).__name__ in ("Interrupted", "KeyboardInterrupt") else "FAILED"
    for tracker in getattr(acc, "trackers", ()):
        if isinstance(tracker, RunMLflow) and getattr(tracker, "active_run", None) is not None:
            tracker.abort(status)


def named(tracker: str, name: str) -> dict[str, str]:
    """The keyword a tracker's own start takes the run name by (W&B's ``wandb.init(name=)``, ...); none where the
    user's environment names it (CLEARML_TASK)."""
    if tracker == "clearml":
        return {} if "CLEARML_TASK" in os.environ else {"task_name": name}
    key = {"wandb": "name", "trackio": "name", "swanlab": "experiment_name"}.get(tracker)
    return {key: name} if key else {}


def flat_config(tree: dict[str, Any], prefix: str = "") -> dict[str, bool | int | float | str]:
    """A config as the trackers' params / hparams: dotted keys (optim.lr), scalars as they are, lists and nulls as
    JSON (["mlflow"], null)."""
    flat: dict[str, bool | int | float | str] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flat_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, bool | int | float | str) else json.dumps(value)
    return flat


def start_trackers(acc: Any, run: Any, config: Any, lock: Any = None) -> None:
    """Start the run's trackers (main process) with the resolved config as their params / hparams, and its YAML as
    text (TensorBoard) or an artifact (MLflow). A tracker that does not start (MLflow refusing its store, say) is
    one line on every rank (exit 2), with every file the start wrote in run.output removed again, and ``lock`` (the
    run directory's lock: its ``path``) too if nothing else is left."""
    if not trackers(run):
        return
    problem = _start(acc, run, config, lock) if acc.is_main_process else None
    if acc.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        problem = broadcast_object_list([problem], from_process=0)[0]
    if problem is not None:
        error = ConfigError(problem)
        error.every_rank = True  # (launch.every_rank: printed once)
        raise error


def _start(acc: Any, run: Any, config: Any, lock: Any) -> str | None:
    """:func:`start_trackers` on the main process: None, or what went wrong."""
    out = Path(run.output)
    before = set(out.rglob("*"))
    tree = to_dict(config)
    try:
        acc.init_trackers(run.log_project, config=flat_config(tree))
        _record_config(acc, dump_yaml(tree))
        _record_run_ids(acc, out)
    except Exception as exc:  # whatever a tracker's package raises (MlflowException, OSError, ...)
        failed = _failed(acc, exc)
        _abort(acc)
        _remove_new(out, before, None if lock is None else lock.path)
        return tracker_failure(failed, exc)
    return None


def _record_config(acc: Any, text: str) -> None:
    """The config's YAML: TensorBoard's text "config", MLflow's artifact config.yaml (there from the start)."""
    for tracker in acc.trackers:
        if isinstance(tracker, RunTensorBoard):
            tracker.writer.add_text("config", "".join(f"    {line}\n" for line in text.splitlines()))  # code block
            tracker.writer.flush()
        elif isinstance(tracker, RunMLflow):
            from mlflow import MlflowClient

            MlflowClient().log_text(tracker.active_run.info.run_id, text, "config.yaml")


def _failed(acc: Any, exc: BaseException) -> str:
    """The tracker that failed: the first not started, else the one whose package raised ``exc``."""
    for tracker in acc.trackers:
        if getattr(tracker, "tracker", None) is None:  # (each keeps its run / writer from its start)
            return tracker.name
    package = type(exc).__module__.split(".")[0]
    names = [t.name for t in acc.trackers]
    found = ERROR_PACKAGES.get(package, package)
    return found if found in names else " / ".join(names)


def _abort(acc: Any) -> None:
    """End the trackers a failed start left open (MLflow's run marked FAILED), so none is left running."""
    for tracker in acc.trackers:
        if getattr(tracker, "tracker", None) is not None:
            with contextlib.suppress(Exception):  # closing what half-started: its own error is the one reported
                (tracker.abort if hasattr(tracker, "abort") else tracker.finish)()
    acc.trackers.clear()


def _remove_new(out: Path, before: set[Path], lock: Path | None) -> None:
    """Remove what appeared in ``out`` since ``before`` (deepest first), and the ``lock`` file of a directory left
    with nothing else, which a refused launch then removes (launch.remove_created_output): the next run finds no
    half-made run folder."""
    for path in sorted(set(out.rglob("*")) - before, key=lambda p: len(p.parts), reverse=True):
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink()
    if lock is not None and list(out.iterdir()) == [lock]:
        lock.unlink()


def tracker_failure(name: str, exc: BaseException) -> str:
    """The one line of a tracker that did not start: its error, how to set it up, or how to leave it out."""
    hint = {"mlflow": "MLflow opens the store MLFLOW_TRACKING_URI names (unset, MLflow 3's sqlite:///mlflow.db, which "
                      "needs the sqlalchemy of the full mlflow package), e.g. MLFLOW_TRACKING_URI=file:mlruns "
                      "MLFLOW_ALLOW_FILE_STORE=true or an MLflow server's http://host:5000"}.get(
        name, "set it up as its documentation says")
    leave = "run.tensorboard=false" if name == "tensorboard" else f"leave {name} out of run.log_with"
    return f"run.log_with: {name} did not start ({type(exc).__name__}: {one_line(exc)}); {hint}, or {leave}"


def finish_trackers(acc: Any, output: str | Path, step: int) -> None:
    """The run's files where a tracker keeps them (main process, after the final checkpoint): MLflow's artifacts
    (:data:`RUN_FILES`: config.yaml, optimizer.json, the model card and the final checkpoint's config.json with its
    metadata), TensorBoard's text "model_card". Closing them is ``end_training``'s."""
    if not acc.is_main_process:
        return
    out = Path(output)
    for tracker in acc.trackers:
        if isinstance(tracker, RunMLflow):
            from mlflow import MlflowClient

            client, run_id = MlflowClient(), tracker.active_run.info.run_id
            for name, folder in RUN_FILES:
                if (out / name).is_file():
                    client.log_artifact(run_id, str(out / name), folder)
        elif isinstance(tracker, RunTensorBoard) and (out / "checkpoint" / "README.md").is_file():
            tracker.writer.add_text("model_card", (out / "checkpoint" / "README.md").read_text(), global_step=step)
            tracker.writer.flush()


class StepLog:
    """A training step's record in log.jsonl (and the trackers' train/*): the objective's scalars averaged over
    ranks, the lr the step trained with (groups carry it x their layer-decay lr_scale), the epoch, the weight decay
    under a schedule of it, the throughput (``meter``), the shards data.skip_corrupt skipped; the bar's loss."""

    def __init__(self, acc: Any, log: JsonlLog, run: Any, data: Any, meter: Throughput, bar: tqdm,
                 decaying: Any | None) -> None:
        self.acc, self.log, self.run, self.data, self.meter, self.bar = acc, log, run, data, meter, bar
        self.decaying = decaying  # the optimizer whose weight decay follows optim.weight_decay_end, else None

    def write(self, step: int, epoch: int, out: dict[str, Any], lr: float) -> None:
        acc = self.acc
        scalars = {k: float(acc.reduce(v.detach().float(), "mean")) for k, v in out.items()
                   if torch.is_tensor(v) and v.numel() == 1}
        scalars.update(lr=lr, epoch=epoch)
        if self.decaying is not None:  # the weight decay the decaying groups trained with
            scalars["wd"] = max(group["weight_decay"] for group in self.decaying.param_groups)
        scalars.update(self.meter.record(acc.num_processes))
        if self.data.train.skipped:  # data.skip_corrupt (counted in this process; workers warn)
            scalars["skipped_shards"] = len(set(self.data.train.skipped))
        self.log.write({"step": step, **scalars, "world_size": acc.num_processes, "data": self.data.path})
        if trackers(self.run):  # namespaced as TensorBoard groups them: train/loss, train/lr, ...
            acc.log({f"train/{k}": v for k, v in scalars.items()}, step=step)
        self.bar.set_postfix(loss=f"{scalars['loss']:.4f}")
