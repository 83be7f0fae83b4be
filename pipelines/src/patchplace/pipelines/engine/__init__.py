"""The training engine of the pipelines: Accelerate set-up, readers, the training loop, run directories and
checkpoints, shared by pretrain.py and finetune.py (evaluate.py uses its readers and ``classify``). What it does and
what a run directory holds: docs/design.md#5-pipelines-and-run-directories.

    launch.py       errors and their one-line report, each rank's seed, the Accelerator, ``start``
    inputs.py       the readers (memory or streaming, hold-out, training statistics) and data metadata
    optim.py        AdamW / Adam, the per-step schedule (StepSchedule), ``run.compile``
    schedules.py    the papers' warm-up, lr and weight-decay schedules (pure functions of the step)
    ema.py          ``run.model_ema``: timm's ModelEmaV3 of the trained weights
    trainer.py      the Trainer: ``train_step`` and ``after_step``, the loop that calls the callbacks
    budget.py       the batch, the budget, the checks across sections before a run starts
    rundir.py       the run directory the Trainer holds (RunDir): the lock, checks, records, resume
    checkpoints.py  its checkpoints over every rank (save, backbone folders, load) and what they record
    protocol.py     the file protocol: one run per directory, checkpoints a kill cannot lose (seal, verify, link)
    callbacks.py    what a run keeps beside its checkpoints: snapshots, best/ and early stopping, model EMA
    guards.py       the finite checks and the stop signals
    logs.py         log.jsonl, the throughput record, printing clear of the progress bar
    scoring.py      ``classify`` and early stopping's ``BestTracker``
"""

from patchplace.pipelines.engine.callbacks import Callback, Callbacks, KeepBest, KeepEma, KeepEpochs
from patchplace.pipelines.engine.checkpoints import recipe, snapshot_steps
from patchplace.pipelines.engine.ema import WeightsEma
from patchplace.pipelines.engine.guards import FiniteCheck, StopSignals
from patchplace.pipelines.engine.inputs import (
    Data,
    build_data,
    check_inputs,
    data_fingerprints,
    data_metadata,
    holdout_indices,
    memory_choice,
    metrics_split,
    pair_mixing,
    training_statistics,
)
from patchplace.pipelines.engine.launch import (
    MAX_PROCESSES,
    RUN_ERRORS,
    SEEDS_PER_RANK,
    USER_ERRORS,
    DiskFull,
    Diverged,
    Interrupted,
    NonFiniteOutput,
    check_seed,
    make_accelerator,
    rank_seed,
    relaunch,
    report,
    start,
)
from patchplace.pipelines.engine.logs import JsonlLog, Throughput, command_line, read_log, say, truncate_log
from patchplace.pipelines.engine.optim import StepSchedule, compile_objective, make_optimizer, warmup_cosine
from patchplace.pipelines.engine.rundir import RunDir
from patchplace.pipelines.engine.schedules import cosine_weight_decay, lr_factor, warmup_length
from patchplace.pipelines.engine.scoring import BestTracker, classify
from patchplace.pipelines.engine.trainer import Trainer

__all__ = [
    "MAX_PROCESSES", "RUN_ERRORS", "SEEDS_PER_RANK", "USER_ERRORS", "BestTracker", "Callback", "Callbacks", "Data",
    "DiskFull", "Diverged", "FiniteCheck", "Interrupted", "JsonlLog", "KeepBest", "KeepEma", "KeepEpochs",
    "NonFiniteOutput", "RunDir", "StepSchedule", "StopSignals", "Throughput", "Trainer",
    "WeightsEma", "build_data", "check_inputs", "check_seed", "classify", "command_line", "compile_objective",
    "cosine_weight_decay", "data_fingerprints", "data_metadata", "holdout_indices", "lr_factor", "make_accelerator",
    "make_optimizer", "memory_choice", "metrics_split", "pair_mixing", "rank_seed", "read_log", "recipe", "relaunch",
    "report", "say", "snapshot_steps", "start", "training_statistics", "truncate_log", "warmup_cosine", "warmup_length",
]
