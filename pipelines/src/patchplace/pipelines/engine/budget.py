"""A training's batch and budget, and the checks across config sections that the Trainer makes before it touches
the run directory: the global batch and the peak lr ``optim.lr_scaling`` gives it (:func:`plan_batch`), whether
such a batch can be formed from data.train (:func:`check_batch`), the steps per epoch and in all (:func:`budget`),
the start line (:func:`start_line`), ``run.finite_check=lazy``'s need of a fused AdamW (:func:`finite_mode`), and
the budget a resume may change (:func:`extension_problem`, :func:`layout_problem`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any

import torch
from accelerate import Accelerator

from patchplace.data import DataError, ShardDataset
from patchplace.data.memory import MemoryReader
from patchplace.pipelines.config import ConfigError
from patchplace.pipelines.engine.relayout import Layout, reader_as_rank
from patchplace.pipelines.engine.schedules import schedule_words, warmup_length
from patchplace.pipelines.sections import OptimSection, RunSection


@dataclass(frozen=True)
class BatchPlan:
    """The samples of one optimizer step: per process (data.batch_size x run.grad_accum) and in all, the global
    batch ``optim.lr`` is given at (``optim.lr_base_batch``, default the per-process batch; None under
    ``optim.lr_scaling=none``, which rescales from no batch) and the peak lr the scaling rule gives this run
    (recorded in the model card and optimizer.json)."""

    per_process: int
    global_batch: int
    lr_base_batch: int | None
    peak_lr: float


def plan_batch(batch_size: int, grad_accum: int, optim: OptimSection, processes: int) -> BatchPlan:
    per_process = batch_size * grad_accum
    base = (optim.lr_base_batch or per_process) if optim.lr_scaling != "none" else None
    return BatchPlan(per_process, per_process * processes, base,
                     optim.scaled_lr(per_process * processes, default_base=per_process))


def check_batch(plan: BatchPlan, train: ShardDataset | MemoryReader, batch_size: int, grad_accum: int,
                processes: int) -> None:
    """An optimizer step's samples (data.batch_size x run.grad_accum) must fit in what each process reads of
    data.train per epoch: a larger batch cannot be formed (the loader would give smaller ones, while the lr
    scaling, the model card and the logged throughput counted the asked one)."""
    available = len(train)
    if plan.per_process <= available:
        return
    dropping, train.drop_last = train.drop_last, False
    try:  # the hint counts the split's samples (a streamed reader's length under data.drop_last: whole batches)
        available = len(train)
    finally:
        train.drop_last = dropping
    m = train.manifest
    asked = f"data.batch_size={batch_size}" + (f" x run.grad_accum={grad_accum}" if grad_accum > 1 else "")
    fix = (f"set data.batch_size <= {available // grad_accum}" if available >= grad_accum else
           f"set data.batch_size x run.grad_accum <= {available}")
    raise ConfigError(f"{asked} asks for {plan.per_process} samples per optimizer step on each of {processes} "
                      f"process(es) (global batch {plan.global_batch}), but data.train ({m.dataset}/{m.split}) gives "
                      f"each process {available} samples per epoch: no such batch can be formed; {fix} (or train on "
                      "more data)")


def budget(train: ShardDataset | MemoryReader, batch_size: int, grad_accum: int,
           optim: OptimSection) -> tuple[int, int]:
    """(optimizer steps per epoch, total optimizer steps)."""
    per_epoch = max(1, train.num_batches(batch_size) // grad_accum)
    return per_epoch, optim.max_steps or max(1, round(optim.epochs * per_epoch))


def start_line(acc: Accelerator, optim: OptimSection, plan: BatchPlan, per_epoch: int, total: int) -> None:
    """One line on stdout, on the main process, whatever the process count: the batch per process and in all, the
    peak lr after ``optim.lr_scaling``, the warm-up steps and the schedule. A warm-up given in steps or epochs that
    outlasts the run is warned about (its lr never reaches the peak)."""
    warmup = warmup_length(optim, per_epoch, total)
    rule = f" from global batch {plan.lr_base_batch}" if optim.lr_scaling != "none" else ""
    processes = f"{acc.num_processes} process" + ("es" if acc.num_processes > 1 else "")
    acc.print(f"{processes} x {plan.per_process} samples per step (data.batch_size x run.grad_accum) = global batch "
              f"{plan.global_batch}; peak lr {plan.peak_lr:.4g} (optim.lr {optim.lr:g}, "
              f"optim.lr_scaling={optim.lr_scaling}{rule}); {schedule_words(optim, warmup, total)}")
    if warmup >= total and (optim.warmup_steps is not None or optim.warmup_epochs is not None) and \
            acc.is_main_process:
        print(f"warning: the warm-up ({warmup} steps) is not shorter than the run ({total} steps): the lr never "
              "reaches its peak", file=sys.stderr)


def finite_mode(run: RunSection, optimizer: Any, device: torch.device) -> str:
    """``run.finite_check`` in force: ``auto`` is ``lazy`` on a GPU whose AdamW is fused (and no fp16 loss scaler),
    else ``step``; ``lazy`` skips a non-finite step inside AdamW's fused kernel: it needs one."""
    fused = bool(optimizer.defaults.get("fused"))
    if run.finite_check == "auto":
        return "lazy" if device.type == "cuda" and fused and run.mixed_precision != "fp16" else "step"
    if run.finite_check == "lazy" and not fused:
        raise ConfigError("run.finite_check=lazy skips a non-finite step inside AdamW's fused kernel: set "
                          "optim.fused=true (null means fused on a GPU only), or run.finite_check=step")
    return run.finite_check


def no_batches(epoch: int) -> DataError:
    """An epoch of data.train without a batch while steps of the budget are left."""
    return DataError(f"epoch {epoch} of data.train yielded 0 batch(es), none left to train on (data.skip_corrupt "
                     "skipped every shard of this process?): check the split with "
                     "`python -m patchplace.data verify <split dir>`")


def extension_problem(trainer: dict[str, Any], train: Any, batch_size: int, grad_accum: int,
                      optim: OptimSection) -> str | None:
    """A resume whose optim.epochs / optim.max_steps differ from the checkpoint's (``trainer``: its trainer.json)
    extends the run: refused (the line) when the new budget is smaller than the one the run was planned for."""
    old = trainer.get("config", {}).get("optim", {})
    if all(old.get(key, getattr(optim, key)) == getattr(optim, key) for key in ("epochs", "max_steps")):
        return None
    planned = replace(optim, epochs=old.get("epochs", optim.epochs), max_steps=old.get("max_steps", optim.max_steps))
    before, now = budget(train, batch_size, grad_accum, planned)[1], budget(train, batch_size, grad_accum, optim)[1]
    if now < before:
        return (f"run.resume=true: optim.epochs={optim.epochs:g} / optim.max_steps={optim.max_steps} give {now} "
                f"steps, fewer than the {before} the run was planned for (optim.epochs={planned.epochs:g} / "
                f"optim.max_steps={planned.max_steps}): a resume extends a run, never shortens it; resume with the "
                "run's values or larger ones")
    return None


def layout_problem(trainer: dict[str, Any], now: Layout, train: Any, optim: OptimSection) -> str | None:
    """A resume on another layout of the same global batch (:mod:`.relayout`) needs the epoch to keep its
    optimizer steps (the step -> epoch map, and the budget, hold across the layouts)."""
    saved = Layout.of_checkpoint(trainer)
    if saved is None or saved == now or saved.global_batch != now.global_batch:
        return None  # (the global batch: the run directory's own check)
    before = budget(reader_as_rank(train, 0, saved.processes), saved.batch_size, saved.grad_accum, optim)[0]
    after = budget(train, now.batch_size, now.grad_accum, optim)[0]
    if before != after:
        return (f"run.resume=true: the step-{trainer['step']} checkpoint's layout ({saved.words()}) plans "
                f"{before} steps per epoch, this launch's ({now.words()}) {after}: the epochs would shift; "
                "resume with the checkpoint's layout, or a process count that divides data.train as evenly")
    return None
