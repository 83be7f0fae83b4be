"""The shared training engine of the pipelines (with config.py and rundir.py, the only accelerate users).

Accelerator setup (mixed precision, gradient accumulation, trackers: JSONL always + TensorBoard), shard readers
split by ``accelerator.process_index`` / ``num_processes``, AdamW through timm's ``create_optimizer_v2`` (layer-wise
lr decay when asked), linear warm-up + cosine schedule, grad clipping, EMA hooks (``update_target``), ``progress``
fed to objectives, tqdm on the main process, periodic evaluation, and atomic checkpoints with exact resume.

Under P processes (``accelerate launch``; docs/scale-out.md): the same initial weights on every rank, then each
rank's own random stream (:func:`rank_seed`: masks, noise, drop path); DDP with ``find_unused_parameters`` only for
objectives that declare ``leaves_parameters_unused`` (MJP) unless ``run.find_unused_parameters`` says otherwise;
logged scalars are means over ranks; evaluation and every file write happen on the main process, except each rank's
own random state in ``state/``.

Run directory (``run.output``; one run at a time, see ``rundir.py``)::

    config.yaml        the resolved config
    log.jsonl          one JSON object per logged step / evaluation (main process), each step once
    checkpoints/step-N/  the last complete checkpoint: checkpoint/ (backbone ``save_pretrained`` + objective
                       extras), state/ (Accelerate state + trainer.json, for ``run.resume=true``), COMPLETE
    checkpoint         -> checkpoints/step-N/checkpoint (what fine-tuning, evaluation and export load)
    snapshots/epoch-E/ run.keep_epochs: the backbone folder (as checkpoint/ holds it) after E epochs, metadata with
                       step and epoch (epoch-0: the initial weights)
    best/              run.early_stop_patience: the backbone folder of the best evaluation (metadata: step,
                       best_metric, best_value, metrics); the one to evaluate
    tensorboard/       TensorBoard event files
    .lock              held while a process runs the directory

SIGTERM / SIGINT (Ctrl-C) end the run at the next optimizer step with a checkpoint and the command to resume
(exit code 143 / 130); a second Ctrl-C aborts at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedDataParallelKwargs, ProjectConfiguration, broadcast_object_list, set_seed
from safetensors.torch import save_file
from torch import nn
from tqdm.auto import tqdm

from patchplace.data import DataError, Manifest, ShardDataset, build_transform
from patchplace.data.atomic import atomic_file, write_json_atomic
from patchplace.data.batched import build_batched_transform
from patchplace.data.memory import InMemorySplit, MemoryReader, balanced_subset, decoded_bytes
from patchplace.data.mfcc import MFCC
from patchplace.finetune import build_optimizer, parameter_groups
from patchplace.models import Backbone, ModelError, save_pretrained, set_attention_kernel
from patchplace.models.backbone import Block
from patchplace.objectives import ObjectiveError
from patchplace.pipelines.config import (
    HOLDOUT,
    MAX_SEED,
    ConfigError,
    DataSection,
    OptimSection,
    RunSection,
    load,
    one_line,
    parser,
    to_dict,
)
from patchplace.pipelines.rundir import (
    CheckpointError,
    RunLock,
    clean,
    commit,
    complete_steps,
    disk_error,
    disk_message,
    latest_step,
    load_state_strictly,
    partial_dir,
    point_checkpoint_link,
    prepare_directory,
    publish_folder,
    tidy_folders,
    unsealed_steps,
    verify,
)


class Diverged(ValueError):
    """A non-finite loss or weights: the run stopped without saving them (the last good checkpoint is kept)."""

    every_rank = True  # the losses are gathered, the weights are the same on every rank: all ranks stop alike


class NonFiniteOutput(Diverged):
    """Non-finite logits at evaluation (the main process alone evaluates)."""

    every_rank = False


class DiskFull(ValueError):
    """A write of the run (log, config, checkpoint) failed for lack of space."""


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


def say(text: str, file: Any = None) -> None:
    """Print a line clear of the progress bars (``tqdm.write``: the Trainer's bar is cleared, the line printed,
    the bar drawn again below it), flushed; ``file``: default stdout. For what prints while a bar runs, e.g. the
    ``evaluate`` callbacks a pipeline hands the :class:`Trainer`."""
    stream = sys.stdout if file is None else file
    tqdm.write(text, file=stream)
    stream.flush()


def start(config_cls: type, description: str, argv: list[str] | None, augment: bool = True,
          split_train: bool = True) -> tuple[Any, Accelerator, Data]:
    """Parse ``--config`` + overrides, validate, seed, create the Accelerator and the readers.

    The seed is the same on every process here, so every rank builds the same initial weights (DDP also broadcasts
    rank 0's); :meth:`Trainer.fit` then gives each rank its own random stream. ``split_train=False``: every process
    reads the whole train split (evaluation, which runs on the main process only)."""
    _CREATED.clear()
    args = parser(config_cls, description, sys.argv[1:] if argv is None else argv).parse_args(argv)
    cfg = load(config_cls, args.config, args.overrides)
    accelerator = make_accelerator(cfg.run)
    set_seed(cfg.run.seed)
    if hasattr(cfg, "model"):
        set_attention_kernel(cfg.model.attention)
    checkpoint = getattr(getattr(cfg, "model", None), "checkpoint", None)
    return cfg, accelerator, build_data(cfg.data, accelerator, cfg.run.seed, augment=augment, split_train=split_train,
                                        checkpoint=checkpoint)


def recipe(config: Any, processes: int) -> dict[str, Any]:
    """The training recipe a checkpoint's model card shows: the optimizer, data and method sections without paths."""
    from dataclasses import asdict, is_dataclass

    out: dict[str, Any] = {"processes": processes}
    for section in ("optim", "finetune", "objective"):
        value = getattr(config, section, None)
        if is_dataclass(value):
            out[section] = asdict(value)
        elif isinstance(value, dict) and value:
            out[section] = dict(value)
    data = getattr(config, "data", None)
    if data is not None:
        out["data"] = {k: getattr(data, k) for k in ("batch_size", "img_size", "pad_to", "scale", "hflip", "re_prob",
                                                      "label_fraction") if hasattr(data, k)}
    run = getattr(config, "run", None)
    if run is not None:
        out["run"] = {k: getattr(run, k) for k in ("seed", "mixed_precision", "grad_accum") if hasattr(run, k)}
    return out


def data_metadata(data: Data, cfg: DataSection) -> dict[str, Any]:
    """What a checkpoint records about its data (classes, the normalization every split was given, manifest
    fingerprint, input layout) and its hold-out: the ``data.holdout`` samples of that split it never trained on
    (size and seed: :func:`hold_out` draws the same ones again), so evaluation can refuse the images it trained on."""
    m = data.manifest
    # native_size: the images' size before pad_to (timm's pretrained_cfg reproduces the padding from it)
    return {"classes": m.classes, "normalization": data.normalization, "modality": m.modality, "pad_to": cfg.pad_to,
            "img_size": cfg.img_size, "native_size": m.info.get("image_size") if m.modality == "image" else None,
            "data": {"dataset": m.dataset, "split": m.split, "fingerprint": m.fingerprint(),
                     "holdout": {"size": cfg.holdout, "seed": cfg.holdout_seed}}}


def data_fingerprints(data: Data, cfg: DataSection) -> dict[str, str]:
    """What ``data.train`` and ``data.val`` hold: their manifests' fingerprints (shard hashes, classes, layout; not
    their paths), ``holdout`` for data.val=holdout. Every checkpoint records them; a resume compares them."""
    found = {"data.train": data.manifest.fingerprint()}
    if cfg.val == HOLDOUT:
        found["data.val"] = HOLDOUT
    elif data.val is not None:
        found["data.val"] = data.val.manifest.fingerprint()
    return found


def recorded_data(state: Path) -> dict[str, str]:
    """The data fingerprints a checkpoint records (``state/trainer.json``; a checkpoint without them: data.train's
    from its model card, none when that is missing too)."""
    recorded = json.loads((state / "trainer.json").read_text()).get("data")
    if isinstance(recorded, dict):
        return {k: v for k, v in recorded.items() if isinstance(v, str)}
    try:
        card = json.loads((state.parent / "checkpoint" / "config.json").read_text())
        return {"data.train": str(card["metadata"]["data"]["fingerprint"])}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def metrics_split(cfg: DataSection) -> str:
    """The split a run's evaluations measure (a checkpoint's ``metrics_split``, named in its model card):
    ``holdout`` (held out of data.train) or data.val's last path component (``shards/fashion_mnist/test`` ->
    ``test``), with ``[:N]`` under data.val_limit (Hugging Face's slice notation)."""
    name = HOLDOUT if cfg.val == HOLDOUT else Path(str(cfg.val)).name
    limit = getattr(cfg, "val_limit", None)
    return f"{name}[:{limit}]" if limit else name


def check_inputs(backbone: Backbone, data: Data, source: str) -> None:
    """The backbone takes what the train reader yields (modality, image side, channels) — checked before training,
    so a mismatch is one line naming both instead of a shape error inside the model at step 1. ``source`` names
    where the backbone comes from (a checkpoint path or ``model.preset=...``)."""
    m, c = data.manifest, backbone.config
    if c.modality != m.modality:
        raise ConfigError(f"{source} is a model for {c.modality} but data.train ({m.dataset}/{m.split}) holds "
                          f"{m.modality}: use a {m.modality} checkpoint / preset, or {c.modality} data")
    if m.modality != "image":
        return
    side = getattr(data.train.transform, "size", None)
    if side is not None and side != c.img_size:
        raise ConfigError(f"the data give {side} px images (data.img_size / data.pad_to) but {source} takes "
                          f"{c.img_size} px: set data.img_size={c.img_size}"
                          + ("" if source.startswith("model.checkpoint") else
                             f", or build the model for {side} px with model.overrides={{img_size: {side}}}"))
    channels = int(m.info.get("channels", 3))
    if channels != c.in_chans:
        raise ConfigError(f"data.train images have {channels} channel(s) but {source} takes {c.in_chans}: use a "
                          "checkpoint / preset with the data's channels")


def dangling_link(path: Path) -> Path | None:
    """The first of ``path`` and its parents that is a symbolic link to nothing (its target is missing), or None."""
    for place in (path, *path.parents):
        if place.is_symlink() and not place.exists():
            return place
    return None


def make_accelerator(run: RunSection) -> Accelerator:
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
    # Accelerate keeps one process-wide state and refuses a second Accelerator with another mixed precision; stages
    # run in one process (tests, the demo and study orchestration) may each ask for their own, so start it afresh.
    if AcceleratorState._shared_state.get("_mixed_precision") not in (None, run.mixed_precision):
        AcceleratorState._reset_state()
    accelerator = Accelerator(mixed_precision=run.mixed_precision, gradient_accumulation_steps=run.grad_accum,
                              log_with="tensorboard" if run.tensorboard else None,
                              # accelerate writes to <logging_dir>/<run name>: the events land in <output>/tensorboard/
                              project_config=ProjectConfiguration(project_dir=run.output, logging_dir=run.output))
    check_launch(accelerator)
    return accelerator


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


@dataclass
class Data:
    """The readers of one run — each a :class:`ShardDataset` (streaming) or a :class:`MemoryReader` (in memory,
    batched augmentation on the training device), behind the same ``batches(batch_size, epoch, skip)`` — plus the
    on-device speech frontend for audio manifests. ``path``: which one feeds each split, and why."""

    train: ShardDataset | MemoryReader
    val: ShardDataset | MemoryReader
    manifest: Manifest
    frontend: nn.Module | None
    path: dict[str, str] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)  # when reading began (startup_s counts from here)
    # the mean / std every image split is normalized with: the training statistics (:func:`training_statistics`)
    normalization: dict[str, Any] | None = None
    # data.holdout: the labels of the whole data.train split, in manifest order (a hold-out is drawn from them)
    train_labels: torch.Tensor | None = None


def memory_choice(cfg: DataSection, manifest: Manifest, budget: int, key: str, augment: bool) -> str | None:
    """Why split ``key`` (``data.train`` / ``data.val``) must stream, or None when it can live in memory
    (``data.in_memory``: auto picks memory whenever it can, true insists, false streams)."""
    if cfg.in_memory is False:
        return "data.in_memory=false"
    need = decoded_bytes(manifest)
    if need is None:
        why = "its manifest gives no fixed image size / clip length"
    elif need > budget:
        why = (f"it takes {need / 2**20:.3g} MiB decoded, more than the {max(budget, 0) / 2**20:.3g} MiB left of "
               f"data.memory_budget_mb={cfg.memory_budget_mb:g}")
    elif key == "data.train" and augment and cfg.auto_augment:
        why = "data.auto_augment runs per sample on PIL images"
    else:
        return None
    if cfg.in_memory is True:
        raise ConfigError(f"data.in_memory=true but {key} ({manifest.dataset}/{manifest.split}) cannot be held in "
                          f"memory: {why}; set data.in_memory=auto to stream it")
    return why


def build_data(cfg: DataSection, accelerator: Accelerator, seed: int, augment: bool = True,
               split_train: bool = True, checkpoint: str | None = None) -> Data:
    """Train reader split across processes (by global rank, so across nodes too: each process reads its own
    shards / samples); the validation reader is read whole by the main process. ``split_train=False``: the train
    reader is read whole as well. Each split is held in memory (batched augmentation on the training device) when
    ``data.in_memory`` and ``data.memory_budget_mb`` allow, else streamed from its shards; the choice is printed
    and logged with every step. Every split is normalized with the training statistics
    (:func:`training_statistics`: ``checkpoint``'s recorded ones, else data.train's), never its own."""
    started = time.perf_counter()
    holdout = cfg.val == HOLDOUT
    manifest = Manifest.load(cfg.train, cfg.network())  # carries data.timeout / retries to its http(s) shards
    val_manifest = manifest if holdout else Manifest.load(cfg.val, cfg.network())
    if manifest.classes != val_manifest.classes:
        raise ValueError(f"data.val classes differ from data.train classes ({cfg.val} vs {cfg.train})")
    normalization = training_statistics(manifest, checkpoint)
    if manifest.modality == "image":
        options = dict(pad_to=cfg.pad_to, img_size=cfg.img_size, scale=cfg.scale, hflip=cfg.hflip,
                       auto_augment=cfg.auto_augment, re_prob=cfg.re_prob)
        eval_options = dict(pad_to=cfg.pad_to, img_size=cfg.img_size)
    else:
        options, eval_options = {"noise_bank": cfg.noise_split}, {}
    rank, world = (accelerator.process_index, accelerator.num_processes) if split_train else (0, 1)
    budget = int(cfg.memory_budget_mb * 2**20)
    readers, path, held, train_labels = {}, {}, None, None
    for key, m, urls, train, opts in (("data.train", manifest, cfg.train_urls, True, options),
                                      ("data.val", val_manifest, cfg.val_urls, False, eval_options)):
        augmented = augment and train
        why = None if holdout and not train else memory_choice(cfg, m, budget, key, augment)
        if why is not None and train and cfg.holdout:
            raise ConfigError(f"data.holdout={cfg.holdout} needs data.train in memory, but it streams ({why}); set "
                              "data.in_memory=auto and enough data.memory_budget_mb")
        if why is not None and train and cfg.label_fraction is not None:
            raise ConfigError(f"data.label_fraction={cfg.label_fraction} needs data.train in memory, but it streams "
                              f"({why}); set data.in_memory=auto and enough data.memory_budget_mb")
        if why is None:
            if holdout and not train:
                split = held  # data.val=holdout: the samples held out of data.train
            else:
                split = InMemorySplit.load(m, budget, urls=urls, skip_corrupt=train and cfg.skip_corrupt,
                                           num_workers=cfg.num_workers, verify=cfg.verify_shards)  # in parallel
                budget -= decoded_bytes(m)
            if train and cfg.holdout:  # kept out of data.train whichever split validates (the same train images)
                train_labels = split.labels
                split, held = hold_out(split, cfg, accelerator)
            if train and cfg.label_fraction is not None:  # the label-efficiency protocol: a fixed balanced subset
                split = split.subset(balanced_subset(split.labels, cfg.label_fraction, cfg.label_subset_seed))
                per_class = torch.bincount(split.labels, minlength=m.num_classes).tolist()
                accelerator.print(f"data.train: {cfg.label_fraction:.4g} of the labels, {len(split)} samples "
                                  f"({min(per_class)}-{max(per_class)} per class, data.label_subset_seed="
                                  f"{cfg.label_subset_seed})")
            readers[key] = MemoryReader(split, build_batched_transform(with_statistics(m, normalization),
                                                                       augmented, **opts), seed=seed,
                                        rank=rank if train else 0, world_size=world if train else 1, shuffle=train,
                                        device=accelerator.device)
            path[key.split(".")[1]] = "memory"
            accelerator.print(f"{key}: in memory on {accelerator.device} ({m.dataset}/{m.split}, {len(split)} "
                              f"samples, {decoded_bytes(m) / 2**20:.3g} MiB decoded), batched "
                              f"{'augmentation' if augmented else 'preprocessing'} there")
        else:
            if train:
                readers[key] = ShardDataset(m, urls=urls, transform=build_transform(with_statistics(m, normalization),
                                                                                    augment, **opts),
                                            shuffle_buffer=cfg.shuffle_buffer, seed=seed, rank=rank, world_size=world,
                                            num_workers=cfg.num_workers, seeded_transforms=True,
                                            skip_corrupt=cfg.skip_corrupt, verify=cfg.verify_shards)
            else:
                readers[key] = ShardDataset(m, urls=urls, transform=build_transform(with_statistics(m, normalization),
                                                                                    False, **opts),
                                            num_workers=cfg.num_workers, verify=cfg.verify_shards)
            path[key.split(".")[1]] = "streaming"
            accelerator.print(f"{key}: streaming from {len(m.shards)} shard(s) with {cfg.num_workers} worker(s) "
                              f"({why})")
    train, val = readers["data.train"], readers["data.val"]
    for reader, key, limit in ((train, "data.train_limit", cfg.train_limit), (val, "data.val_limit", cfg.val_limit)):
        if limit is not None:  # epoch_length, checked here so that the message names the config key
            available = len(reader)
            if not 1 <= limit <= available:
                raise ConfigError(f"{key}={limit}: each process can read at most {available} samples per epoch of "
                                  f"{reader.manifest.dataset}/{reader.manifest.split} with "
                                  f"{reader.world_size} process(es); set it in [1, {available}] or null")
            reader.epoch_length = limit
    frontend = MFCC().to(accelerator.device) if manifest.modality == "audio" else None
    return Data(train, val, manifest, frontend, path, started, normalization, train_labels)


def training_statistics(manifest: Manifest, checkpoint: str | None) -> dict[str, Any] | None:
    """The mean / std every split of a run is normalized with: those ``checkpoint`` (fine-tuning, evaluation)
    records, which its export (model.json, the ONNX evaluator) and timm's transform of it use too; else (training
    from scratch) the train split's. A split's own statistics (a test split's ``computed_on: test``) never count:
    the deployed model is given the training ones. Recorded statistics for another channel count are left to
    :func:`check_inputs`, which names that mismatch."""
    own = manifest.normalization
    if manifest.modality != "image" or not checkpoint:
        return own
    from patchplace.models.hub import read_config

    recorded = read_config(checkpoint)[1].get("normalization")
    channels = int(manifest.info.get("channels", 3))
    if not recorded or len(recorded.get("mean") or []) != channels:
        return own
    return {"mean": list(recorded["mean"]), "std": list(recorded["std"]),
            "computed_on": recorded.get("computed_on", "the checkpoint's training data")}


def with_statistics(manifest: Manifest, normalization: dict[str, Any] | None) -> Manifest:
    """``manifest`` whose transforms normalize with ``normalization`` (the reader keeps the manifest as it is)."""
    if manifest.modality != "image" or normalization is None or normalization == manifest.normalization:
        return manifest
    return dataclasses.replace(manifest, normalization=normalization)


def hold_out(split: InMemorySplit, cfg: DataSection, accelerator: Accelerator) -> tuple[InMemorySplit,
                                                                                        InMemorySplit]:
    """(train without the held-out samples, the held-out samples): ``data.holdout`` class-balanced samples drawn
    by ``data.holdout_seed`` alone, so every method and run validates on the same images and never trains on
    them. Label subsets (``data.label_fraction``) are drawn from what remains."""
    if not 0 < cfg.holdout < len(split):
        raise ConfigError(f"data.holdout={cfg.holdout}: data.train holds {len(split)} samples; hold out fewer")
    held = holdout_indices(split.labels, cfg.holdout, cfg.holdout_seed)
    keep = torch.ones(len(split), dtype=torch.bool)
    keep[held] = False
    use = "for validation" if cfg.val == HOLDOUT else f"(unused here: data.val={cfg.val})"
    accelerator.print(f"data.holdout: {len(held)} class-balanced samples of data.train held out {use} "
                      f"(data.holdout_seed={cfg.holdout_seed}); data.train reads the other {int(keep.sum())}")
    return split.subset(keep.nonzero().flatten()), split.subset(held)


def holdout_indices(labels: torch.Tensor, size: int, seed: int) -> torch.Tensor:
    """The indices (into a whole split, in manifest order) of its ``data.holdout=size`` samples drawn by
    ``data.holdout_seed=seed``: what :func:`hold_out` keeps out of training, and evaluation recomputes from a
    checkpoint's record (:func:`data_metadata`). Empty for size 0."""
    if size <= 0:
        return torch.zeros(0, dtype=torch.int64)
    return balanced_subset(labels, size / len(labels), seed)


def make_optimizer(model: nn.Module, cfg: OptimSection, lr: float | None = None,
                   device: torch.device | None = None) -> torch.optim.Optimizer:
    """AdamW on the objective's parameter groups (``patchplace.finetune.build_optimizer``): no weight decay on norms,
    biases, PEs, class / mask / unknown tokens; layer-wise lr decay (each group's lr pre-scaled) if configured.
    ``lr``: the peak lr (default ``cfg.lr``; the Trainer passes it scaled to the global batch). ``optim.fused``
    null: the fused kernel when ``device`` (where the run trains) is a GPU."""
    fused = cfg.fused if cfg.fused is not None else (device is not None and device.type == "cuda")
    try:
        return build_optimizer(model, lr=cfg.lr if lr is None else lr, weight_decay=cfg.weight_decay,
                               betas=cfg.betas, layer_decay=cfg.layer_decay, fused=fused)
    except ValueError as exc:
        raise ConfigError(f"optim.layer_decay: {exc}") from None


def training_flops(objective: nn.Module) -> float | None:
    """FLOPs of one training step per sample, counted from the shapes (``patchplace.objectives.benchmark``): with
    samples/s, the achieved rate the log reports (``tflops``); None where that FLOP model has no formula."""
    from patchplace.objectives.benchmark import train_flops

    try:
        return float(train_flops(objective))
    except Exception:  # a model outside the FLOP model's cases: no rate, training goes on
        return None


def compile_blocks(model: nn.Module, mode: str) -> int:
    """``run.compile``: torch.compile every Transformer block of ``model`` in place (``nn.Module.compile``: regional
    compilation, the blocks of the backbone and of any decoder / predictor; parameter names and checkpoints
    unchanged). Returns how many blocks were compiled."""
    if mode == "no":
        return 0
    kwargs = {"backend": "aot_eager"} if mode == "aot_eager" else {"mode": mode}
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for block in blocks:
        block.compile(**kwargs)
    return len(blocks)


def warmup_cosine(total_steps: int, warmup_fraction: float, min_ratio: float) -> Callable[[int], float]:
    """The lr factor of optimizer step ``step`` (0-based): linear warm-up, then cosine down to ``min_ratio``."""
    warmup = round(warmup_fraction * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, total_steps - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))

    return factor


@torch.no_grad()
def classify(backbone: Backbone, dataset: ShardDataset | MemoryReader, batch_size: int, device: torch.device,
             frontend: nn.Module | None = None, unknown_pos: Callable | None = None) -> dict[str, Any]:
    """Top-1 / top-5 / confusion matrix of ``backbone``'s head over the whole dataset (eval mode)."""
    from patchplace.finetune import Accuracy

    was_training = backbone.training
    backbone.eval()
    accuracy = Accuracy(backbone.config.num_classes)
    for x, y in dataset.batches(batch_size, epoch=0):
        x = x.to(device)
        if frontend is not None:
            x = frontend(x)
        logits = backbone(x)
        if not bool(logits.isfinite().all()):  # an argmax of NaN still "scores" a class: no accuracy of it
            if bool(x.isfinite().all()) and all(bool(p.isfinite().all()) for p in backbone.parameters()):
                raise NonFiniteOutput(
                    "the model's logits overflow (inf / NaN) on data.val although its weights and inputs are finite: "
                    "its weights are too large for float32 arithmetic (the training that wrote it diverged); no "
                    "accuracy is reported; use an earlier checkpoint, or train again with a lower optim.lr / "
                    "optim.clip_grad")
            raise NonFiniteOutput("the model's logits are not finite (NaN / inf) on data.val: its weights or inputs "
                                  "hold NaN / inf; no accuracy is reported; use an earlier checkpoint or a lower "
                                  "optim.lr")
        accuracy.update(logits, y)
    backbone.train(was_training)
    return accuracy.compute()


def snapshot_steps(keep_epochs: tuple[float, ...], per_epoch: int, total: int) -> dict[int, float]:
    """``{step: epoch}`` of ``run.keep_epochs``: epoch e is step ``round(e x per_epoch)`` (0: the initial weights).
    Epochs beyond the run's ``total`` steps, or two epochs on one step, are a :class:`ConfigError` naming them."""
    beyond = [e for e in keep_epochs if round(e * per_epoch) > total]
    if beyond:
        raise ConfigError(f"run.keep_epochs: epoch(s) {', '.join(f'{e:g}' for e in beyond)} lie beyond this run's "
                          f"budget of {total} steps ({total / per_epoch:g} epochs of {per_epoch} steps): drop them, "
                          "or train longer (optim.epochs / optim.max_steps)")
    steps: dict[int, float] = {}
    for e in sorted(keep_epochs):
        step = min(max(round(e * per_epoch), 0), total)
        if step in steps:
            raise ConfigError(f"run.keep_epochs: epochs {steps[step]:g} and {e:g} are both step {step} ({per_epoch} "
                              "steps per epoch): keep one of them")
        steps[step] = e
    return steps


def snapshot_name(epoch: float) -> str:
    return f"snapshots/epoch-{epoch:g}"


def folder_step(folder: Path) -> int | None:
    """The step in the metadata of a backbone folder (``best/``), or None when there is none to read."""
    try:
        return json.loads((folder / "config.json").read_text())["metadata"]["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


class BestTracker:
    """Early stopping's state: the best value of ``metric`` so far, its step and evaluation, and the evaluations
    since it. Rebuilt on resume by :meth:`replay` of the log's evaluations (each one counted as when it ran)."""

    def __init__(self, metric: str, patience: int) -> None:
        self.metric, self.patience = metric, patience
        self.lower = "loss" in metric  # a loss: lower is better
        self.best: float | None = None
        self.best_step: int | None = None
        self.best_eval: dict[str, Any] = {}
        self.since = 0

    def update(self, step: int, result: dict[str, Any]) -> bool:
        """Count the evaluation ``result`` of ``step``; True when it is a new best."""
        value = result.get(self.metric)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            numbers = sorted(k for k, v in result.items() if isinstance(v, int | float) and not isinstance(v, bool))
            raise ConfigError(f"run.early_stop_metric={self.metric}: the evaluation at step {step} gives "
                              f"{value!r} for it; it reports {', '.join(numbers) or 'no number'}")
        if self.best is None or (value < self.best if self.lower else value > self.best):
            self.best, self.best_step, self.best_eval, self.since = value, step, result, 0
            return True
        self.since += 1
        return False

    @property
    def exhausted(self) -> bool:
        return self.since >= self.patience

    def replay(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            if isinstance(record.get("eval"), dict):
                self.update(record["step"], record["eval"])

    def summary(self) -> dict[str, Any]:
        return {"best_step": self.best_step, "metric": self.metric, "best": self.best, "patience": self.patience}


class StepSchedule:
    """The lr of every parameter group as a function of the optimizer step alone: ``base lr x factor(step)``, set
    before each optimizer step (as nanoGPT's ``get_lr(it)``). Nothing to checkpoint, and nothing a wrapper can step
    twice: Accelerate's scheduler wrapper steps a prepared scheduler once per *process* per optimizer step
    (``split_batches=False``), which ran the schedule P times too fast under P processes."""

    def __init__(self, optimizer: torch.optim.Optimizer, factor: Callable[[int], float]) -> None:
        self.optimizer, self.factor = optimizer, factor
        for group in optimizer.param_groups:  # peak lr x the group's layer-decay scale (torch's name for it)
            group.setdefault("initial_lr", group["lr"])
        self.base = [group["initial_lr"] for group in optimizer.param_groups]

    def set(self, step: int) -> float:
        """Give every group its lr for optimizer step ``step`` (0-based); returns the factor."""
        factor = self.factor(step)
        for group, base in zip(self.optimizer.param_groups, self.base, strict=True):
            group["lr"] = base * factor
        return factor


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


class Interrupted(Exception):
    """SIGTERM / SIGINT ended the run after a checkpoint; ``str()`` says where and how to resume."""

    every_rank = True  # the ranks agree on the stop (:meth:`Trainer._stop_signal`): printed once

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class _StopSignals:
    """SIGTERM / SIGINT set a flag the training loop reads at each optimizer step; a second signal stops at once
    (SIGINT: KeyboardInterrupt; SIGTERM: the default action). Installed only in the main thread; the previous
    handlers come back on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> _StopSignals:
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:  # asked twice (e.g. the run is stuck before its next step): stop now
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.received = signum

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class Trainer:
    """Runs ``objective(batch, progress=) -> {"loss", ...}`` over the train reader for the configured budget.

    ``backbone`` is what ``checkpoint/`` saves (with ``metadata``); the objective's own extra parameters (heads,
    decoders, predictors) go to ``checkpoint/objective.safetensors`` so evaluations can rebuild it.
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
                                    "peak_lr": self.peak_lr}}
        self.batch_transform, self.evaluate = batch_transform, evaluate
        self.out = Path(run.output)
        self.log = JsonlLog(self.out / "log.jsonl", accelerator.is_main_process)
        self.batch_size = None
        # here, so a knob without effect fails before training
        self.optimizer = make_optimizer(objective, optim, self.peak_lr, accelerator.device)
        self.flops_per_sample = training_flops(objective)
        if run.finite_check == "lazy" and not self.optimizer.defaults.get("fused"):
            raise ConfigError("run.finite_check=lazy skips a non-finite step inside AdamW's fused kernel: set "
                              "optim.fused=true (null means fused on a GPU only), or run.finite_check=step")
        compiled = compile_blocks(objective, run.compile)
        if compiled:
            accelerator.print(f"run.compile={run.compile}: {compiled} Transformer blocks compiled (the first steps "
                              "compile them)")
        if optim.lr_scaling != "none":
            accelerator.print(f"optim.lr_scaling={optim.lr_scaling}: peak lr {optim.lr:g} at global batch "
                              f"{self.lr_base_batch} -> {self.peak_lr:.4g} at global batch "
                              f"{self.global_batch} ({accelerator.num_processes} process(es))")
        self.command = command or "the same command"
        # the batch, run.keep_epochs / run.early_stop_patience, checked before the directory is touched
        self._check_batch(per_process)
        self.snapshots = snapshot_steps(run.keep_epochs, *self.budget(config.data.batch_size))
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
        fingerprint, wherever the data lie now). Main process, lock held; reads only."""
        run, found, recorded = self.run, None, {}
        if run.resume and not run.overwrite:
            found = self._newest_state()
            if found is not None and found[1] is not None:
                verify(found[1])
            if found is not None:
                recorded = recorded_data(found[0])
        moved = tuple(name for key in recorded for name in (key, f"{key}_urls"))
        prepare_directory(self.out, resume=run.resume, overwrite=run.overwrite, config=to_dict(self.config),
                          moved=moved)
        if found is None:
            return
        state = found[0]
        trainer = json.loads((state / "trainer.json").read_text())
        saved = trainer.get("world_size") or len(list(state.glob("random_states_*.pkl")))
        if saved != self.acc.num_processes:
            raise CheckpointError(
                f"run.resume=true: the step-{trainer['step']} checkpoint in {self.out} was written by {saved} "
                f"process(es), this launch has {self.acc.num_processes}: the global batch, each rank's place in the "
                f"data and its random stream would change; resume with "
                f"{relaunch(saved, f'{self.command} run.resume=true')}, or start a new run (another run.output, or "
                "run.overwrite=true)")
        for key, fingerprint in recorded.items():
            now = self.fingerprints.get(key)
            if now != fingerprint:
                where = getattr(self.config.data, key.split(".")[1], "?")
                raise ConfigError(
                    f"run.resume=true: {key}={where} holds other data (fingerprint {str(now)[:16]}) than the "
                    f"step-{trainer['step']} checkpoint in {self.out} was trained on (fingerprint "
                    f"{fingerprint[:16]}): point {key} at that data (its path may change: the fingerprint is "
                    "compared, not the path), or train on this data in a new run (another run.output, or "
                    "run.overwrite=true)")

    def _newest_state(self) -> tuple[Path, Path | None] | None:
        """(state/, its checkpoint directory) of the newest complete checkpoint, or None when there is none yet. A
        newer ``step-*`` directory without its ``COMPLETE`` record is refused (damage: a save writes ``COMPLETE``
        before the directory gets its name)."""
        steps = complete_steps(self.out)
        newest = steps[-1][0] if steps else -1
        unsealed = [path for number, path in unsealed_steps(self.out) if number > newest]
        if unsealed:
            raise CheckpointError(
                f"{unsealed[-1]} has no {unsealed[-1] / 'COMPLETE'} record, so it cannot be verified (it was removed "
                "or the directory was copied in part): restore the record, or delete that directory to resume from "
                + (f"step {newest}" if steps else "scratch") + ", or start over with run.overwrite=true")
        if steps:
            return steps[-1][1] / "state", steps[-1][1]
        if (self.out / "state" / "trainer.json").is_file():  # the legacy layout: state/ in the run directory
            return self.out / "state", None
        return None

    # ------------------------------------------------------------------ budget
    def _check_batch(self, per_process: int) -> None:
        """An optimizer step's samples (data.batch_size x run.grad_accum) must fit in what each process reads of
        data.train per epoch: a larger batch cannot be formed (the loader would give smaller ones, while the lr
        scaling, the model card and the logged throughput counted the asked one)."""
        available, accum = len(self.data.train), self.run.grad_accum
        if per_process <= available:
            return
        m = self.data.train.manifest
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

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, step: int, metrics: dict[str, Any] | None = None,
                        stopped_early: dict[str, Any] | None = None) -> None:
        """Crash-consistent (``rundir.py``): write ``checkpoints/.partial-step-N`` (backbone + objective extras,
        Accelerate state with every rank's RNG), seal it with ``COMPLETE``, rename it to ``step-N``, point the
        ``checkpoint`` link at it, then remove the previous step. ``metrics`` (the end-of-run evaluation) go into
        the model card and config.json *before* the seal: nothing rewrites a sealed checkpoint; ``stopped_early``
        (the early stop's summary) goes into ``state/trainer.json``. Weights that are not finite are never saved
        (:class:`Diverged`); a full disk is a one-line error."""
        acc, out = self.acc, self.out
        self._check_finite_weights(step)
        partial = partial_dir(out, step)
        acc.wait_for_everyone()
        metadata = {**self.metadata, "step": step, **({"metrics": metrics, "metrics_split": metrics_split(
            self.config.data)} if metrics else {})}
        try:
            if acc.is_main_process:
                if partial.exists():
                    shutil.rmtree(partial)
                partial.mkdir(parents=True)
            acc.wait_for_everyone()
            if acc.is_main_process:
                self._save_backbone(partial / "checkpoint", metadata)
            acc.save_state(str(partial / "state"))  # every process writes its own random_states_<rank>.pkl
            acc.wait_for_everyone()  # ... before the main process seals the directory
            if acc.is_main_process:
                (partial / "state" / "trainer.json").write_text(json.dumps({
                    "step": step, "world_size": acc.num_processes, "global_batch": self.global_batch,
                    "data": self.fingerprints, **({"stopped_early": stopped_early} if stopped_early else {})}))
                final = commit(partial, step)
                point_checkpoint_link(out, final / "checkpoint")
                clean(out, keep=final)
        except Exception as exc:  # OSError, torch's RuntimeError, SafetensorError: only disk errors are caught
            if not disk_error(exc):
                raise
            shutil.rmtree(partial, ignore_errors=True)
            raise CheckpointError(disk_message(out, step, exc)) from None
        acc.wait_for_everyone()

    def _save_backbone(self, folder: Path, metadata: dict[str, Any]) -> None:
        """The backbone checkpoint folder (``save_pretrained`` + the objective's extra parameters in
        ``objective.safetensors``): what ``checkpoint/``, ``snapshots/*`` and ``best/`` hold. Main process."""
        save_pretrained(self.backbone, folder, metadata=metadata)
        extras = {k: v.detach().contiguous().cpu() for k, v in self.acc.unwrap_model(self.objective)
                  .state_dict().items() if not k.startswith(("backbone.", "target_encoder."))}
        if extras:
            save_file(extras, str(folder / "objective.safetensors"))

    def _snapshot(self, step: int, missing_only: bool = False) -> None:
        """Keep the backbone of ``step`` (a run.keep_epochs step) in ``snapshots/epoch-E/`` (every rank calls
        this; the main process writes). ``missing_only``: unless it is there already (the step a run starts at)."""
        self._check_finite_weights(step)
        epoch = self.snapshots[step]
        name = snapshot_name(epoch)
        if not self.acc.is_main_process or (missing_only and (self.out / name).is_dir()):
            return
        publish_folder(self.out / name, lambda folder: self._save_backbone(
            folder, {**self.metadata, "step": step, "epoch": epoch}))
        self.log.write({"step": step, "snapshot": name})
        self._print(f"snapshot: epoch {epoch:g} (step {step}) in {self.out / name}")

    def _save_best(self, step: int) -> None:
        """Write ``best/``: the backbone of ``step``, the best evaluation so far (every rank calls this; the main
        process writes). Called after the checkpoint of that step, so a run resumed from it can rewrite it."""
        self._check_finite_weights(step)
        tracker = self.tracker
        if not self.acc.is_main_process or tracker is None:
            return
        metrics = {k: v for k, v in tracker.best_eval.items() if isinstance(v, int | float | str)}
        publish_folder(self.out / "best", lambda folder: self._save_backbone(folder, {
            **self.metadata, "step": step, "best_metric": tracker.metric, "best_value": tracker.best,
            "metrics": metrics, "metrics_split": metrics_split(self.config.data)}))

    def _catch_up(self, step: int) -> None:
        """What a kill may have left unwritten of the step this run starts at (its weights are loaded): its
        snapshot (step 0: the initial weights) and ``best/`` when that step is the best. Older ones are on disk
        (a snapshot step is a checkpoint step, written before its checkpoint; best/ right after its checkpoint)."""
        if step in self.snapshots:
            self._snapshot(step, missing_only=True)
        tracker = self.tracker
        if not self.acc.is_main_process or tracker is None or tracker.best_step is None:
            return
        if folder_step(self.out / "best") != tracker.best_step:
            if tracker.best_step == step:
                self._save_best(step)
            else:
                print(f"warning: {self.out / 'best'} does not hold the best step ({tracker.best_step}) of the log, "
                      "whose weights are gone (was it changed by hand?); it is rewritten at the next better "
                      "evaluation", file=sys.stderr)

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

    def _print(self, text: str) -> None:
        """A line of the main process, clear of the progress bar."""
        if self.acc.is_main_process:
            (self.bar.write if getattr(self, "bar", None) is not None else print)(text)

    def _report_best(self) -> None:
        tracker = self.tracker
        if tracker is not None and tracker.best_step is not None:
            self._print(f"best: {self.out / 'best'} (step {tracker.best_step}, {tracker.metric} {tracker.best:.4g}): "
                        "the checkpoint to evaluate")

    def resume_step(self) -> int:
        """``run.resume=true``: load the newest complete checkpoint (0: none yet), which the main process checked
        when the Trainer was made (:meth:`_check_directory`: sealed, intact, as many processes, the same data). A
        state file the safe loader refuses or cannot read is refused in one line (Accelerate would skip a bad
        random state)."""
        if not self.run.resume:
            return 0
        found = self._newest_state()
        if found is None:
            self.acc.print(f"run.resume=true: {self.out} holds no checkpoint yet; starting at step 0")
            return 0
        state = found[0]
        trainer = json.loads((state / "trainer.json").read_text())
        self.stopped_early = trainer.get("stopped_early")
        load_state_strictly(self.acc, state)
        return int(trainer["step"])

    def _check_finite_weights(self, step: int) -> None:
        """No checkpoint of non-finite weights (a step with a finite loss can still blow them up)."""
        finite = torch.stack([p.detach().isfinite().all() for p in self.objective.parameters()]).all()
        if not bool(finite):
            raise Diverged(self._diverged(step, "the weights hold non-finite values"))

    def _check_finite_loss(self, loss: torch.Tensor, step: int) -> None:
        """Stop before a non-finite loss reaches the weights: every rank's loss is gathered (one collective per
        micro-step), so all ranks stop at the same step."""
        losses = self.acc.gather(loss.detach().float().reshape(1)) if self.acc.num_processes > 1 else \
            loss.detach().float().reshape(1)
        bad = (~losses.isfinite()).nonzero().flatten().tolist()
        if bad:
            rank = bad[0]
            raise Diverged(self._diverged(step, f"the loss is {losses[rank].item()} on rank {rank}"))

    def _flag_nonfinite(self, loss: torch.Tensor, step: int) -> None:
        """run.finite_check=lazy, every micro-step, no host sync: whether this optimizer step has seen a non-finite
        loss on this rank, and the first such step of the run with its loss (device tensors, read by
        :meth:`_check_flags`; the gradients' flags are set by :meth:`_skip_if_nonfinite`)."""
        value = loss.detach().float()
        bad = ~value.isfinite()
        if self._flags is None:
            self._flags = {"now": torch.zeros((), dtype=torch.bool, device=value.device),
                           "first": torch.full((), -1, dtype=torch.long, device=value.device),
                           "loss": torch.zeros((), device=value.device),
                           "grad_first": torch.full((), -1, dtype=torch.long, device=value.device),
                           "grad": torch.zeros((), device=value.device)}
        flags = self._flags
        fresh = bad & (flags["first"] < 0)
        flags["first"] = torch.where(fresh, flags["first"].new_full((), step), flags["first"])
        flags["loss"] = torch.where(fresh, value, flags["loss"])
        flags["now"] = flags["now"] | bad

    def _skip_if_nonfinite(self, optimizer: Any, grad_norm: torch.Tensor | None, step: int) -> None:
        """run.finite_check=lazy, on a sync step: AdamW's fused kernel skips this update (``found_inf``) when a loss
        of the step on any rank or the gradients (the same on every rank after the all-reduce) are not finite. The
        decision is a max over ranks (a device all-reduce, no host sync): a loss that is NaN on one rank alone can
        leave the gradients finite, and every rank must skip alike to keep the weights identical."""
        inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper around the torch optimizer
        if grad_norm is None:
            grads = [p.grad for g in inner.param_groups for p in g["params"] if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.acc.device)
        norm = grad_norm.detach().float()
        grad_bad = ~norm.isfinite()
        if self._flags is None:  # (a finite value: sets up the flags only)
            self._flag_nonfinite(torch.zeros((), device=norm.device), step)
        flags = self._flags
        fresh = grad_bad & (flags["grad_first"] < 0)
        flags["grad_first"] = torch.where(fresh, flags["grad_first"].new_full((), step), flags["grad_first"])
        flags["grad"] = torch.where(fresh, norm, flags["grad"])
        skip = (flags["now"] | grad_bad).float()
        if self.acc.num_processes > 1:
            torch.distributed.all_reduce(skip, op=torch.distributed.ReduceOp.MAX)
        inner.found_inf = skip
        flags["now"] = torch.zeros_like(flags["now"])

    def _check_flags(self, step: int) -> None:
        """run.finite_check=lazy: one host sync (every rank's flags gathered) before a log, checkpoint or
        evaluation; a non-finite step anywhere stops the run with the same line as the per-step check, naming the
        rank whose loss was not finite (or the gradients, when every rank's loss was finite)."""
        if self._flags is None:
            return
        flags = self._flags
        steps = torch.stack([flags["first"], flags["grad_first"]]).reshape(1, 2)
        values = torch.stack([flags["loss"], flags["grad"]]).reshape(1, 2)
        if self.acc.num_processes > 1:
            steps, values = self.acc.gather(steps), self.acc.gather(values)
        steps, values = steps.tolist(), values.tolist()
        losses = [(s, rank) for rank, (s, _) in enumerate(steps) if s >= 0]
        grads = [(s, rank) for rank, (_, s) in enumerate(steps) if s >= 0]
        if not losses and not grads:
            return
        if losses and (not grads or min(losses)[0] <= min(grads)[0]):
            at, rank = min(losses)
            what = f"the loss is {values[rank][0]} on rank {rank}"
        else:
            at, rank = min(grads)
            what = f"the gradients are not finite (norm {values[rank][1]}) while every rank's loss was finite"
        raise Diverged(self._diverged(at, f"{what} (seen at step {step}: run.finite_check=lazy; the step's update "
                                          "was skipped)"))

    def _diverged(self, step: int, what: str) -> str:
        last = latest_step(self.out)
        kept = (f"the last good checkpoint (step {last}) is kept in {self.out / 'checkpoints'}" if last is not None
                else "no checkpoint was written")
        return (f"training diverged at step {step}: {what}; nothing of it was saved, {kept}; try a lower optim.lr "
                f"(peak {self.peak_lr:g}), a longer optim.warmup_fraction, optim.clip_grad, or run.mixed_precision="
                "bf16 / no instead of fp16, in a new run (run.overwrite=true or another run.output)")

    # ------------------------------------------------------------------ loop
    def _inputs(self, batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = (t.to(self.acc.device, non_blocking=True) for t in batch[:2])
        if self.data.frontend is not None:
            x = self.data.frontend(x)  # waveforms -> MFCC frames on device
        if self.batch_transform is not None:
            x, y = self.batch_transform(x, y)
        return x, y

    def fit(self, batch_size: int) -> dict[str, Any]:
        """Train for the configured budget (or until early stopping); returns the last evaluation. Raises
        :class:`Interrupted` (after a checkpoint) on SIGTERM / SIGINT. The directory's lock is released however it
        ends."""
        self.bar: tqdm | None = None
        try:
            with _StopSignals() as signals:
                return self._fit(batch_size, signals)
        finally:
            if self.bar is not None:
                self.bar.close()  # ends the progress line, so an error message starts on its own line
            if self.lock is not None:
                self.lock.release()

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

    def _stop_signal(self, signals: _StopSignals) -> int:
        """The signal that asked this run to stop (0: none), agreed by every rank (max over ranks) so that all of
        them save the same step."""
        received = signals.received or 0
        if self.acc.num_processes > 1:
            flag = torch.tensor([received], device=self.acc.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            received = int(flag.item())
        return received

    def _interrupted(self, step: int, signum: int) -> Interrupted:
        name = signal.Signals(signum).name
        launcher = "python" if self.acc.num_processes == 1 else "accelerate launch <the same launch options>"
        return Interrupted(f"interrupted by {name} at step {step}: checkpoint saved in {self.out}/checkpoints; "
                           f"resume with: {launcher} {self.command} run.resume=true", 128 + signum)

    def _fit(self, batch_size: int, signals: _StopSignals) -> dict[str, Any]:
        acc, run = self.acc, self.run
        per_epoch, total = self.budget(batch_size)
        optimizer = self.optimizer
        lazy, self._flags = run.finite_check == "lazy", None
        schedule = StepSchedule(optimizer, warmup_cosine(total, self.optim_cfg.warmup_fraction,
                                                         self.optim_cfg.min_lr_ratio))
        # what every parameter really gets (lr scale, weight decay), for the user to check: optimizer.json
        groups = parameter_groups(optimizer, self.objective) if acc.is_main_process else None
        find_unused = self.run.find_unused_parameters
        if find_unused is None:  # auto: only objectives that may leave a parameter without gradient (MJP)
            find_unused = bool(getattr(self.objective, "leaves_parameters_unused", False))
        acc.ddp_handler = DistributedDataParallelKwargs(find_unused_parameters=find_unused)
        # The schedule is not prepared: Accelerate's wrapper would step it once per process (StepSchedule).
        objective, optimizer = acc.prepare(self.objective, optimizer)
        # Each rank its own random stream (masks, noise, drop path): rank_seed(seed, rank), distinct for every
        # (seed, rank) pair. Resume restores every rank's stream from state/random_states_<rank>.pkl. The data
        # order has its own (seed, epoch, rank) seeds.
        set_seed(rank_seed(run.seed, acc.process_index))
        step = first_step = self.resume_step()
        if acc.is_main_process:
            for parent in (self.out, self.out / "snapshots"):  # what a kill in a snapshot / best/ write left
                tidy_folders(parent)
            if run.resume:
                truncate_log(self.out / "log.jsonl", step)  # the steps after the checkpoint are logged again
                log = self.out / "log.jsonl"
                if self.tracker is not None and log.is_file():  # early stopping: the evaluations up to the checkpoint
                    self.tracker.replay(read_log(log)[0])
        self._catch_up(step)
        if run.resume and (step >= total or self.stopped_early):  # finished: nothing to train, nothing to rewrite
            if acc.is_main_process:  # ... but what a kill in its last save left undone (the link, the old step)
                final = complete_steps(self.out)[-1][1]
                point_checkpoint_link(self.out, final / "checkpoint")
                clean(self.out, keep=final)
            how = f"stopped early at step {step} of {total}" if self.stopped_early else f"step {step} of {total}"
            acc.print(f"run.resume=true: {self.out} is complete ({how}); nothing to do")
            self._report_best()
            return self._finished_result()
        if acc.is_main_process:  # written once the resume is accepted: a refused one leaves the run's files alone
            write_json_atomic(self.out / "optimizer.json", {
                "lr": self.peak_lr, "config_lr": self.optim_cfg.lr, "lr_scaling": self.optim_cfg.lr_scaling,
                "lr_base_batch": self.lr_base_batch,
                "global_batch": self.global_batch, "processes": acc.num_processes,
                "layer_decay": self.optim_cfg.layer_decay, "weight_decay": self.optim_cfg.weight_decay,
                "parameters": groups})
            with atomic_file(self.out / "config.yaml") as tmp:
                tmp.write_text(yaml.safe_dump(to_dict(self.config), sort_keys=False))
            if run.tensorboard:
                acc.init_trackers("tensorboard")
        # which processes really run this job (world size and the distinct ranks, gathered from every process)
        ranks = acc.gather(torch.tensor([acc.process_index], device=acc.device)).tolist()
        bar = self.bar = tqdm(total=total, initial=step, disable=not acc.is_main_process,
                              desc=self.metadata.get("method"))
        last_eval: dict[str, Any] = {}
        # Rates are measured from the end of this session's first step: startup (reading the data, building the
        # model, spawning workers, the first step) is logged apart as startup_s.
        start, startup = time.perf_counter(), 0.0
        waited = 0.0  # seconds spent waiting for the data (its share of step time is logged)
        samples = 0  # samples this process trained on since the rates' start (a last batch may be short)
        epoch, skip = divmod(step, per_epoch)
        stopped = False  # by early stopping
        while step < total:
            fetch = time.perf_counter()
            batches = 0
            # resume: the epoch's deterministic stream from the step on (streaming replays the skipped batches)
            for batch in self.data.train.batches(batch_size, epoch, skip=skip * run.grad_accum):
                batches += 1
                samples += len(batch[0])
                waited += time.perf_counter() - fetch
                x, y = self._inputs(batch)
                progress = step / total
                with acc.accumulate(objective):
                    out = objective((x, y), progress=progress)
                    if lazy:  # flagged on the device, checked at the next log / checkpoint / evaluation
                        self._flag_nonfinite(out["loss"], step + 1)
                    else:
                        self._check_finite_loss(out["loss"], step + 1)  # before it reaches the weights
                    acc.backward(out["loss"])
                    norm = None
                    if acc.sync_gradients and self.optim_cfg.clip_grad:
                        norm = acc.clip_grad_norm_(objective.parameters(), self.optim_cfg.clip_grad)
                    if lazy and acc.sync_gradients:
                        self._skip_if_nonfinite(optimizer, norm, step + 1)
                    lr_factor = schedule.set(step)  # the lr of this optimizer step, once per step on every rank
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                fetch = time.perf_counter()
                if not acc.sync_gradients:
                    continue
                step += 1
                if step == first_step + 1:
                    start, waited, samples = time.perf_counter(), 0.0, 0
                    startup = start - self.data.started
                if lazy and (step % run.log_every == 0 or step >= total or step in self.snapshots
                             or (run.stop_after and step >= run.stop_after)
                             or (run.checkpoint_every and step % run.checkpoint_every == 0)
                             or (self.evaluate is not None and run.eval_every and step % run.eval_every == 0)):
                    self._check_flags(step)  # before anything of the step is logged, saved or evaluated
                unwrapped = acc.unwrap_model(objective)
                if hasattr(unwrapped, "update_target"):  # EMA target encoder (I-JEPA / StoP)
                    unwrapped.update_target(step / total)
                bar.update(1)
                if step % run.log_every == 0 or step == total:
                    scalars = {k: float(acc.reduce(v.detach().float(), "mean")) for k, v in out.items()
                               if torch.is_tensor(v) and v.numel() == 1}
                    elapsed = time.perf_counter() - start
                    seen = samples * acc.num_processes  # every rank reads as many samples per epoch
                    # the lr this step trained with (groups carry it x their layer-decay lr_scale)
                    scalars.update(lr=self.peak_lr * lr_factor, epoch=epoch, startup_s=round(startup, 2))
                    if seen:  # (not on the first step: startup)
                        scalars.update(data_share=round(waited / elapsed, 4), samples_per_s=round(seen / elapsed, 1))
                        if self.flops_per_sample:  # achieved training TFLOP/s, from the shapes
                            scalars["tflops"] = round(seen / elapsed * self.flops_per_sample / 1e12, 5)
                    if self.data.train.skipped:  # data.skip_corrupt (counted in this process; workers warn)
                        scalars["skipped_shards"] = len(set(self.data.train.skipped))
                    self.log.write({"step": step, **scalars, "world_size": acc.num_processes, "ranks": ranks,
                                    "data": self.data.path})
                    if run.tensorboard:  # namespaced as TensorBoard groups them: train/loss, train/lr, ...
                        acc.log({f"train/{k}": v for k, v in scalars.items()}, step=step)
                    bar.set_postfix(loss=f"{scalars['loss']:.4f}")
                if step in self.snapshots:  # before the step's checkpoint: a resumed run finds it on disk
                    self._snapshot(step)
                new_best = False
                # evaluation before the step's checkpoint: a run resumed from it has its evaluation in the log
                if self.evaluate is not None and run.eval_every and step % run.eval_every == 0 and step < total:
                    last_eval = self._evaluate(objective, step)
                    new_best, stopped = self._follow(step, last_eval)
                    if stopped:
                        break
                # a snapshot or best step is a checkpoint step: a resumed run can rewrite what a kill left undone
                if step < total and ((run.checkpoint_every and step % run.checkpoint_every == 0)
                                     or step in self.snapshots or new_best):
                    self.save_checkpoint(step)
                if new_best:
                    self._save_best(step)
                stop = self._stop_signal(signals)
                if stop and step < total:
                    bar.close()
                    if lazy:
                        self._check_flags(step)
                    self.save_checkpoint(step)
                    raise self._interrupted(step, stop)
                if step >= total or (run.stop_after and step >= run.stop_after):
                    break
                fetch = time.perf_counter()  # logging, checkpoints and evaluation are not data time
            if stopped:
                break
            if run.stop_after and step >= run.stop_after and step < total:
                bar.close()
                self.save_checkpoint(step)  # as a periodic checkpoint would have been
                return {}
            if batches == 0 and step < total:
                raise DataError(f"epoch {epoch} of data.train yielded {batches} batch(es), none left to train on "
                                f"(skipped shards: {self.data.train.skipped or 'none'}); check the split with "
                                "`python -m patchplace.data verify <split dir>`")
            # the next epoch (an epoch shortened by data.skip_corrupt ends early: its steps are not made up)
            epoch, skip = epoch + 1, 0
        bar.close()
        new_best, summary = False, None
        if stopped:  # logged before the final checkpoint: a run killed in between stops again at this step
            if acc.is_main_process:
                summary = self.tracker.summary()
                self.log.write({"step": step, "early_stop": summary})
                later = [f"{e:g}" for s, e in self.snapshots.items() if s > step]
                self._print(f"early stop at step {step} of {total}: no better {summary['metric']} than "
                            f"{summary['best']:.4g} (step {summary['best_step']}) in {summary['patience']} "
                            "evaluation(s)" + (f"; run.keep_epochs {', '.join(later)} not reached" if later else ""))
        elif self.evaluate is not None:  # measured first, so the final checkpoint is sealed with its metrics
            last_eval = self._evaluate(objective, step)
            new_best, _ = self._follow(step, last_eval)  # the closing evaluation competes for best/ too
        metrics = {k: v for k, v in last_eval.items() if isinstance(v, int | float | str)} or None
        self.save_checkpoint(step, metrics=metrics, stopped_early=summary)
        if new_best:
            self._save_best(step)
        self._report_best()
        if run.tensorboard:
            acc.end_training()
        return last_eval

    def _finished_result(self) -> dict[str, Any]:
        """What a finished run measured at its end (the last evaluation in its log), for a resumed finished run."""
        path = self.out / "log.jsonl"
        records = read_log(path)[0] if self.acc.is_main_process and path.is_file() else []
        evals = [r["eval"] for r in records if isinstance(r.get("eval"), dict)]
        return evals[-1] if evals else {}

    def _evaluate(self, objective: nn.Module, step: int) -> dict[str, Any]:
        result: dict[str, Any] = {}
        if self.acc.is_main_process:
            result = self.evaluate(self.acc.unwrap_model(objective), step)
            self.log.write({"step": step, "eval": result})
            if self.run.tensorboard:  # val/top1, val/top5, ... beside train/*
                self.acc.log({f"val/{k}": v for k, v in result.items() if isinstance(v, int | float)
                              and k != "count"}, step=step)
        self.acc.wait_for_everyone()
        return result
