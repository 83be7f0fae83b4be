"""Starting a run and ending it in one line: the errors a user can act on and :func:`report`, each rank's seed, the
Accelerator and the launch checks, ``run.fsdp``'s plugin and the weights it gathers for the backbone folders
(:func:`fsdp_plugin`, :func:`shard_layers`, :func:`gathered`), and :func:`start` (config, Accelerator, seed,
readers)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import (
    DistributedType,
    FullyShardedDataParallelPlugin,
    ProjectConfiguration,
    parse_flag_from_env,
    set_seed,
)
from torch import nn

from patchplace.data import DataError
from patchplace.models import ModelError, set_attention_kernel
from patchplace.models.backbone import CheckpointedBlock
from patchplace.objectives import ObjectiveError
from patchplace.pipelines.config import ConfigError, command_args, load, one_line
from patchplace.pipelines.engine import inputs
from patchplace.pipelines.engine.hardware import precision_line, resolve_precision
from patchplace.pipelines.engine.logs import accelerator_log_with
from patchplace.pipelines.engine.protocol import disk_error, disk_message
from patchplace.pipelines.help import parser
from patchplace.pipelines.sections import MAX_SEED, RunSection


class Diverged(ValueError):
    """A non-finite loss or weights: the run stopped without saving them (the last good checkpoint is kept)."""

    every_rank = True  # the losses are gathered, the weights are the same on every rank: all ranks stop alike


class NonFiniteOutput(Diverged):
    """Non-finite logits at evaluation (the main process alone evaluates)."""

    every_rank = False


class DiskFull(ValueError):
    """A write of the run (log, config, checkpoint) failed for lack of space."""


class Interrupted(Exception):
    """SIGTERM / SIGINT ended the run after a checkpoint; ``str()`` says where and how to resume."""

    every_rank = True  # the ranks agree on the stop (``StopSignals.agreed``): printed once

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# Errors a user can act on: printed as one line by the pipeline scripts (exit code 2).
USER_ERRORS = (ConfigError, DataError, ModelError, ObjectiveError, ValueError)
# The ones training itself can meet (a full disk, a corrupt checkpoint on resume, a bad shard mid-epoch, a
# diverged loss).
RUN_ERRORS = (ConfigError, DataError, Diverged, DiskFull)


def every_rank(exc: Exception) -> Exception:
    """Mark ``exc`` as met by every rank alike (printed once, by the main process: :meth:`Trainer.train`)."""
    exc.every_rank = True
    return exc


# Under several processes every rank r > 0 draws from a seed of its own: run.seed below SEEDS_PER_RANK, and at most
# MAX_PROCESSES processes (see rank_seed).
SEEDS_PER_RANK = 2**20
MAX_PROCESSES = 2**11


# the directories make_accelerator created for run.output: a refusal removes them again while they are empty
_CREATED: list[Path] = []


def remove_created_output() -> None:
    """Remove the run.output directories this process created, deepest first, as long as they are empty: a refused
    run leaves no empty folder behind."""
    for directory in _CREATED:
        try:
            directory.rmdir()
        except OSError:
            break
    _CREATED.clear()


def reported(fit: Callable[[], dict[str, Any]], out: Path) -> tuple[dict[str, Any], int]:
    """``fit()`` for a pipeline's ``main``: (last evaluation, exit code). An interruption prints how to resume
    (exit 143 / 130), an error training meets prints one line (exit 2)."""
    try:
        try:
            return fit(), 0
        except OSError as exc:  # a write outside a checkpoint (log, config, optimizer.json, a tracker)
            if not disk_error(exc):
                raise
            raise DiskFull(disk_message(out, None, exc)) from None
    except (Interrupted, *RUN_ERRORS) as exc:  # e.g. a full disk, a corrupt checkpoint, a bad shard, a NaN loss
        return {}, report(exc)


def report(exc: BaseException) -> int:
    """Print ``exc`` as one line (``error: ...``; an :class:`Interrupted` as it is) and return its exit code (2;
    an interruption's 143 / 130). An error every rank meets alike (``every_rank``) is printed once, by rank 0, before
    any rank leaves (the launcher ends the others as soon as one exits); a rank's own error by that rank. Under
    torchrun / ``accelerate launch --multi_gpu`` the line also goes to the rank's error file, so the launcher's
    report (printed after it, with the launcher's own exit code 1) names it instead of a missing traceback."""
    line = str(exc) if isinstance(exc, Interrupted) else f"error: {one_line(exc)}"
    remove_created_output()
    alike = getattr(exc, "every_rank", False)
    state = PartialState() if PartialState._shared_state else None  # (never creates one: no process group)
    joined = state is not None and state.num_processes > 1
    rank = state.process_index if joined else int(os.environ.get("RANK", "0") or 0)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with contextlib.suppress(OSError):
            Path(error_file).write_text(json.dumps({"message": {"message": line, "extraInfo": {
                "py_callstack": line, "timestamp": str(int(time.time()))}}}))
    if rank == 0 or not alike:
        print(line, file=sys.stderr, flush=True)
    if alike and joined:
        state.wait_for_everyone()
        state.destroy_process_group()  # every rank is here: a group left to the interpreter's end can abort it
        # every rank leaves with its own code: the launcher's SIGTERM to the others, once one has left, would
        # end a rank still shutting down with -15
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif alike and rank != 0:  # ranks that never formed a group: rank 0 prints, then the launcher ends this one
        time.sleep(30)
        print(line, file=sys.stderr, flush=True)
    return getattr(exc, "exit_code", 2)


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s random stream (masks, noise, drop path) in a run seeded ``seed``: rank 0 keeps
    ``seed`` (a one-process run draws what it always drew; any ``run.seed`` below 2**31); rank r > 0 draws from
    ``2**31 + (r - 1) * 2**20 + seed``. Distinct for every accepted pair: rank 0's seeds lie below 2**31, the others
    in [2**31, 2**32), where ``(r - 1, seed)`` are the quotient and remainder by 2**20, for seed < 2**20 and
    r < 2**11 (:func:`check_seed`; a :class:`ConfigError` outside). Every seed stays below 2**32: numpy takes no
    more, and torch's CPU generator keeps only a seed's low 32 bits (``seed + r * 2**32`` would give every rank the
    same masks)."""
    if rank == 0:
        return seed
    check_seed(seed, rank + 1)
    return MAX_SEED + (rank - 1) * SEEDS_PER_RANK + seed


def check_seed(seed: int, processes: int) -> None:
    """``run.seed`` and the process count give every rank a stream of its own (:func:`rank_seed`)."""
    if processes > MAX_PROCESSES:
        raise ConfigError(f"{processes} processes: each rank's own random stream (masks, noise, drop path) is "
                          f"distinct from every other run's for at most {MAX_PROCESSES} processes; use fewer")
    if processes > 1 and not 0 <= seed < SEEDS_PER_RANK:
        raise ConfigError(f"run.seed={seed} with {processes} processes: each rank r > 0 draws its masks, noise and "
                          f"drop path from a seed of its own (2**31 + (r - 1) x 2**20 + run.seed, below 2**32: "
                          f"torch's CPU generator and numpy keep 32 bits), distinct from every other (seed, rank) "
                          f"only for run.seed < {SEEDS_PER_RANK}; choose run.seed in [0, {SEEDS_PER_RANK})")


def start(config_cls: type, description: str, argv: list[str] | None, augment: bool = True,
          split_train: bool = True) -> tuple[Any, Accelerator, inputs.Data]:
    """Parse ``--config`` + overrides, validate, seed, create the Accelerator and the readers
    (:func:`~patchplace.pipelines.engine.inputs.build_data`, looked up there at each call).

    The seed is the same on every process here, so every rank builds the same initial weights (DDP also broadcasts
    rank 0's); :meth:`Trainer.fit` then gives each rank its own random stream. ``split_train=False``: every process
    reads the whole train split (evaluation, which runs on the main process only)."""
    _CREATED.clear()
    argv = sys.argv[1:] if argv is None else argv
    parser(config_cls, description, argv).parse_args(argv)  # argparse's usage errors
    cfg = load(config_cls, *command_args(argv))  # (--config given twice: refused)
    accelerator = make_accelerator(cfg.run, fine_tunes=hasattr(cfg, "finetune"))
    set_seed(cfg.run.seed)
    if hasattr(cfg, "model"):
        set_attention_kernel(cfg.model.attention)
    checkpoint = getattr(getattr(cfg, "model", None), "checkpoint", None)
    return cfg, accelerator, inputs.build_data(cfg.data, accelerator, cfg.run.seed, augment=augment,
                                               split_train=split_train, checkpoint=checkpoint)


def dangling_link(path: Path) -> Path | None:
    """The first of ``path`` and its parents that is a symbolic link to nothing (its target is missing), or None."""
    for place in (path, *path.parents):
        if place.is_symlink() and not place.exists():
            return place
    return None


def make_accelerator(run: RunSection, fine_tunes: bool = False) -> Accelerator:
    check_fsdp(run, fine_tunes)  # before run.output is created: a refusal leaves no folder
    link = dangling_link(Path(run.output))
    if link is not None:  # mkdir would call it "File exists"
        target = os.readlink(link)
        if not os.path.isabs(target):  # relative to the link's folder: named as the user would find it
            target = os.path.normpath(link.parent / target)
        raise ConfigError(f"run.output {run.output}: {link} is a symbolic link to {target}, which does not exist: "
                          f"create {target} (or mount what it points into), or remove the link, or choose another "
                          "run.output")
    try:
        output = Path(run.output).absolute()
        _CREATED[:] = [d for d in (output, *output.parents) if not d.exists()]
        output.mkdir(parents=True, exist_ok=True)
        probe = Path(run.output) / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"run.output {run.output} cannot be written ({exc.strerror}): choose a directory you can "
                          "write, e.g. run.output=runs/my_run") from None
    precision = resolve_precision(run.mixed_precision, "cpu" if parse_flag_from_env("ACCELERATE_USE_CPU") else None)
    accelerator = Accelerator(mixed_precision=precision.value, gradient_accumulation_steps=run.grad_accum,
                              fsdp_plugin=fsdp_plugin(run.fsdp),  # (run.mixed_precision: Accelerate's policy)
                              log_with=accelerator_log_with(run),  # "tensorboard" alone by default, as ever
                              # accelerate writes to <logging_dir>/<run name>: the events land in <output>/tensorboard/
                              project_config=ProjectConfiguration(project_dir=run.output, logging_dir=run.output))
    check_launch(accelerator)
    if precision.value != precision.asked:  # auto, or fp16 on a CPU (engine/hardware.py)
        accelerator.print(precision_line(precision))
    return accelerator


# run.fsdp -> FSDP2's reshard_after_forward: full_shard (ZeRO-3) frees each block's gathered weights after its
# forward and gathers them again for the backward; shard_grad_op (ZeRO-2) keeps them until the backward
RESHARD_AFTER_FORWARD = {"full_shard": True, "shard_grad_op": False}


def check_fsdp(run: RunSection, fine_tunes: bool = False) -> None:
    """``run.fsdp`` where it can shard: Accelerate switches to FSDP only on GPU-like devices (CUDA here); on CPUs
    (``ACCELERATE_USE_CPU=true``, or no CUDA device) it would run the processes as DDP, every rank holding the whole
    model. ``run.model_ema`` keeps an unsharded copy that the sharded weights cannot update; fine-tuning
    (``fine_tunes``) evaluates through the backbone alone, whose root-unit weights only the objective's forward
    gathers."""
    if run.fsdp == "off":
        return
    if parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available():
        raise ConfigError(f"run.fsdp={run.fsdp} shards the model over GPUs, and this launch has none (on CPUs "
                          "Accelerate runs the processes as DDP, every rank holding the whole model): train on CUDA "
                          f"GPUs (accelerate launch --multi_gpu --num_processes N <script> ... run.fsdp={run.fsdp}), "
                          "or set run.fsdp=off (run.activation_checkpointing=true saves activation memory anywhere)")
    if run.model_ema is not None:
        raise ConfigError(f"run.model_ema={run.model_ema:g} with run.fsdp={run.fsdp}: the EMA is an unsharded copy "
                          "of the whole objective on every rank, updated from the sharded weights; set "
                          "run.model_ema=null, or run.fsdp=off")
    if fine_tunes:
        raise ConfigError(f"run.fsdp={run.fsdp} in finetune.py: its evaluation runs the backbone outside the sharded "
                          "objective's forward, where the backbone's own weights stay sharded; fine-tune with "
                          "run.fsdp=off (run.activation_checkpointing=true saves activation memory)")


def fsdp_plugin(mode: str) -> FullyShardedDataParallelPlugin | None:
    """``run.fsdp``'s plugin (None: off): FSDP2 (torch's ``fully_shard``), each Transformer block of the objective a
    unit of its own (:func:`shard_layers` names the classes at ``prepare``), the root holding the rest;
    ``state_dict_type=FULL_STATE_DICT``: ``save_state`` gathers the full model and optimizer state on the main process
    into one file each, as a DDP checkpoint holds them, so a checkpoint resumes on any process count (the run
    directory's relayout) and its files pass the same safe loader."""
    if mode == "off":
        return None
    return FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=RESHARD_AFTER_FORWARD[mode],
                                          auto_wrap_policy="transformer_based_wrap", state_dict_type="FULL_STATE_DICT",
                                          cpu_ram_efficient_loading=False)


def block_classes(model: nn.Module) -> list[str]:
    """The names of ``model``'s Transformer block classes (every :class:`CheckpointedBlock`: the backbone's ``Block``,
    the decoders' / predictors'), FSDP's wrap units: found on the model, so a method's own block class is sharded
    without a list to keep."""
    return sorted({type(m).__name__ for m in model.modules() if isinstance(m, CheckpointedBlock)})


def shard_layers(accelerator: Any, model: nn.Module) -> None:
    """Before ``accelerator.prepare(model, ...)`` under FSDP (``run.fsdp``, or ``accelerate launch --use_fsdp``): the
    transformer-based wrap policy gets :func:`block_classes` unless the launch named its own; FSDP1 is refused
    (the optimizer is made before ``prepare``, which FSDP1 cannot remap; FSDP2 does)."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if not sharded(accelerator) or plugin is None:
        return
    if plugin.fsdp_version != 2:
        raise ConfigError(f"FSDP version {plugin.fsdp_version}: this engine trains with FSDP2 (torch's fully_shard); "
                          "launch with --fsdp_version 2, or use run.fsdp=full_shard without --use_fsdp")
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    if plugin.auto_wrap_policy is transformer_auto_wrap_policy and not plugin.transformer_cls_names_to_wrap:
        plugin.transformer_cls_names_to_wrap = block_classes(model)


def sharded(accelerator: Any) -> bool:
    """Whether ``accelerator`` trains under FSDP (``run.fsdp``, or ``accelerate launch --use_fsdp``): each rank holds
    shards, and a forward needs every rank."""
    return getattr(accelerator, "distributed_type", None) == DistributedType.FSDP


class FullState(nn.Module):
    """The objective's full state dict, gathered (:func:`gathered`), where a backbone folder reads the objective's
    extra parameters."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.full = state

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        return self.full


def gathered(accelerator: Any, saved: Any) -> Any:
    """What a checkpoint's backbone folder is written from (``saved``: the run directory's ``Saved``), called on
    every rank: as it is without FSDP; under FSDP each parameter is a shard, so the full state dict is gathered
    (a collective, to the main process's CPU) and the main process gets plain copies of the backbone and the other
    encoders holding it (the other ranks: None)."""
    if not sharded(accelerator):
        return saved
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    objective = saved.objective
    full = get_model_state_dict(objective, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not accelerator.is_main_process:
        return None
    names = {id(module): name for name, module in objective.named_modules()}

    def plain(backbone: nn.Module) -> nn.Module:
        prefix = f"{names[id(backbone)]}."
        copy = type(backbone)(backbone.config)
        copy.load_state_dict({k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)})
        copy.pretrained_metadata = backbone.pretrained_metadata
        return copy

    return replace(saved, objective=FullState(full), backbone=plain(saved.backbone),
                   others={name: plain(other) for name, other in saved.others.items()})


def relaunch(processes: int, command: str) -> str:
    """The command line that runs ``command`` (a script and its arguments) on ``processes`` processes of one
    machine (``accelerate launch --cpu --num_processes N`` and ``--num_processes N`` without ``--multi_gpu`` start
    one; ``--multi_gpu`` on a machine without GPUs needs ``ACCELERATE_USE_CPU=true``)."""
    if processes == 1:
        return f"python {command}"
    return (f"ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes {processes} {command} (on CPU; "
            f"on {processes} GPUs the same without ACCELERATE_USE_CPU=true)")


def launch_asked() -> tuple[int, str] | None:
    """(the ``--num_processes`` and the script) of the ``accelerate launch`` that started this process as its
    only child (its command line, read from /proc: that launcher exports neither), or None."""
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    at = next((i for i, a in enumerate(argv) if Path(a).name == "accelerate-launch" or (
        a == "launch" and i > 0 and Path(argv[i - 1]).name in ("accelerate", "accelerate_cli.py"))), None)
    if at is None:
        return None
    from accelerate.commands.launch import launch_command_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # (argparse prints its usage before giving up)
            args = launch_command_parser().parse_known_args(argv[at + 1:])[0]
    except (SystemExit, Exception):
        return None
    if not args.num_processes or not args.training_script:
        return None
    return int(args.num_processes), str(args.training_script)


def check_launch(accelerator: Accelerator) -> None:
    """The processes that joined this job are those the launch asked for. ``accelerate launch --multi_gpu
    --num_processes N`` exports ``WORLD_SIZE=N``, but without GPUs (and without ``ACCELERATE_USE_CPU=true``) each
    process runs alone, as a run of its own; ``--num_processes N`` without ``--multi_gpu`` (or with ``--cpu``)
    starts one process. Either is a :class:`ConfigError` naming the command that starts N."""
    have, command = accelerator.num_processes, shlex.join(sys.argv)
    world = os.environ.get("WORLD_SIZE")
    if world is not None and world.isdigit() and int(world) != have:
        why = ("--multi_gpu needs GPUs and none is visible (torch.cuda.is_available() is False), so each process "
               "would train as a run of its own" if not torch.cuda.is_available() else
               f"Accelerate joined a world of {have}")
        raise every_rank(ConfigError(f"the launcher started {world} processes (WORLD_SIZE={world}) but {why}; "
                                     f"start them with: {relaunch(int(world), command)}"))
    asked = launch_asked() if world is None and have == 1 else None
    if asked is not None and asked[0] > have and Path(asked[1]).name == Path(sys.argv[0]).name:
        raise ConfigError(f"accelerate launch --num_processes {asked[0]} started {have} process: without "
                          f"--multi_gpu, or with --cpu, it runs the script once; start {asked[0]} with: "
                          f"{relaunch(asked[0], command)}")
