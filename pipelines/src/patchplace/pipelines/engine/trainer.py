"""The :class:`Trainer`: runs ``objective(batch, progress=) -> {"loss", ...}`` over the train reader for the
configured budget, one optimizer step at a time (:meth:`Trainer.train_step`, then :meth:`Trainer.after_step`): the
micro-batches of ``run.grad_accum`` under Accelerate's ``accumulate``, the finite check, gradient clipping, the lr
of the schedule, AdamW; then the EMA target, the log record, the callbacks (``callbacks.py``), the evaluation, the
checkpoint (:class:`~patchplace.pipelines.engine.rundir.RunDir`), and a stop asked by SIGTERM / SIGINT
(a checkpoint and the command to resume: exit code 143 / 130; a second Ctrl-C aborts at once).

Under P processes (``accelerate launch``; docs/scale-out.md): the same initial weights on every rank, then each
rank's own random stream (:func:`~patchplace.pipelines.engine.launch.rank_seed`: masks, noise, drop path); DDP
(``optim.py``'s ``prepare_model``); logged scalars are means over ranks; evaluation and every file write happen on
the main process, except each rank's own random state in ``state/``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from tqdm.auto import tqdm

from patchplace.models import Backbone
from patchplace.pipelines.config import ConfigError
from patchplace.pipelines.engine import budget as plans
from patchplace.pipelines.engine import launch
from patchplace.pipelines.engine.callbacks import Callback, Callbacks, Evaluation, run_callbacks
from patchplace.pipelines.engine.checkpoints import Saved, divergence, snapshot_steps, training_metadata
from patchplace.pipelines.engine.ema import WeightsEma
from patchplace.pipelines.engine.guards import FiniteCheck, StopSignals
from patchplace.pipelines.engine.hardware import resolve_precision
from patchplace.pipelines.engine.inputs import Data, data_fingerprints
from patchplace.pipelines.engine.launch import check_seed, every_rank, reported
from patchplace.pipelines.engine.logs import StepLog, Throughput, end_trackers, finish_trackers, start_trackers
from patchplace.pipelines.engine.optim import (
    StepSchedule,
    checkpoint_activations,
    compile_objective,
    make_optimizer,
    parameter_groups,
    prepare_model,
)
from patchplace.pipelines.engine.relayout import relaid_batches
from patchplace.pipelines.engine.rundir import RunDir
from patchplace.pipelines.sections import OptimSection, RunSection


class Trainer:
    """Runs ``objective(batch, progress=) -> {"loss", ...}`` over the train reader for the configured budget.

    ``backbone`` is what ``checkpoint/`` saves (with ``metadata``; ``others``: encoders saved in folders of it); the
    objective's own extra parameters (heads,
    decoders, predictors) go to ``checkpoint/objective.safetensors`` so evaluations can rebuild it. The run
    directory (checks, records, checkpoints, resume) is the :class:`RunDir` it holds; what the run section asks to keep
    beside it (run.keep_epochs, run.early_stop_patience, run.model_ema) are callbacks, after which ``callbacks`` run.
    """

    def __init__(self, accelerator: Accelerator, objective: nn.Module, backbone: Backbone, data: Data,
                 optim: OptimSection, run: RunSection, *, metadata: dict[str, Any], config: Any,
                 batch_transform: Callable[[torch.Tensor, torch.Tensor], tuple] | None = None,
                 evaluate: Callable[[nn.Module, int], dict[str, Any]] | None = None,
                 command: str | None = None, callbacks: Sequence[Callback] = (),
                 others: dict[str, Backbone] | None = None) -> None:
        self.acc, self.objective, self.backbone, self.data = accelerator, objective, backbone, data
        self.optim_cfg, self.run, self.config = optim, run, config
        self.batch_transform, self.evaluate = batch_transform, evaluate
        try:
            check_seed(run.seed, accelerator.num_processes)
        except ConfigError as exc:
            raise every_rank(exc) from None
        # optim.lr_scaling: the peak lr follows the global batch (recorded in the model card and optimizer.json)
        self.plan = plans.plan_batch(config.data.batch_size, run.grad_accum, optim, accelerator.num_processes)
        self.metadata = training_metadata(
            metadata, objective, backbone, config, accelerator.num_processes, {
                "global_batch": self.plan.global_batch, "peak_lr": self.plan.peak_lr},
            resolve_precision(run.mixed_precision, accelerator.device.type).record())
        # here, so a knob without effect fails before training
        self.optimizer = make_optimizer(objective, optim, self.plan.peak_lr, accelerator.device)
        self.finite = FiniteCheck(accelerator, plans.finite_mode(run, self.optimizer, accelerator.device),
                                  divergence(Path(run.output), self.plan.peak_lr))
        # run.model_ema: copied before run.compile (a copy of a compiled block would run the original's forward)
        self.ema = WeightsEma(objective, run.model_ema, backbone) if run.model_ema is not None else None
        # before run.compile: a compiled block traces its checkpoint
        checkpoint_activations(objective, run.activation_checkpointing, accelerator.print)
        compile_objective(objective, run.compile, run.compile_scope, accelerator.print)
        self.rundir = RunDir(accelerator, run, optim, config, Saved(
            objective, backbone, self.metadata, self.ema, self.plan.global_batch,
            data_fingerprints(data, config.data), others or {}),
            train=data.train, finite=self.finite, command=command or "the same command")
        # the batch and the budget, checked before the directory is touched (_begin: for fit's batch size)
        plans.check_batch(self.plan, data.train, config.data.batch_size, run.grad_accum, accelerator.num_processes)
        self.per_epoch, self.total = self.budget(config.data.batch_size)
        self.callbacks = Callbacks([*self._run_callbacks(), *callbacks])
        self.evaluation = Evaluation(self.rundir, evaluate, run.eval_every)
        # what a session fills: _begin (the prepared model, the schedule, the resumed step), _open (the records)
        self.model: nn.Module = objective
        self.groups: dict[str, Any] | None = None  # optimizer.json's parameters (main process)
        self.schedule: StepSchedule | None = None
        self.first_step = 0
        self.bar: tqdm | None = None
        self.meter: Throughput | None = None
        self.steps: StepLog | None = None
        self.last_eval: dict[str, Any] = {}
        self.stopped = False  # by early stopping
        self.rundir.claim()

    def _run_callbacks(self) -> list[Callback]:
        """run.keep_epochs / run.early_stop_patience, checked before the directory is touched."""
        snapshots = snapshot_steps(self.run.keep_epochs, self.per_epoch, self.total)
        plans.start_line(self.acc, self.optim_cfg, self.plan, self.per_epoch, self.total)
        return run_callbacks(self.run, self.rundir, snapshots, self.total, self.evaluate, self.objective)

    def budget(self, batch_size: int) -> tuple[int, int]:
        """(optimizer steps per epoch, total optimizer steps)."""
        return plans.budget(self.data.train, batch_size, self.run.grad_accum, self.optim_cfg)

    # ------------------------------------------------------------------ running
    def train(self, batch_size: int) -> tuple[dict[str, Any], int]:
        """:meth:`fit` for a pipeline's ``main``: (last evaluation, exit code). An interruption prints how to resume
        (exit 143 / 130), an error training meets prints one line (exit 2)."""
        return reported(lambda: self.fit(batch_size), self.rundir.out)

    def fit(self, batch_size: int) -> dict[str, Any]:
        """Train for the configured budget (or until early stopping); returns the last evaluation. Raises
        :class:`Interrupted` (after a checkpoint) on SIGTERM / SIGINT. The directory's lock is released however it
        ends."""
        try:
            with StopSignals() as signals:
                return self._fit(batch_size, signals)
        except BaseException as exc:
            end_trackers(self.acc, exc)  # MLflow's run KILLED (interrupted) or FAILED, not FINISHED
            raise
        finally:
            if self.bar is not None:
                self.bar.close()  # ends the progress line, so an error message starts on its own line
            self.rundir.release()

    def _fit(self, batch_size: int, signals: StopSignals) -> dict[str, Any]:
        """The loop over the epochs' batches: each micro-batch through :meth:`train_step`, and after each optimizer
        step :meth:`after_step` (True: the run ends there)."""
        step = self._begin(batch_size)
        if self.run.resume and (step >= self.total or self.rundir.stopped_early):  # finished: nothing to rewrite
            result = self.rundir.finish_resumed(step, self.total)
            self.callbacks.on_close()
            return result
        self._open(step)
        epoch, skip = divmod(step, self.per_epoch)
        while step < self.total:
            self.meter.waiting()
            batches = 0
            # resume: the epoch's deterministic stream from the step on (streaming replays the skipped batches)
            for batch in self._epoch_batches(batch_size, epoch, skip):
                batches += 1
                self.meter.arrived(len(batch[0]))
                out, lr_factor = self.train_step(batch, step)
                self.meter.waiting()
                if not self.acc.sync_gradients:
                    continue
                step += 1
                if self.after_step(step, epoch, out, lr_factor, signals):
                    break
                self.meter.waiting()
            if self.stopped:
                break
            if batches == 0 and step < self.total:
                raise plans.no_batches(epoch)
            # the next epoch (an epoch shortened by data.skip_corrupt ends early: its steps are not made up)
            epoch, skip = epoch + 1, 0
        signals.drain()
        return self._end(step)

    def _epoch_batches(self, batch_size: int, epoch: int, skip: int) -> Iterator[Any]:
        """Epoch ``epoch``'s micro-batches after its first ``skip`` optimizer steps; the epoch a resume on another
        layout interrupted is finished as the checkpoint's layout planned it (:func:`.relayout.relaid_batches`)."""
        saved = self.rundir.resumed_layout
        if saved is not None and epoch == self.first_step // self.per_epoch:
            return relaid_batches(self.data.train, saved, self.rundir.layout(), self.acc.process_index, epoch, skip)
        return self.data.train.batches(batch_size, epoch, skip=skip * self.run.grad_accum)

    def _begin(self, batch_size: int) -> int:
        """The session's schedule, DDP, prepared model and optimizer, each rank's random stream and the resume
        (the run directory's, then the callbacks'); returns the step it starts at."""
        acc, run = self.acc, self.run
        self.per_epoch, self.total = self.budget(batch_size)
        # what every parameter really gets (lr scale, weight decay), for the user to check: optimizer.json
        self.groups = parameter_groups(self.optimizer, self.objective) if acc.is_main_process else None
        self.model, self.optimizer = prepare_model(acc, self.objective, self.optimizer, run.find_unused_parameters)
        if self.ema is not None:  # beside the prepared model (checkpointed by the run directory, resumed exactly)
            self.ema.to(acc.device)
        # Each rank its own random stream (masks, noise, drop path): rank_seed(seed, rank), distinct for every
        # (seed, rank) pair. Resume restores every rank's stream from state/random_states_<rank>.pkl. The data
        # order has its own (seed, epoch, rank) seeds.
        set_seed(launch.rank_seed(run.seed, acc.process_index))
        self.first_step = self.rundir.resume()
        self.schedule = self._schedule()
        self.callbacks.on_start(self.first_step)
        return self.first_step

    def _schedule(self) -> StepSchedule:
        """The lr schedule: over the whole budget (``optim.extend=replan``, and every run that was not extended),
        or, from the step a resume extended the budget at (the run directory's ``schedule_start``), a phase of its
        own over the added steps (``optim.extend=phase``)."""
        start = self.rundir.schedule_start
        schedule = StepSchedule.of_run(self.optimizer, self.optim_cfg, self.per_epoch, self.total - start,
                                       self.plan.peak_lr)
        if start:
            factor, decay = schedule.factor, schedule.weight_decay
            schedule.factor = lambda t: factor(t - start)
            schedule.weight_decay = None if decay is None else (lambda t: decay(t - start))
        return schedule

    def _open(self, step: int) -> None:
        """A session that trains from ``step``: optimizer.json, config.yaml, the trackers, the progress bar and the
        throughput meter."""
        acc, optim, rundir = self.acc, self.optim_cfg, self.rundir
        start_trackers(acc, self.run, self.config, self.rundir.lock)  # first: a failed start leaves no file
        rundir.record_run(self.plan, optim, self.groups)
        self.bar = rundir.console.bar = tqdm(total=self.total, initial=step, disable=not acc.is_main_process,
                                             desc=self.metadata.get("method"))
        self.meter = Throughput(self.data.started)
        decaying = self.optimizer if optim.weight_decay_end is not None else None  # wd logged
        self.steps = StepLog(acc, rundir.log, self.run, self.data, self.meter, self.bar, decaying)
        self.last_eval, self.stopped = {}, False

    def _inputs(self, batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = (t.to(self.acc.device, non_blocking=True) for t in batch[:2])
        if self.data.frontend is not None:
            x = self.data.frontend(x)  # waveforms -> MFCC frames on device
        if self.batch_transform is not None:
            x, y = self.batch_transform(x, y)
        return x, y

    def train_step(self, batch: list[torch.Tensor], step: int) -> tuple[dict[str, Any], float]:
        """One micro-batch of optimizer step ``step + 1``: forward (``progress``: the share of the budget done),
        the finite check, backward; on the accumulation's last micro-batch (``sync_gradients``) gradient clipping
        and the lazy check's skip; the lr of the step, and the optimizer step (Accelerate's ``accumulate`` makes it
        a no-op on the other micro-batches). Returns the objective's output and the step's lr factor."""
        acc, model, optimizer = self.acc, self.model, self.optimizer
        x, y = self._inputs(batch)
        with acc.accumulate(model):
            # a 0-d device tensor (a fill, no host copy), so a compiled step is one graph for every step
            progress = torch.full((), step / self.total, dtype=torch.float64, device=self.acc.device)
            out = model((x, y), progress=progress)
            self.finite.loss(out["loss"], step + 1)  # before it reaches the weights (lazy: flagged on the device)
            acc.backward(out["loss"])
            norm = None
            if acc.sync_gradients and self.optim_cfg.clip_grad:
                norm = acc.clip_grad_norm_(model.parameters(), self.optim_cfg.clip_grad)
            if acc.sync_gradients:
                self.finite.before_update(optimizer, norm, step + 1)
            lr_factor = self.schedule.set(step)  # the lr of this optimizer step, once per step on every rank
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return out, lr_factor

    def after_step(self, step: int, epoch: int, out: dict[str, Any], lr_factor: float,
                   signals: StopSignals) -> bool:
        """Everything after optimizer step ``step``, in this order: the lazy finite check (before anything of the
        step is logged, saved or evaluated), the EMA target, the log record, the callbacks' ``on_step``, the
        evaluation and their ``on_evaluate`` (early stopping), the checkpoint and their ``on_checkpoint``, and a stop
        asked by a signal (a checkpoint, then :class:`Interrupted`). True: the run ends here (the budget is spent,
        or early stopping)."""
        run, total = self.run, self.total
        if step == self.first_step + 1:
            self.meter.first_step_done()
        if self._shows(step):
            self.finite.settle(step)
        unwrapped = self.acc.unwrap_model(self.model)
        if hasattr(unwrapped, "update_target"):  # EMA target encoder (I-JEPA / StoP)
            unwrapped.update_target(step / total)
        self.bar.update(1)
        if step % run.log_every == 0 or step == total:
            self.steps.write(step, epoch, out, self.plan.peak_lr * lr_factor)
        checkpoint = self.callbacks.on_step(step, epoch, out)
        # evaluation before the step's checkpoint: a run resumed from it has its evaluation in the log
        if self.evaluation.due(step) and step < total:
            self.last_eval = self.evaluation(self.model, step)
            wanted, self.stopped = self.callbacks.on_evaluate(step, self.last_eval)
            if self.stopped:
                return True
            checkpoint = checkpoint or wanted
        # a callback's step is a checkpoint step: a resumed run can rewrite what a kill left undone
        if step < total and checkpoint:
            self.save_checkpoint(step)
            self.callbacks.on_checkpoint(step)
        stop = signals.agreed(self.acc)
        if stop and step < total:
            self.bar.close()
            self.finite.settle(step)
            self.save_checkpoint(step)
            raise self.rundir.interrupted(step, stop)
        return step >= total

    def save_checkpoint(self, step: int, **final: Any) -> None:
        """The checkpoint of ``step`` (:meth:`RunDir.save`; ``final``: the last one's metrics and records)."""
        self.rundir.save(step, **final)

    def _shows(self, step: int) -> bool:
        """Whether anything of ``step`` may be logged, saved or evaluated."""
        return bool(step % self.run.log_every == 0 or step >= self.total or self.evaluation.due(step)
                    or self.callbacks.acts_at(step))

    def _end(self, step: int) -> dict[str, Any]:
        """The run's end at ``step``: the closing evaluation unless it stopped early (it competes for best/ too),
        the callbacks' ``on_end`` (the early stop's record, the EMA's folder), the final checkpoint sealed with that
        evaluation's metrics, then their ``on_checkpoint`` and ``on_close``. Returns the last evaluation."""
        last_eval = self.last_eval
        self.bar.close()
        if not self.stopped and self.evaluate is not None:  # first, so the final checkpoint is sealed with it
            last_eval = self.evaluation(self.model, step)
            self.callbacks.on_evaluate(step, last_eval)
        records = self.callbacks.on_end(step, self.stopped)
        metrics = {k: v for k, v in last_eval.items() if isinstance(v, int | float | str)} or None
        self.save_checkpoint(step, metrics=metrics, records=records)
        self.callbacks.on_checkpoint(step)
        self.callbacks.on_close()
        finish_trackers(self.acc, self.run.output, step)  # the run's files as MLflow artifacts, the model card
        # the trackers closed and, on every rank, the process group destroyed: one left to the interpreter's end
        # can abort the process there ("terminate called without an active exception": gloo's worker threads)
        self.acc.end_training()
        return last_eval
