"""The :class:`Trainer`: runs ``objective(batch, progress=) -> {"loss", ...}`` over the train reader for the
configured budget, one optimizer step at a time (:meth:`Trainer.train_step`, then :meth:`Trainer.after_step`).

A step: the micro-batches of ``run.grad_accum`` under Accelerate's ``accumulate`` (mixed precision, DDP's gradient
sync on the last one), the finite check, gradient clipping, the lr of the warm-up + cosine schedule, AdamW. After it:
the EMA target (``update_target``), the log record (scalars averaged over ranks, throughput), the learning-curve
snapshot, the evaluation and early stopping, the checkpoint, best/, and a stop asked by SIGTERM / SIGINT (the run
ends at the next optimizer step with a checkpoint and the command to resume: exit code 143 / 130; a second Ctrl-C
aborts at once).

Under P processes (``accelerate launch``; docs/scale-out.md): the same initial weights on every rank, then each
rank's own random stream (:func:`~patchplace.pipelines.engine.launch.rank_seed`: masks, noise, drop path); DDP with
``find_unused_parameters`` only for objectives that declare ``leaves_parameters_unused`` (MJP) unless
``run.find_unused_parameters`` says otherwise; logged scalars are means over ranks; evaluation and every file write
happen on the main process, except each rank's own random state in ``state/``.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, set_seed
from torch import nn
from tqdm.auto import tqdm

from patchplace.data import DataError
from patchplace.finetune import parameter_groups
from patchplace.models import Backbone
from patchplace.pipelines.config import ConfigError, OptimSection, RunSection
from patchplace.pipelines.engine.checkpoints import Checkpointing, recipe, snapshot_steps
from patchplace.pipelines.engine.ema import WeightsEma
from patchplace.pipelines.engine.guards import FiniteCheck, StopSignals
from patchplace.pipelines.engine.hardware import resolve_precision
from patchplace.pipelines.engine.inputs import Data, data_fingerprints, metrics_split
from patchplace.pipelines.engine.launch import (
    RUN_ERRORS,
    DiskFull,
    Interrupted,
    check_seed,
    every_rank,
    rank_seed,
    report,
)
from patchplace.pipelines.engine.logs import JsonlLog, Throughput, tracker_project, trackers
from patchplace.pipelines.engine.optim import StepSchedule, compile_blocks, make_optimizer
from patchplace.pipelines.engine.schedules import lr_factor, schedule_words, warmup_length, weight_decay_schedule
from patchplace.pipelines.engine.scoring import BestTracker
from patchplace.pipelines.rundir import RunLock, disk_error, disk_message, latest_step, publish_folder


class Trainer(Checkpointing):
    """Runs ``objective(batch, progress=) -> {"loss", ...}`` over the train reader for the configured budget.

    ``backbone`` is what ``checkpoint/`` saves (with ``metadata``); the objective's own extra parameters (heads,
    decoders, predictors) go to ``checkpoint/objective.safetensors`` so evaluations can rebuild it. The run
    directory's side (checks, checkpoints, snapshots, best/, resume) is :class:`Checkpointing`'s.
    """

    def __init__(self, accelerator: Accelerator, objective: nn.Module, backbone: Backbone, data: Data,
                 optim: OptimSection, run: RunSection, *, metadata: dict[str, Any], config: Any,
                 batch_transform: Callable[[torch.Tensor, torch.Tensor], tuple] | None = None,
                 evaluate: Callable[[nn.Module, int], dict[str, Any]] | None = None,
                 command: str | None = None) -> None:
        self.acc, self.objective, self.backbone, self.data = accelerator, objective, backbone, data
        self.optim_cfg, self.run, self.config = optim, run, config
        try:
            check_seed(run.seed, accelerator.num_processes)
        except ConfigError as exc:
            raise every_rank(exc) from None
        # optim.lr_scaling: the peak lr follows the global batch (recorded in the model card and optimizer.json)
        per_process = config.data.batch_size * run.grad_accum
        self.global_batch = per_process * accelerator.num_processes
        self.lr_base_batch = optim.lr_base_batch or per_process
        self.peak_lr = optim.scaled_lr(self.global_batch, default_base=per_process)
        # docs/design.md: the checkpoint records which pooled feature this training trained, so probes read that one.
        # ... and the pooling its method's own fine-tuning protocol uses (finetune.global_pool=null reads it)
        self.metadata = {**metadata, "probe_feature": getattr(objective, "probe_feature", backbone.config.global_pool),
                         "finetune_pool": getattr(objective, "finetune_pool", backbone.config.global_pool),
                         "recipe": {**recipe(config, accelerator.num_processes), "global_batch": self.global_batch,
                                    "peak_lr": self.peak_lr},
                         # the precision it trained in, and why (run.mixed_precision=auto: what was detected)
                         "compute": resolve_precision(run.mixed_precision, accelerator.device.type).record()}
        self.batch_transform, self.evaluate = batch_transform, evaluate
        self.out = Path(run.output)
        self.log = JsonlLog(self.out / "log.jsonl", accelerator.is_main_process)
        # here, so a knob without effect fails before training
        self.optimizer = make_optimizer(objective, optim, self.peak_lr, accelerator.device)
        if run.finite_check == "lazy" and not self.optimizer.defaults.get("fused"):
            raise ConfigError("run.finite_check=lazy skips a non-finite step inside AdamW's fused kernel: set "
                              "optim.fused=true (null means fused on a GPU only), or run.finite_check=step")
        self.finite = FiniteCheck(accelerator, run.finite_check, self._diverged)
        # run.model_ema: copied before run.compile (a copy of a compiled block would run the original's forward)
        self.ema = WeightsEma(objective, run.model_ema, backbone) if run.model_ema is not None else None
        compiled = compile_blocks(objective, run.compile)
        if compiled:
            accelerator.print(f"run.compile={run.compile}: {compiled} Transformer blocks compiled (the first steps "
                              "compile them)")
        if optim.lr_scaling != "none" and accelerator.num_processes == 1:  # several: in the line of _start_line
            accelerator.print(f"optim.lr_scaling={optim.lr_scaling}: peak lr {optim.lr:g} at global batch "
                              f"{self.lr_base_batch} -> {self.peak_lr:.4g} at global batch "
                              f"{self.global_batch} ({accelerator.num_processes} process(es))")
        self.command = command or "the same command"
        # the batch, run.keep_epochs / run.early_stop_patience, checked before the directory is touched
        self._check_batch(per_process)
        self.snapshots = snapshot_steps(run.keep_epochs, *self.budget(config.data.batch_size))
        self._start_line(per_process, *self.budget(config.data.batch_size))
        self.tracker = BestTracker(run.early_stop_metric, run.early_stop_patience) if run.early_stop_patience \
            else None
        if self.tracker is not None and evaluate is None:
            raise ConfigError(f"run.early_stop_patience={run.early_stop_patience}: this pipeline does not evaluate "
                              "during training (no evaluate callback; pretrain.py and finetune.py have theirs), so "
                              "there is nothing to stop on: set run.early_stop_patience=0 here")
        self.stopped_early: dict[str, Any] | None = None  # the early stop a resumed checkpoint records
        self.fingerprints = data_fingerprints(data, config.data)  # recorded with every checkpoint
        # One run per directory: the main process holds run.output's lock until fit() ends and, before anything is
        # written, checks what the directory holds (_check_directory). A refusal reaches every rank (one line, exit
        # 2 everywhere) and leaves every file of the run as it was.
        self.lock = RunLock(self.out) if accelerator.is_main_process else None
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

    # ------------------------------------------------------------------ budget
    def _check_batch(self, per_process: int) -> None:
        """An optimizer step's samples (data.batch_size x run.grad_accum) must fit in what each process reads of
        data.train per epoch: a larger batch cannot be formed (the loader would give smaller ones, while the lr
        scaling, the model card and the logged throughput counted the asked one)."""
        available, accum = len(self.data.train), self.run.grad_accum
        if per_process <= available:
            return
        m, reader = self.data.train.manifest, self.data.train
        dropping, reader.drop_last = reader.drop_last, False
        try:  # the hint counts the split's samples (a streamed reader's length under data.drop_last: whole batches)
            available = len(reader)
        finally:
            reader.drop_last = dropping
        asked = f"data.batch_size={self.config.data.batch_size}" + (f" x run.grad_accum={accum}" if accum > 1 else "")
        fix = (f"set data.batch_size <= {available // accum}" if available >= accum else
               f"set data.batch_size x run.grad_accum <= {available}")
        raise ConfigError(f"{asked} asks for {per_process} samples per optimizer step on each of "
                          f"{self.acc.num_processes} process(es) (global batch {self.global_batch}), but data.train "
                          f"({m.dataset}/{m.split}) gives each process {available} samples per epoch: no such batch "
                          f"can be formed; {fix} (or train on more data)")

    def budget(self, batch_size: int) -> tuple[int, int]:
        """(optimizer steps per epoch, total optimizer steps)."""
        per_epoch = max(1, self.data.train.num_batches(batch_size) // self.run.grad_accum)
        total = self.optim_cfg.max_steps or max(1, round(self.optim_cfg.epochs * per_epoch))
        return per_epoch, total

    def _start_line(self, per_process: int, per_epoch: int, total: int) -> None:
        """Under several processes, one line on stdout: the batch per process and in all, the peak lr after
        ``optim.lr_scaling``, the warm-up steps and the schedule. A warm-up given in steps or epochs that outlasts
        the run is warned about (its lr never reaches the peak)."""
        optim, acc = self.optim_cfg, self.acc
        warmup = warmup_length(optim, per_epoch, total)
        if acc.num_processes > 1:
            rule = f" from global batch {self.lr_base_batch}" if optim.lr_scaling != "none" else ""
            acc.print(f"{acc.num_processes} processes x {per_process} samples per step (data.batch_size x "
                      f"run.grad_accum) = global batch {self.global_batch}; peak lr {self.peak_lr:.4g} (optim.lr "
                      f"{optim.lr:g}, optim.lr_scaling={optim.lr_scaling}{rule}); "
                      f"{schedule_words(optim, warmup, total)}")
        if warmup >= total and (optim.warmup_steps is not None or optim.warmup_epochs is not None) and \
                acc.is_main_process:
            print(f"warning: the warm-up ({warmup} steps) is not shorter than the run ({total} steps): the lr never "
                  "reaches its peak", file=sys.stderr)

    # ------------------------------------------------------------------ running
    def train(self, batch_size: int) -> tuple[dict[str, Any], int]:
        """:meth:`fit` for a pipeline's ``main``: (last evaluation, exit code). An interruption prints how to resume
        (exit 143 / 130), an error training meets prints one line (exit 2)."""
        try:
            try:
                return self.fit(batch_size), 0
            except OSError as exc:  # a write outside a checkpoint (log, config, optimizer.json, a tracker)
                if not disk_error(exc):
                    raise
                raise DiskFull(disk_message(self.out, None, exc)) from None
        except (Interrupted, *RUN_ERRORS) as exc:  # e.g. a full disk, a corrupt checkpoint, a bad shard, a NaN loss
            return {}, report(exc)

    def fit(self, batch_size: int) -> dict[str, Any]:
        """Train for the configured budget (or until early stopping); returns the last evaluation. Raises
        :class:`Interrupted` (after a checkpoint) on SIGTERM / SIGINT. The directory's lock is released however it
        ends."""
        self.bar: tqdm | None = None
        try:
            with StopSignals() as signals:
                return self._fit(batch_size, signals)
        finally:
            if self.bar is not None:
                self.bar.close()  # ends the progress line, so an error message starts on its own line
            if self.lock is not None:
                self.lock.release()

    def _fit(self, batch_size: int, signals: StopSignals) -> dict[str, Any]:
        """The loop over the epochs' batches: each micro-batch through :meth:`train_step`, and after each optimizer
        step :meth:`after_step` (True: the run ends there)."""
        run = self.run
        step = self._begin(batch_size)
        if run.resume and (step >= self.total or self.stopped_early):  # finished: nothing to train, nothing to rewrite
            return self._finished(step, self.total)
        self._open(step)
        epoch, skip = divmod(step, self.per_epoch)
        while step < self.total:
            self.meter.waiting()
            batches = 0
            # resume: the epoch's deterministic stream from the step on (streaming replays the skipped batches)
            for batch in self.data.train.batches(batch_size, epoch, skip=skip * run.grad_accum):
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
                raise DataError(f"epoch {epoch} of data.train yielded {batches} batch(es), none left to train on "
                                f"(skipped shards: {self.data.train.skipped or 'none'}); check the split with "
                                "`python -m patchplace.data verify <split dir>`")
            # the next epoch (an epoch shortened by data.skip_corrupt ends early: its steps are not made up)
            epoch, skip = epoch + 1, 0
        return self._end(step)

    def _begin(self, batch_size: int) -> int:
        """The session's schedule, DDP, prepared model and optimizer, each rank's random stream and the resume;
        returns the step it starts at."""
        acc, run = self.acc, self.run
        self.per_epoch, self.total = self.budget(batch_size)
        optim = self.optim_cfg
        warmup = warmup_length(optim, self.per_epoch, self.total)
        self.schedule = StepSchedule(self.optimizer, lr_factor(optim, self.total, warmup, self.peak_lr),
                                     weight_decay_schedule(optim, self.total))
        # what every parameter really gets (lr scale, weight decay), for the user to check: optimizer.json
        self.groups = parameter_groups(self.optimizer, self.objective) if acc.is_main_process else None
        find_unused = run.find_unused_parameters
        if find_unused is None:  # auto: only objectives that may leave a parameter without gradient (MJP)
            find_unused = bool(getattr(self.objective, "leaves_parameters_unused", False))
        acc.ddp_handler = DistributedDataParallelKwargs(find_unused_parameters=find_unused)
        # The schedule is not prepared: Accelerate's wrapper would step it once per process (StepSchedule).
        self.model, self.optimizer = acc.prepare(self.objective, self.optimizer)
        if self.ema is not None:  # beside the prepared model (checkpointed by save_checkpoint, resumed exactly)
            self.ema.to(acc.device)
        # Each rank its own random stream (masks, noise, drop path): rank_seed(seed, rank), distinct for every
        # (seed, rank) pair. Resume restores every rank's stream from state/random_states_<rank>.pkl. The data
        # order has its own (seed, epoch, rank) seeds.
        set_seed(rank_seed(run.seed, acc.process_index))
        self.first_step = self._resume()
        return self.first_step

    def _open(self, step: int) -> None:
        """A session that trains from ``step``: optimizer.json, config.yaml, the trackers, the progress bar and the
        throughput meter."""
        acc, optim = self.acc, self.optim_cfg
        self._record_run({
            "lr": self.peak_lr, "config_lr": optim.lr, "lr_scaling": optim.lr_scaling,
            "lr_base_batch": self.lr_base_batch, "global_batch": self.global_batch, "processes": acc.num_processes,
            "layer_decay": optim.layer_decay, "weight_decay": optim.weight_decay, "parameters": self.groups})
        if acc.is_main_process and trackers(self.run):  # run.tensorboard, run.log_with
            acc.init_trackers(tracker_project(self.run))
        self.bar = tqdm(total=self.total, initial=step, disable=not acc.is_main_process,
                        desc=self.metadata.get("method"))
        self.meter = Throughput(self.data.started)
        self.last_eval: dict[str, Any] = {}
        self.stopped = False  # by early stopping

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
            out = model((x, y), progress=step / self.total)
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
        step is logged, saved or evaluated), the EMA target, the log record, the snapshot, the evaluation and early
        stopping, the checkpoint, best/, and a stop asked by a signal (a checkpoint, then :class:`Interrupted`).
        True: the run ends here (the budget is spent, or early stopping)."""
        run, total = self.run, self.total
        if step == self.first_step + 1:
            self.meter.first_step_done()
        if self._shows(step):
            self.finite.settle(step)
        unwrapped = self.acc.unwrap_model(self.model)
        if hasattr(unwrapped, "update_target"):  # EMA target encoder (I-JEPA / StoP)
            unwrapped.update_target(step / total)
        if self.ema is not None:  # run.model_ema: the weights of the step, target encoder included
            self.ema.update(unwrapped)
        self.bar.update(1)
        if step % run.log_every == 0 or step == total:
            self._log_step(step, epoch, out, lr_factor)
        if step in self.snapshots:  # before the step's checkpoint: a resumed run finds it on disk
            self._snapshot(step)
        new_best = False
        # evaluation before the step's checkpoint: a run resumed from it has its evaluation in the log
        if self._evaluates(step) and step < total:
            self.last_eval = self._evaluate(self.model, step)
            new_best, self.stopped = self._follow(step, self.last_eval)
            if self.stopped:
                return True
        # a snapshot or best step is a checkpoint step: a resumed run can rewrite what a kill left undone
        if step < total and (self._checkpoints(step) or step in self.snapshots or new_best):
            self.save_checkpoint(step)
        if new_best:
            self._save_best(step)
        stop = signals.agreed(self.acc)
        if stop and step < total:
            self.bar.close()
            self.finite.settle(step)
            self.save_checkpoint(step)
            raise self._interrupted(step, stop)
        return step >= total

    def _checkpoints(self, step: int) -> bool:
        """Whether ``step`` is a periodic checkpoint step (``run.checkpoint_every``)."""
        return bool(self.run.checkpoint_every and step % self.run.checkpoint_every == 0)

    def _evaluates(self, step: int) -> bool:
        """Whether ``step`` is a periodic evaluation step (``run.eval_every``, with an evaluate callback)."""
        return bool(self.evaluate is not None and self.run.eval_every and step % self.run.eval_every == 0)

    def _shows(self, step: int) -> bool:
        """Whether anything of ``step`` may be logged, saved or evaluated."""
        run = self.run
        return bool(step % run.log_every == 0 or step >= self.total or step in self.snapshots
                    or self._checkpoints(step) or self._evaluates(step))

    def _log_step(self, step: int, epoch: int, out: dict[str, Any], lr_factor: float) -> None:
        """The step's record in log.jsonl (and TensorBoard's train/*): the objective's scalars averaged over ranks,
        the lr this step trained with (groups carry it x their layer-decay lr_scale), the epoch, the throughput."""
        acc = self.acc
        scalars = {k: float(acc.reduce(v.detach().float(), "mean")) for k, v in out.items()
                   if torch.is_tensor(v) and v.numel() == 1}
        scalars.update(lr=self.peak_lr * lr_factor, epoch=epoch)
        if self.optim_cfg.weight_decay_end is not None:  # the weight decay the decaying groups trained with
            scalars["wd"] = max(group["weight_decay"] for group in self.optimizer.param_groups)
        scalars.update(self.meter.record(acc.num_processes))
        if self.data.train.skipped:  # data.skip_corrupt (counted in this process; workers warn)
            scalars["skipped_shards"] = len(set(self.data.train.skipped))
        self.log.write({"step": step, **scalars, "world_size": acc.num_processes, "data": self.data.path})
        if trackers(self.run):  # namespaced as TensorBoard groups them: train/loss, train/lr, ...
            acc.log({f"train/{k}": v for k, v in scalars.items()}, step=step)
        self.bar.set_postfix(loss=f"{scalars['loss']:.4f}")

    def _end(self, step: int) -> dict[str, Any]:
        """The run's end at ``step``: the early stop's record, or the closing evaluation (which competes for best/
        too); the final checkpoint, sealed with that evaluation's metrics. Returns the last evaluation."""
        acc, last_eval = self.acc, self.last_eval
        self.bar.close()
        new_best, summary = False, None
        if self.stopped:  # logged before the final checkpoint: a run killed in between stops again at this step
            if acc.is_main_process:
                summary = self.tracker.summary()
                self.log.write({"step": step, "early_stop": summary})
                later = [f"{e:g}" for s, e in self.snapshots.items() if s > step]
                self._print(f"early stop at step {step} of {self.total}: no better {summary['metric']} than "
                            f"{summary['best']:.4g} (step {summary['best_step']}) in {summary['patience']} "
                            "evaluation(s)" + (f"; run.keep_epochs {', '.join(later)} not reached" if later else ""))
        elif self.evaluate is not None:  # measured first, so the final checkpoint is sealed with its metrics
            last_eval = self._evaluate(self.model, step)
            new_best, _ = self._follow(step, last_eval)
        metrics = {k: v for k, v in last_eval.items() if isinstance(v, int | float | str)} or None
        if self.ema is not None:  # before the final checkpoint: a run killed in between writes it again
            self._finish_ema(step)
        self.save_checkpoint(step, metrics=metrics, stopped_early=summary)
        if new_best:
            self._save_best(step)
        self._report_best()
        if trackers(self.run):
            acc.end_training()
        return last_eval

    # ------------------------------------------------------------------ evaluation, early stopping, stops
    def _evaluate(self, objective: nn.Module, step: int) -> dict[str, Any]:
        result: dict[str, Any] = {}
        if self.acc.is_main_process:
            result = self.evaluate(self.acc.unwrap_model(objective), step)
            self.log.write({"step": step, "eval": result})
            if trackers(self.run):  # val/top1, val/top5, ... beside train/*
                self.acc.log({f"val/{k}": v for k, v in result.items() if isinstance(v, int | float)
                              and k != "count"}, step=step)
        self.acc.wait_for_everyone()
        return result

    def _finish_ema(self, step: int) -> None:
        """``run.model_ema`` at the run's end: the averaged weights evaluated as the trained ones are (log.jsonl's
        ``eval_ema``, TensorBoard's val/ema_*) when the pipeline evaluates, and ``output/ema/`` written (the
        backbone folder as checkpoint/ holds it, metadata with the decay and that evaluation). Main process."""
        ema, result = self.ema, {}
        if self.acc.is_main_process:
            if self.evaluate is not None:
                self._print(f"EMA of the weights (run.model_ema={ema.decay:g}):")
                result = self.evaluate(ema.module, step)
                self.log.write({"step": step, "eval_ema": result})
                if trackers(self.run):
                    self.acc.log({f"val/ema_{k}": v for k, v in result.items() if isinstance(v, int | float)
                                  and k != "count"}, step=step)
            metrics = {k: v for k, v in result.items() if isinstance(v, int | float | str)}
            metadata = {**self.metadata, "step": step, "model_ema": ema.decay,
                        **({"metrics": metrics, "metrics_split": metrics_split(self.config.data)} if metrics else {})}
            publish_folder(self.out / "ema", lambda folder: ema.save(folder, metadata))
        self.acc.wait_for_everyone()

    def _follow(self, step: int, result: dict[str, Any]) -> tuple[bool, bool]:
        """Early stopping after the evaluation of ``step``: (a new best, stop now), the main process's decision
        given to every rank (only it evaluates)."""
        if self.tracker is None:
            return False, False
        flags = [0, 0]
        if self.acc.is_main_process:
            flags = [int(self.tracker.update(step, result)), int(self.tracker.exhausted)]
        if self.acc.num_processes > 1:
            shared = torch.tensor(flags, device=self.acc.device)
            torch.distributed.broadcast(shared, src=0)
            flags = shared.tolist()
        return bool(flags[0]), bool(flags[1])

    def _interrupted(self, step: int, signum: int) -> Interrupted:
        name = signal.Signals(signum).name
        launcher = "python" if self.acc.num_processes == 1 else "accelerate launch <the same launch options>"
        return Interrupted(f"interrupted by {name} at step {step}: checkpoint saved in {self.out}/checkpoints; "
                           f"resume with: {launcher} {self.command} run.resume=true", 128 + signum)

    def _diverged(self, step: int, what: str) -> str:
        last = latest_step(self.out)
        kept = (f"the last good checkpoint (step {last}) is kept in {self.out / 'checkpoints'}" if last is not None
                else "no checkpoint was written")
        return (f"training diverged at step {step}: {what}; nothing of it was saved, {kept}; try a lower optim.lr "
                f"(peak {self.peak_lr:g}), a longer optim.warmup_fraction, optim.clip_grad, or run.mixed_precision="
                "bf16 / no instead of fp16, in a new run (run.overwrite=true or another run.output)")
