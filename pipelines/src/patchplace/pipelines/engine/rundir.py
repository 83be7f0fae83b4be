"""The run directory of a training as the one object the Trainer holds (:class:`RunDir`): the lock and the checks
before a run starts or resumes (:meth:`RunDir.claim`: what ``run.output`` holds against run.resume / run.overwrite,
config.yaml, the newest checkpoint against this launch), the records of the run (config.yaml, optimizer.json, the
evaluations in log.jsonl and the trackers), its checkpoints (:class:`~.checkpoints.Checkpoints`, written through the
crash-consistent protocol of ``protocol.py``) and the resume. What fills ``snapshots/`` and ``best/`` are the
callbacks of ``callbacks.py``.

Run directory (``run.output``; one run at a time)::

    config.yaml        the resolved config
    optimizer.json     the peak lr, its scaling, and what every parameter group gets (lr scale, weight decay)
    log.jsonl          one JSON object per logged step / evaluation (main process), each step once
    checkpoints/step-N/  the last complete checkpoint: checkpoint/ (backbone ``save_pretrained`` + objective
                       extras), state/ (Accelerate state + trainer.json, for ``run.resume=true``), COMPLETE
    checkpoint         -> checkpoints/step-N/checkpoint (what fine-tuning, evaluation and export load)
    snapshots/epoch-E/ run.keep_epochs: the backbone folder (as checkpoint/ holds it) after E epochs, metadata with
                       step and epoch (epoch-0: the initial weights)
    best/              run.early_stop_patience: the backbone folder of the best evaluation (metadata: step,
                       best_metric, best_value, metrics); the one to evaluate
    ema/               run.model_ema: the backbone folder of the weights' EMA at the end (metadata: model_ema, the
                       EMA's own evaluation in metrics); its running average: state/model_ema.safetensors
    tensorboard/       TensorBoard event files
    .lock              held while a process runs the directory
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from ruamel.yaml.error import YAMLError

from patchplace.data.atomic import atomic_file, write_json_atomic
from patchplace.objectives.declarations import known_methods
from patchplace.pipelines.config import ConfigError, dump_yaml, one_line, parse_yaml, to_dict
from patchplace.pipelines.engine.budget import extension_problem, layout_problem
from patchplace.pipelines.engine.checkpoints import Checkpoints, Saved, recorded_config, recorded_data
from patchplace.pipelines.engine.guards import FiniteCheck
from patchplace.pipelines.engine.launch import Interrupted, every_rank, relaunch
from patchplace.pipelines.engine.logs import Console, JsonlLog, read_log, trackers, truncate_log
from patchplace.pipelines.engine.protocol import (
    CHECKPOINTS,
    CheckpointError,
    RunLock,
    complete_steps,
    latest_step,
    newest_state,
    tidy_folders,
    verify,
)
from patchplace.pipelines.engine.relayout import Layout
from patchplace.pipelines.sections import OptimSection, RunSection

# What a training run leaves in its directory (run.overwrite=true removes exactly these).
RUN_ENTRIES = ("log.jsonl", "config.yaml", "optimizer.json", CHECKPOINTS, "checkpoint", "tensorboard", "snapshots",
               "best", "ema")
# Config fields a resumed run may change: they do not change what is trained (run.output: the same directory
# spelled another way, relative / absolute / a trailing slash, or the run moved elsewhere).
RESUMABLE_CHANGES = ("run.output", "run.resume", "run.overwrite", "run.log_every", "run.checkpoint_every",
                     "run.eval_every", "run.tensorboard", "run.log_with", "run.log_project",
                     "run.find_unused_parameters", "run.finite_check",
                     "data.verify_shards", "data.timeout", "data.retries")
# the budget a resume may extend (:meth:`RunDir.claim` checks it grows: :func:`.budget.extension_problem`)
EXTENDABLE = ("optim.epochs", "optim.max_steps", "optim.extend")
# the layout of a step's global batch a resume may change while keeping it (:meth:`RunDir.claim` checks the product)
RELAYOUT = ("data.batch_size", "run.grad_accum")


def holds_run(directory: Path) -> bool:
    """Whether ``directory`` holds (part of) a training run: a log, checkpoints, or a checkpoint link."""
    return any((directory / name).exists() or (directory / name).is_symlink() for name in
               ("log.jsonl", CHECKPOINTS, "checkpoint"))


def prepare_directory(directory: Path, *, resume: bool, overwrite: bool, config: dict[str, Any],
                      moved: tuple[str, ...] = (), recorded: tuple[int, dict[str, Any]] | None = None) -> None:
    """Check what ``run.output`` holds against ``run.resume`` / ``run.overwrite`` (main process, lock held).

    * A directory with a run and neither flag: an error (nothing is overwritten silently).
    * ``run.overwrite=true``: the previous run's files are removed first (other files are left alone).
    * ``run.resume=true`` over a run whose ``config.yaml`` differs in a field that changes what is trained: an
      error listing the fields (the run would otherwise follow its old schedule while config.yaml says otherwise).
      ``moved``: fields that may change too (data locations whose contents the caller compares by fingerprint).
    * ``run.resume=true`` over a ``config.yaml`` edited since the run wrote it: an error listing the fields that
      differ from ``recorded`` ((step, config) the newest checkpoint holds); without ``config.yaml``, the launch is
      compared with ``recorded``.
    """
    if overwrite and resume:
        raise ConfigError("run.resume=true and run.overwrite=true contradict each other: pick one")
    if not holds_run(directory):
        return
    if overwrite:
        for name in RUN_ENTRIES:
            path = directory / name
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.is_dir():
                shutil.rmtree(path)
        return
    if not resume:
        step = latest_step(directory)
        what = f"a run with a checkpoint at step {step}" if step is not None else "a run (log.jsonl)"
        raise ConfigError(f"run.output {directory} already holds {what}: continue it with run.resume=true, replace "
                          "it with run.overwrite=true, or choose another run.output")
    saved = directory / "config.yaml"
    old = _saved_config(saved)
    if recorded is not None and old is not None:
        edited = config_changes(recorded[1], old, (*moved, *EXTENDABLE, *RELAYOUT, "data.num_workers"))
        if edited:
            raise ConfigError(f"run.resume=true: {saved} was edited after the run wrote it: {', '.join(edited)} "
                              f"(the step-{recorded[0]} checkpoint's value -> the file's), so it no longer says what "
                              f"the run trained with; restore those values in {saved}, or start a new run (another "
                              "run.output, or run.overwrite=true)")
    source = saved
    if old is None and recorded is not None:  # config.yaml is gone: the checkpoint's record says what was trained
        old, source = recorded[1], f"what the step-{recorded[0]} checkpoint recorded (no {saved})"
    if old is not None:
        # data.num_workers plans a streamed epoch (which samples each DataLoader worker reads, in which order):
        # resumable only for a run whose data.train was held in memory (its log says so), where it just loads the
        # shards in parallel
        workers = (old or {}).get("data", {}).get("num_workers"), config.get("data", {}).get("num_workers")
        if workers[0] is not None and workers[0] != workers[1] and streamed(directory, old or {}):
            raise ConfigError(f"run.resume=true: data.num_workers was {workers[0]} in {source} and the run streamed "
                              f"data.train, whose epochs it plans (which samples each worker reads, in which order); "
                              f"resume with data.num_workers={workers[0]}, or start a new run")
        changed = config_changes(old or {}, config, (*moved, *EXTENDABLE, *RELAYOUT, "data.num_workers"))
        if changed:
            raise ConfigError(f"run.resume=true: {', '.join(changed)} differ from {source}; resume with the run's "
                              "values, or start a new run (another run.output, or run.overwrite=true)")


def _saved_config(saved: Path) -> dict[str, Any] | None:
    """A run's ``config.yaml`` (None: there is none), or a one-line :class:`ConfigError` when it cannot be read."""
    if not saved.is_file():
        return None
    try:
        old = parse_yaml(saved.read_text())
        if not isinstance(old, dict | None):
            raise ValueError(f"a {type(old).__name__}, not a mapping")
    except (ValueError, YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"run.resume=true: {saved} is unreadable ({one_line(exc)}), so the run's settings "
                          "cannot be checked: restore it, or start over with run.overwrite=true") from None
    return old or {}


def streamed(directory: Path, saved: dict[str, Any]) -> bool:
    """Whether the run in ``directory`` streamed data.train: its config.yaml's data.in_memory is not true and its
    log's last step record does not say ``memory`` (no record: assumed streamed)."""
    if saved.get("data", {}).get("in_memory") is True:
        return False
    log = directory / "log.jsonl"
    try:
        lines = log.read_text().splitlines() if log.is_file() else []
    except (OSError, UnicodeDecodeError):
        return True
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("data"), dict) and "train" in record["data"]:
            return record["data"]["train"] != "memory"
    return True


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _objective_in_force(tree: dict[str, Any]) -> dict[str, Any]:
    """A pretraining config with its ``objective`` section completed by its method's defaults (the config class's,
    then the registration's): config.yaml records every objective field in force, a run written before it did the
    given fields only, and both must compare by what they train with (resuming such a run, its checkpoint's
    record). Other configs, or a method no longer registered, as they are."""
    method, given = tree.get("method"), tree.get("objective")
    spec = known_methods().get(method) if isinstance(method, str) and isinstance(given, dict) else None
    return {**tree, "objective": {**spec.config_values(), **given}} if spec is not None else tree


def config_changes(saved: dict[str, Any], current: dict[str, Any], moved: tuple[str, ...] = ()) -> list[str]:
    """``field (old -> new)`` for every field of both configs that differs and is not in RESUMABLE_CHANGES (nor
    in ``moved``)."""
    old, new = _flatten(_objective_in_force(saved)), _flatten(_objective_in_force(current))
    # early stopping counts evaluations: their cadence changes where it stops
    fixed = {"run.eval_every"} if new.get("run.early_stop_patience") else set()
    return [f"{k} ({old[k]!r} -> {new[k]!r})" for k in sorted(old.keys() & new.keys())
            if (k not in (*RESUMABLE_CHANGES, *moved) or k in fixed) and not _same(old[k], new[k])]


class RunDir:
    """``run.output`` of one training, held by the :class:`~patchplace.pipelines.engine.trainer.Trainer`: the checks
    before it starts or resumes (:meth:`claim`), the crash-consistent checkpoints (:meth:`save`), the backbone
    folders beside them (:meth:`publish`), the resume (:meth:`resume`) and the records of the run (config.yaml,
    optimizer.json, the evaluations in log.jsonl and the trackers). ``train``: the training reader, whose budget a
    resume on another layout or with another optim.epochs / optim.max_steps is checked against."""

    def __init__(self, accelerator: Accelerator, run: RunSection, optim: OptimSection, config: Any, saved: Saved,
                 *, train: Any, finite: FiniteCheck, command: str) -> None:
        self.acc, self.run, self.optim, self.config, self.saved = accelerator, run, optim, config, saved
        self.train, self.finite, self.command = train, finite, command
        self.out = Path(run.output)
        self.log = JsonlLog(self.out / "log.jsonl", accelerator.is_main_process)
        self.console = Console(accelerator.is_main_process)
        self.checkpoints = Checkpoints(accelerator, self.out, config, saved, finite)
        self.lock = RunLock(self.out) if accelerator.is_main_process else None
        self.stopped_early: dict[str, Any] | None = None  # the early stop a resumed checkpoint records
        # optim.extend=phase: the step the schedule's current phase starts at (0: the run's one schedule)
        self.schedule_start = 0
        self.resumed_trainer: dict[str, Any] | None = None  # the resumed checkpoint's trainer.json
        self.resumed_layout: Layout | None = None  # the layout it was written by, where this launch's differs

    # ------------------------------------------------------------------ before training
    def claim(self) -> None:
        """One run per directory: the main process holds run.output's lock until :meth:`release` and, before
        anything is written, checks what the directory holds (:meth:`_check_directory`). A refusal reaches every
        rank (one line, exit 2 everywhere) and leaves every file of the run as it was."""
        refusal: ConfigError | None = None
        if self.lock is not None:
            try:
                self.lock.acquire()
                try:
                    self._check_directory()
                except BaseException:
                    self.lock.release(restore=True)
                    raise
            except ConfigError as exc:
                refusal = exc
        refusal = self._from_main(refusal)
        if refusal is not None:
            raise every_rank(refusal)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()

    def _from_main(self, refusal: ConfigError | None) -> ConfigError | None:
        """The main process's refusal (None: none), on every rank."""
        if self.acc.num_processes == 1:
            return refusal
        shared = broadcast_object_list([None if refusal is None else str(refusal)], from_process=0)
        if shared[0] is None:
            return None
        return refusal if self.acc.is_main_process else ConfigError(shared[0])

    def _check_directory(self) -> None:
        """What run.output holds against run.resume / run.overwrite and the config; on resume, the newest checkpoint
        against this launch: sealed and intact, written by as many processes, trained on the same data (compared by
        fingerprint, wherever the data lie now), a budget that does not shrink. Main process, lock held; reads
        only."""
        run, found, recorded, settings = self.run, None, {}, None
        if run.resume and not run.overwrite:
            found = newest_state(self.out)
            if found is not None:
                verify(found[1])
                recorded, settings = recorded_data(found[0]), recorded_config(found[0])
        moved = tuple(name for key in recorded for name in (key, f"{key}_urls"))
        prepare_directory(self.out, resume=run.resume, overwrite=run.overwrite, config=to_dict(self.config),
                          moved=moved, recorded=settings)
        if found is not None:
            trainer = json.loads((found[0] / "trainer.json").read_text())
            self._check_processes(found[0], trainer)
            self._check_data(recorded, trainer["step"])
            batch_size = self.config.data.batch_size
            if problem := (extension_problem(trainer, self.train, batch_size, run.grad_accum, self.optim)
                           or layout_problem(trainer, self.layout(), self.train, self.optim)):
                raise ConfigError(problem)

    def _check_processes(self, state: Path, trainer: dict[str, Any]) -> None:
        """Another process count, per-process batch or run.grad_accum than the checkpoint's continues the run when
        the global batch is kept (:mod:`.relayout`); a changed global batch is refused."""
        saved, now = Layout.of_checkpoint(trainer), self.layout()
        if saved is not None and saved.global_batch == now.global_batch:
            return
        count = trainer.get("world_size") or len(list(state.glob("random_states_*.pkl")))
        if saved is None and count == self.acc.num_processes:
            return
        written = saved.words() if saved is not None else f"{count} process(es)"
        keep = (f"keep data.batch_size x processes x run.grad_accum = {saved.global_batch} (e.g. resume with "
                f"{relaunch(saved.processes, f'{self.command} run.resume=true')})") if saved is not None else \
            f"resume with {relaunch(count, f'{self.command} run.resume=true')}"
        raise CheckpointError(
            f"run.resume=true: the step-{trainer['step']} checkpoint in {self.out} was written by {written}, this "
            f"launch has {now.words()}: the global batch would change what every step averages; {keep}, or start "
            "a new run (another run.output, or run.overwrite=true)")

    def layout(self) -> Layout:
        """This launch's layout of a step's global batch."""
        return Layout(self.acc.num_processes, self.config.data.batch_size, self.run.grad_accum)

    def _check_data(self, recorded: dict[str, str], step: int) -> None:
        for key, fingerprint in recorded.items():
            now = self.saved.fingerprints.get(key)
            if now != fingerprint:
                where = getattr(self.config.data, key.split(".")[1], "?")
                raise ConfigError(
                    f"run.resume=true: {key}={where} holds other data (fingerprint {str(now)[:16]}) than the "
                    f"step-{step} checkpoint in {self.out} was trained on (fingerprint "
                    f"{fingerprint[:16]}): point {key} at that data (its path may change: the fingerprint is "
                    "compared, not the path), or train on this data in a new run (another run.output, or "
                    "run.overwrite=true)")

    # ------------------------------------------------------------------ writes
    def save(self, step: int, metrics: dict[str, Any] | None = None, records: dict[str, Any] | None = None) -> None:
        """The checkpoint of ``step`` (:meth:`.checkpoints.Checkpoints.save`); ``metrics``: the end-of-run
        evaluation, sealed into its model card; ``records`` (the callbacks' ``on_end``: the early stop's summary)
        go into ``state/trainer.json`` beside the step, the layout, the data fingerprints, the lr schedule's phase
        and the config a resume checks config.yaml against."""
        saved = self.saved
        record = {"step": step, "world_size": self.acc.num_processes, "global_batch": saved.global_batch,
                  "data": saved.fingerprints, **(records or {}), "schedule_start": self.schedule_start,
                  "config": to_dict(self.config)}
        self.checkpoints.save(step, record, metrics)

    def publish(self, name: str, step: int, metadata: dict[str, Any], missing_only: bool = False) -> bool:
        """The backbone of ``step`` as the folder ``name`` (:meth:`.checkpoints.Checkpoints.publish`)."""
        return self.checkpoints.publish(name, step, metadata, missing_only)

    def record_run(self, plan: Any, optim: OptimSection, groups: Any) -> None:
        """``optimizer.json`` (the peak lr, its scaling, and ``groups``: what every parameter really gets) and
        ``config.yaml``, written by the main process once the resume is accepted: a refused one leaves the run's
        files alone."""
        if self.acc.is_main_process:
            write_json_atomic(self.out / "optimizer.json", {
                "lr": plan.peak_lr, "config_lr": optim.lr, "lr_scaling": optim.lr_scaling,
                "lr_base_batch": plan.lr_base_batch, "global_batch": plan.global_batch,
                "processes": self.acc.num_processes, "layer_decay": optim.layer_decay,
                "weight_decay": optim.weight_decay, "parameters": groups})
            history = self.config_history()
            with atomic_file(self.out / "config.yaml") as tmp:
                tmp.write_text("".join(f"{line}\n" for line in history) + dump_yaml(to_dict(self.config)))

    def config_history(self) -> list[str]:
        """config.yaml's history: the comment lines of the extensions before (kept) and this session's, if it
        extends the budget the resumed checkpoint was trained for."""
        path, lines = self.out / "config.yaml", []
        if path.is_file():
            lines = [line for line in path.read_text().splitlines() if line.startswith("# extended at step ")]
        old = (self.resumed_trainer or {}).get("config", {}).get("optim", {})
        new = to_dict(self.config).get("optim", {})
        changed = [f"optim.{key} {old[key]!r} -> {new[key]!r}" for key in ("epochs", "max_steps")
                   if key in old and old[key] != new.get(key)]
        if changed:
            step = self.resumed_trainer["step"]
            lines.append(f"# extended at step {step}: {', '.join(changed)} (optim.extend={new.get('extend')})")
        return lines

    def record_eval(self, step: int, result: dict[str, Any], key: str = "eval", prefix: str = "val/") -> None:
        """An evaluation of ``step`` in log.jsonl (under ``key``) and the trackers (``prefix``: val/top1, ...).
        Main process."""
        self.log.write({"step": step, key: result})
        if trackers(self.run):  # beside train/*
            self.acc.log({f"{prefix}{k}": v for k, v in result.items() if isinstance(v, int | float)
                          and k != "count"}, step=step)

    # ------------------------------------------------------------------ resume
    def resume_step(self) -> int:
        """``run.resume=true``: load the newest complete checkpoint (0: none yet), which the main process checked
        in :meth:`claim` (sealed, intact, as many processes, the same data)."""
        if not self.run.resume:
            return 0
        found = newest_state(self.out)
        if found is None:
            self.acc.print(f"run.resume=true: {self.out} holds no checkpoint yet; starting at step 0")
            return 0
        trainer = json.loads((found[0] / "trainer.json").read_text())
        self.stopped_early = trainer.get("stopped_early")
        self.resumed_trainer = trainer
        self.schedule_start = int(trainer.get("schedule_start", 0))
        self.resumed_layout = self.checkpoints.load(found[0], trainer, self.layout(), self.run.seed)
        return int(trainer["step"])

    def resume(self) -> int:
        """The step this session starts at (:meth:`resume_step`), with the run directory made whole for it: what a
        kill in a snapshot / best/ write left is removed and the log is cut back to that step (the later steps are
        logged again). A session that extends the budget under ``optim.extend=phase`` starts the schedule's new
        phase there (later resumes of that phase keep its start). What the callbacks kept of that step is theirs to
        restore (``on_start``)."""
        step = self.resume_step()
        if self.acc.is_main_process:
            for parent in (self.out, self.out / "snapshots"):  # what a kill in a snapshot / best/ write left
                tidy_folders(parent)
            if self.run.resume:
                truncate_log(self.out / "log.jsonl", step)  # the steps after the checkpoint are logged again
        old = (self.resumed_trainer or {}).get("config", {}).get("optim", {})
        if self.resumed_trainer is not None and self.optim.extend == "phase" and any(
                old.get(key, getattr(self.optim, key)) != getattr(self.optim, key) for key in ("epochs", "max_steps")):
            self.schedule_start = step
        return step

    def records(self) -> list[dict[str, Any]]:
        """log.jsonl's records (main process; none elsewhere or before the first)."""
        path = self.out / "log.jsonl"
        return read_log(path)[0] if self.acc.is_main_process and path.is_file() else []

    def finish_resumed(self, step: int, total: int) -> dict[str, Any]:
        """A resumed run that had finished (``step`` of ``total``, or stopped early): nothing to train, nothing to
        rewrite, only what a kill in its last save left undone (the link, the old step). Returns its last
        evaluation (the last in its log)."""
        if self.acc.is_main_process:
            self.checkpoints.settle(complete_steps(self.out)[-1][1])
        how = f"stopped early at step {step} of {total}" if self.stopped_early else f"step {step} of {total}"
        self.acc.print(f"run.resume=true: {self.out} is complete ({how}); nothing to do")
        evals = [r["eval"] for r in self.records() if isinstance(r.get("eval"), dict)]
        return evals[-1] if evals else {}

    def interrupted(self, step: int, signum: int) -> Interrupted:
        """The stop a signal asked for, after the checkpoint of ``step``: how to resume (exit 128 + signal)."""
        name = signal.Signals(signum).name
        launcher = "python" if self.acc.num_processes == 1 else "accelerate launch <the same launch options>"
        return Interrupted(f"interrupted by {name} at step {step}: checkpoint saved in {self.out}/checkpoints; "
                           f"resume with: {launcher} {self.command} run.resume=true", 128 + signum)
