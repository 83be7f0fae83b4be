"""What a training does beside its steps, as callbacks of the :class:`~patchplace.pipelines.engine.trainer.Trainer`'s
loop: the periodic checkpoints of ``run.checkpoint_every`` (:class:`CheckpointEvery`), the learning-curve snapshots
of ``run.keep_epochs`` (:class:`KeepEpochs`), ``best/`` and early stopping of ``run.early_stop_patience``
(:class:`KeepBest`), and ``run.model_ema``'s average (:class:`KeepEma`); and the pipeline's evaluation
(:class:`Evaluation`). The loop calls every callback's hooks in this order within a step: ``on_step`` (after the
step's log record), ``on_evaluate`` (after an evaluation), ``on_checkpoint`` (after the step's checkpoint); at the
run's end ``on_evaluate`` (the closing evaluation, unless it stopped early), ``on_end`` (before the final
checkpoint), ``on_checkpoint`` and ``on_close``; and ``on_start`` once the session's first step is loaded. Each
writes through the :class:`~patchplace.pipelines.engine.rundir.RunDir` it is given.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from patchplace.pipelines.config import ConfigError
from patchplace.pipelines.engine.checkpoints import folder_step, snapshot_name
from patchplace.pipelines.engine.ema import WeightsEma
from patchplace.pipelines.engine.inputs import metrics_split
from patchplace.pipelines.engine.launch import sharded
from patchplace.pipelines.engine.protocol import publish_folder
from patchplace.pipelines.engine.rundir import RunDir
from patchplace.pipelines.engine.scoring import BestTracker
from patchplace.pipelines.sections import RunSection

Evaluate = Callable[[nn.Module, int], dict[str, Any]]


class Callback:
    """The hooks of the Trainer's loop; each does nothing unless a callback says otherwise."""

    def acts_at(self, step: int) -> bool:
        """Whether ``on_step`` writes anything of ``step`` (the lazy finite check settles before it)."""
        return False

    def on_start(self, step: int) -> None:
        """The session starts at ``step``, its weights loaded (resume: what a kill left unwritten of it)."""

    def on_step(self, step: int, epoch: int, out: dict[str, Any]) -> bool:
        """After optimizer step ``step``'s log record. True: checkpoint this step (a resumed run can redo it)."""
        return False

    def on_evaluate(self, step: int, result: dict[str, Any]) -> tuple[bool, bool]:
        """After the evaluation of ``step`` (every rank; ``result`` on the main process): (checkpoint, stop now)."""
        return False, False

    def on_checkpoint(self, step: int) -> None:
        """After the checkpoint of ``step`` is sealed."""

    def on_end(self, step: int, stopped: bool) -> dict[str, Any]:
        """The run ends at ``step`` (``stopped``: early), before its final checkpoint; returns what that
        checkpoint's ``state/trainer.json`` records of it (JSON; keys other than step, world_size, global_batch,
        data and config)."""
        return {}

    def on_close(self) -> None:
        """The run is over (or a resumed run found it finished): last words."""


class CheckpointEvery(Callback):
    """``run.checkpoint_every``: a checkpoint every ``every`` optimizer steps (the last one: the run's end)."""

    def __init__(self, every: int) -> None:
        self.every = every

    def acts_at(self, step: int) -> bool:
        return step % self.every == 0

    def on_step(self, step: int, epoch: int, out: dict[str, Any]) -> bool:
        return step % self.every == 0


class KeepEpochs(Callback):
    """``run.keep_epochs``: the backbone after epoch E in ``snapshots/epoch-E/`` (metadata with step and epoch;
    epoch 0: the initial weights). A snapshot step is a checkpoint step, written before its checkpoint."""

    def __init__(self, rundir: RunDir, snapshots: dict[int, float]) -> None:
        self.rundir, self.snapshots = rundir, snapshots

    def acts_at(self, step: int) -> bool:
        return step in self.snapshots

    def on_start(self, step: int) -> None:
        if step in self.snapshots:  # unless a kill left it unwritten, it is there
            self.snapshot(step, missing_only=True)

    def on_step(self, step: int, epoch: int, out: dict[str, Any]) -> bool:
        if step not in self.snapshots:
            return False
        self.snapshot(step)
        return True

    def snapshot(self, step: int, missing_only: bool = False) -> None:
        """Keep the backbone of ``step`` (every rank calls this; the main process writes)."""
        epoch = self.snapshots[step]
        name = snapshot_name(epoch)
        if self.rundir.publish(name, step, {"epoch": epoch}, missing_only=missing_only):
            self.rundir.log.write({"step": step, "snapshot": name})
            self.rundir.console.print(f"snapshot: epoch {epoch:g} (step {step}) in {self.rundir.out / name}")


class KeepBest(Callback):
    """``run.early_stop_patience``: ``best/`` holds the backbone of the best evaluation of ``run.early_stop_metric``
    (metadata: step, best_metric, best_value, metrics), written right after its step's checkpoint; the run stops
    after ``patience`` evaluations without a better one. Early stopping's state is replayed from the log on resume."""

    def __init__(self, rundir: RunDir, tracker: BestTracker, snapshots: dict[int, float], total: int) -> None:
        self.rundir, self.tracker, self.snapshots, self.total = rundir, tracker, snapshots, total
        self.pending: int | None = None  # a new best whose checkpoint is not written yet

    def on_start(self, step: int) -> None:
        """Early stopping's evaluations up to the checkpoint, from the log; best/ where a kill left it unwritten."""
        rundir, tracker = self.rundir, self.tracker
        if rundir.acc.is_main_process and rundir.run.resume:
            tracker.replay(rundir.records())
        if not rundir.acc.is_main_process or tracker.best_step is None:
            return
        if folder_step(rundir.out / "best") != tracker.best_step:
            if tracker.best_step == step:
                self.save_best(step)
            else:
                print(f"warning: {rundir.out / 'best'} does not hold the best step ({tracker.best_step}) of the log, "
                      "whose weights are gone (was it changed by hand?); it is rewritten at the next better "
                      "evaluation", file=sys.stderr)

    def on_evaluate(self, step: int, result: dict[str, Any]) -> tuple[bool, bool]:
        """The main process's decision given to every rank (only it evaluates)."""
        acc = self.rundir.acc
        flags = [0, 0]
        if acc.is_main_process:
            flags = [int(self.tracker.update(step, result)), int(self.tracker.exhausted)]
        if acc.num_processes > 1:
            shared = torch.tensor(flags, device=acc.device)
            torch.distributed.broadcast(shared, src=0)
            flags = shared.tolist()
        if flags[0]:
            self.pending = step
        return bool(flags[0]), bool(flags[1])

    def on_checkpoint(self, step: int) -> None:
        if self.pending == step:
            self.save_best(step)
        self.pending = None

    def on_end(self, step: int, stopped: bool) -> dict[str, Any]:
        """The early stop's record, logged before the final checkpoint: a run killed in between stops again at
        this step."""
        rundir = self.rundir
        if not stopped or not rundir.acc.is_main_process:
            return {}
        summary = self.tracker.summary()
        rundir.log.write({"step": step, "early_stop": summary})
        later = [f"{e:g}" for s, e in self.snapshots.items() if s > step]
        rundir.console.print(f"early stop at step {step} of {self.total}: no better {summary['metric']} than "
                             f"{summary['best']:.4g} (step {summary['best_step']}) in {summary['patience']} "
                             "evaluation(s)" + (f"; run.keep_epochs {', '.join(later)} not reached" if later else ""))
        return {"stopped_early": summary}

    def on_close(self) -> None:
        tracker = self.tracker
        if tracker.best_step is not None:
            self.rundir.console.print(f"best: {self.rundir.out / 'best'} (step {tracker.best_step}, {tracker.metric} "
                                      f"{tracker.best:.4g}): the checkpoint to evaluate")

    def save_best(self, step: int) -> None:
        """Write ``best/``: the backbone of ``step``, the best evaluation so far (every rank calls this; the main
        process writes)."""
        tracker = self.tracker
        metrics = {k: v for k, v in tracker.best_eval.items() if isinstance(v, int | float | str)}
        self.rundir.publish("best", step, {"best_metric": tracker.metric, "best_value": tracker.best,
                                           "metrics": metrics, "metrics_split": metrics_split(self.rundir.config.data)})


class KeepEma(Callback):
    """``run.model_ema``: the average of the weights after every step (target encoder included); at the run's end
    evaluated as the trained ones are (log.jsonl's ``eval_ema``, the trackers' val/ema_*) when the pipeline
    evaluates, and ``output/ema/`` written (the backbone folder as checkpoint/ holds it, metadata with the decay and
    that evaluation). Its running average is checkpointed by the RunDir (``state/``)."""

    def __init__(self, rundir: RunDir, ema: WeightsEma, objective: nn.Module,
                 evaluate: Evaluate | None) -> None:
        self.rundir, self.ema, self.objective, self.evaluate = rundir, ema, objective, evaluate

    def on_step(self, step: int, epoch: int, out: dict[str, Any]) -> bool:
        self.ema.update(self.objective)
        return False

    def on_end(self, step: int, stopped: bool) -> dict[str, Any]:
        """Before the final checkpoint: a run killed in between writes it again. Main process."""
        rundir, ema, result = self.rundir, self.ema, {}
        if rundir.acc.is_main_process:
            if self.evaluate is not None:
                rundir.console.print(f"EMA of the weights (run.model_ema={ema.decay:g}):")
                result = self.evaluate(ema.module, step)
                rundir.record_eval(step, result, key="eval_ema", prefix="val/ema_")
            metrics = {k: v for k, v in result.items() if isinstance(v, int | float | str)}
            metadata = {**rundir.saved.metadata, "step": step, "model_ema": ema.decay, **(
                {"metrics": metrics, "metrics_split": metrics_split(rundir.config.data)} if metrics else {})}
            publish_folder(rundir.out / "ema", lambda folder: ema.save(folder, metadata))
        rundir.acc.wait_for_everyone()
        return {}


class Callbacks(Callback):
    """Several callbacks as one, in their order: ``on_step`` asks for a checkpoint when any asks, ``on_evaluate``
    checkpoints / stops when any says so, ``on_end`` merges their records."""

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.callbacks = list(callbacks)

    def acts_at(self, step: int) -> bool:
        return any(callback.acts_at(step) for callback in self.callbacks)

    def on_start(self, step: int) -> None:
        for callback in self.callbacks:
            callback.on_start(step)

    def on_step(self, step: int, epoch: int, out: dict[str, Any]) -> bool:
        return any([callback.on_step(step, epoch, out) for callback in self.callbacks])  # every one runs

    def on_evaluate(self, step: int, result: dict[str, Any]) -> tuple[bool, bool]:
        verdicts = [callback.on_evaluate(step, result) for callback in self.callbacks]
        return any(v[0] for v in verdicts), any(v[1] for v in verdicts)

    def on_checkpoint(self, step: int) -> None:
        for callback in self.callbacks:
            callback.on_checkpoint(step)

    def on_end(self, step: int, stopped: bool) -> dict[str, Any]:
        records: dict[str, Any] = {}
        for callback in self.callbacks:
            records.update(callback.on_end(step, stopped))
        return records

    def on_close(self) -> None:
        for callback in self.callbacks:
            callback.on_close()


class Evaluation:
    """The pipeline's ``evaluate`` callback (None: it has none) of the unwrapped model, every ``run.eval_every``
    steps and at the end: main process (under FSDP every rank, on the same whole validation split: a sharded
    forward needs them all), recorded in log.jsonl and the trackers; every rank waits for it."""

    def __init__(self, rundir: RunDir, evaluate: Evaluate | None, every: int | None) -> None:
        self.rundir, self.evaluate, self.every = rundir, evaluate, every

    def due(self, step: int) -> bool:
        """Whether ``step`` is a periodic evaluation step."""
        return bool(self.evaluate is not None and self.every and step % self.every == 0)

    def __call__(self, model: nn.Module, step: int) -> dict[str, Any]:
        acc, result = self.rundir.acc, {}
        if acc.is_main_process or sharded(acc):  # (FSDP: every rank's forward gathers the shards, in lockstep)
            # eager: a compiled step (run.compile_scope=step) is the training graph; evaluations draw their masks
            # from a seeded generator and run in eval mode, shapes and paths of their own
            with torch.compiler.set_stance("force_eager"):
                result = self.evaluate(acc.unwrap_model(model), step)
        if acc.is_main_process:
            self.rundir.record_eval(step, result)
        acc.wait_for_everyone()
        return result


def run_callbacks(run: RunSection, rundir: RunDir, snapshots: dict[int, float], total: int,
                  evaluate: Evaluate | None, objective: nn.Module) -> list[Callback]:
    """The callbacks the run section asks for: run.checkpoint_every, run.keep_epochs (``snapshots``:
    :func:`snapshot_steps` of the run's budget, ``total`` steps), run.early_stop_patience, run.model_ema. Early
    stopping without an evaluation is a :class:`ConfigError` before the directory is touched."""
    callbacks: list[Callback] = [CheckpointEvery(run.checkpoint_every)] if run.checkpoint_every else []
    if snapshots:
        callbacks.append(KeepEpochs(rundir, snapshots))
    if run.early_stop_patience:
        if evaluate is None:
            raise ConfigError(f"run.early_stop_patience={run.early_stop_patience}: this pipeline does not evaluate "
                              "during training (no evaluate callback; pretrain.py and finetune.py have theirs), so "
                              "there is nothing to stop on: set run.early_stop_patience=0 here")
        tracker = BestTracker(run.early_stop_metric, run.early_stop_patience)
        callbacks.append(KeepBest(rundir, tracker, snapshots, total))
    if rundir.saved.ema is not None:
        callbacks.append(KeepEma(rundir, rundir.saved.ema, objective, evaluate))
    return callbacks
