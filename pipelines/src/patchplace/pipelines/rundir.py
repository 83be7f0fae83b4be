"""One training run per directory, and checkpoints that a kill at any instant cannot lose.

Layout of ``run.output`` (the parts this module owns)::

    .lock                        flock'ed by the process that runs the directory (pid, host, start time inside)
    checkpoints/step-00000158/   the last complete checkpoint, immutable once there:
        checkpoint/              backbone (config.json + model.safetensors) + objective.safetensors
        state/                   Accelerate state (model, optimizer, scheduler, each rank's RNG) + trainer.json
        COMPLETE                 step, and size + sha256 of every file above: written last
    checkpoint -> checkpoints/step-00000158/checkpoint   (a relative symlink, swapped atomically)
    snapshots/epoch-1/, best/    backbone folders kept beside the checkpoints (run.keep_epochs, early stopping),
                                 each written by :func:`publish_folder`

A save writes ``checkpoints/.partial-step-N``, fsyncs it, writes ``COMPLETE``, renames the directory to
``step-N`` (atomic), swaps the ``checkpoint`` link (atomic), and only then removes the older step (renamed to
``.trash-*`` first, so a half-deleted directory is never taken for a checkpoint). At every instant the newest
``step-*`` with a valid ``COMPLETE`` is a whole checkpoint; resume takes it, verifies every file against
``COMPLETE`` (a corrupt file is an error naming it, never silently skipped) and clears what a kill left behind.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from patchplace.data.atomic import swap_dir, umask
from patchplace.pipelines import objective_fields
from patchplace.pipelines.config import ConfigError, one_line

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
LOCK = ".lock"
# What a training run leaves in its directory (run.overwrite=true removes exactly these).
RUN_ENTRIES = ("log.jsonl", "config.yaml", "optimizer.json", CHECKPOINTS, "checkpoint", "tensorboard", "snapshots",
               "best", "ema")
# Config fields a resumed run may change: they do not change what is trained (run.output: the same directory
# spelled another way, relative / absolute / a trailing slash, or the run moved elsewhere).
RESUMABLE_CHANGES = ("run.output", "run.resume", "run.overwrite", "run.log_every", "run.checkpoint_every",
                     "run.eval_every", "run.tensorboard", "run.log_with", "run.log_project",
                     "run.find_unused_parameters", "run.finite_check",
                     "data.verify_shards", "data.timeout", "data.retries")
# the budget a resume may extend (the Trainer checks it grows: :func:`extension_problem`)
EXTENDABLE = ("optim.epochs", "optim.max_steps", "optim.extend")
# the layout of a step's global batch a resume may change while keeping it (the checkpoints check the product)
RELAYOUT = ("data.batch_size", "run.grad_accum")
# data.num_workers plans a streamed epoch (which samples each DataLoader worker reads, in which order): resumable
# only for a run whose data.train was held in memory (its log says so), where it just loads the shards in parallel
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class CheckpointError(ConfigError):
    """A checkpoint that cannot be written or read back; the message names the file and the fix."""


# ---------------------------------------------------------------------------------------------- the lock
class RunLock:
    """An exclusive ``flock`` on ``<run>/.lock`` for the life of the run. The kernel drops it when the process
    dies, so a lock left by a killed run is simply taken over; one held by a live process is an error naming it."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / LOCK
        self.fd: int | None = None
        self.previous: bytes | None = None  # what the lock file held before (restored by a refused launch)

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        existed = self.path.exists()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            try:
                holder = json.loads(self.path.read_text() or "{}")
            except (OSError, ValueError):
                holder = {}
            who = (f"process {holder.get('pid', '?')} on {holder.get('host', '?')} (since "
                   f"{holder.get('since', '?')})")
            raise ConfigError(f"run.output {self.path.parent} is in use by {who}: wait for that run to end, or "
                              "choose another run.output") from None
        self.previous = _read_all(fd) if existed else None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        self.fd = fd
        return self

    def release(self, restore: bool = False) -> None:
        """Unlock; ``restore``: give the lock file back what it held before (a launch that was refused leaves
        every file of the run as it found it)."""
        if self.fd is not None:
            if restore and self.previous is not None:
                os.ftruncate(self.fd, 0)
                os.pwrite(self.fd, self.previous, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _read_all(fd: int) -> bytes:
    chunks, offset = [], 0
    while chunk := os.pread(fd, 1 << 16, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


# ---------------------------------------------------------------------------------------------- fresh / resume
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
        old = yaml.safe_load(saved.read_text())
        if not isinstance(old, dict | None):
            raise ValueError(f"a {type(old).__name__}, not a mapping")
    except (ValueError, yaml.YAMLError, UnicodeDecodeError) as exc:
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
    spec = objective_fields.methods().get(method) if isinstance(method, str) and isinstance(given, dict) else None
    return {**tree, "objective": {**spec.defaults, **given}} if spec is not None else tree


def config_changes(saved: dict[str, Any], current: dict[str, Any], moved: tuple[str, ...] = ()) -> list[str]:
    """``field (old -> new)`` for every field of both configs that differs and is not in RESUMABLE_CHANGES (nor
    in ``moved``)."""
    old, new = _flatten(_objective_in_force(saved)), _flatten(_objective_in_force(current))
    # early stopping counts evaluations: their cadence changes where it stops
    fixed = {"run.eval_every"} if new.get("run.early_stop_patience") else set()
    return [f"{k} ({old[k]!r} -> {new[k]!r})" for k in sorted(old.keys() & new.keys())
            if (k not in (*RESUMABLE_CHANGES, *moved) or k in fixed) and not _same(old[k], new[k])]


# ---------------------------------------------------------------------------------------------- checkpoints
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_dir(directory: Path, step: int) -> Path:
    return Path(directory) / CHECKPOINTS / f"step-{step:08d}"


def partial_dir(directory: Path, step: int) -> Path:
    return Path(directory) / CHECKPOINTS / f".partial-step-{step:08d}"


def unsealed_steps(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every ``step-*`` directory *without* a ``COMPLETE`` record, oldest first: never made by a
    save (it seals before it renames), so damage."""
    root = Path(directory) / CHECKPOINTS
    found = [(int(p.name[5:]), p) for p in (root.glob("step-*") if root.is_dir() else [])
             if p.name[5:].isdigit() and not (p / COMPLETE).is_file()]
    return sorted(found)


def load_state_strictly(accelerator: Any, state: Path) -> None:
    """``accelerator.load_state(state)``, but a file it cannot read is a one-line :class:`CheckpointError` naming
    it, never a traceback: this rank's random state is read first by the same safe loader (Accelerate skips a bad
    one with ``except Exception``, and the resumed run would silently draw other masks), and a file the safe
    (``weights_only``) loader refuses is named as not written by this run, without torch's advice to turn the
    safety off."""
    own = state / f"random_states_{accelerator.process_index}.pkl"
    try:
        states = _safe_load(own)
        if not isinstance(states, dict) or not {"random_state", "numpy_random_seed", "torch_manual_seed"} <= set(
                states):
            raise ValueError("it lacks the python / numpy / torch random states")
    except Exception as exc:
        raise CheckpointError(_unloadable(own, exc)) from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            accelerator.load_state(str(state))
    except Exception as exc:
        bad = next((p for p in sorted(state.iterdir()) if p.suffix in (".bin", ".pkl") and not _loads(p)), state)
        raise CheckpointError(_unloadable(bad, exc)) from None


def _safe_load(path: Path) -> Any:
    """Accelerate's loader (torch's ``weights_only`` one, numpy allowed), its pickle-protocol warnings silenced."""
    from accelerate.utils import load

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load(path, map_location="cpu")


def _loads(path: Path) -> bool:
    try:
        _safe_load(path)
    except Exception:
        return False
    return True


def _unloadable(path: Path, exc: BaseException) -> str:
    text = str(exc)
    if "Weights only load failed" in text:  # torch's long advice (to turn the safety off) is never repeated
        after = text.split("WeightsUnpickler error:", 1)[-1].strip().splitlines()
        detail = after[0].strip() if after and "WeightsUnpickler error:" in text else "not plain tensors"
        why = (f"the safe (weights-only) loader refuses it ({detail}), so it is not a file this run wrote "
               "(damaged, replaced or tampered with); it was not run")
    else:
        first = text.strip().splitlines()[0][:160] if text.strip() else ""
        why = f"it cannot be read ({type(exc).__name__}: {first})"
    return (f"checkpoint file {path} cannot be loaded: {why}; the run cannot resume exactly from it: restore the "
            "file, delete that checkpoint directory to resume from an earlier one, or start over with "
            "run.overwrite=true")


def complete_steps(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every ``step-*`` directory with a ``COMPLETE`` record, oldest first."""
    root = Path(directory) / CHECKPOINTS
    found = []
    for path in root.glob("step-*") if root.is_dir() else []:
        if (path / COMPLETE).is_file() and path.name[5:].isdigit():
            found.append((int(path.name[5:]), path))
    return sorted(found)


def latest_step(directory: Path) -> int | None:
    """The step of the newest complete checkpoint, or None."""
    steps = complete_steps(directory)
    return steps[-1][0] if steps else None


def commit(partial: Path, step: int) -> Path:
    """Seal ``partial`` (every file fsynced, ``COMPLETE`` written last) and rename it to ``step-N``."""
    files = {}
    mode = 0o666 & ~umask()  # safetensors writes 0600: give every file the mode the user's umask asks for
    for path in sorted(p for p in partial.rglob("*") if p.is_file()):
        os.chmod(path, mode)
        _fsync(path)
        files[str(path.relative_to(partial))] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    record = partial / COMPLETE
    with open(record, "w") as f:
        f.write(json.dumps({"step": step, "files": files}, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    for sub in sorted({p.parent for p in partial.rglob("*")} | {partial}, key=lambda p: -len(p.parts)):
        _fsync(sub)
    final = step_dir(partial.parent.parent, step)
    if final.exists():  # the same step saved again (e.g. a resumed run interrupted at once): retire the old one
        os.replace(final, final.with_name(f".trash-{final.name}-{os.getpid()}"))
    os.replace(partial, final)
    _fsync(final.parent)
    return final


def publish_folder(final: Path, write: Callable[[Path], None]) -> Path:
    """Put the folder ``final`` in place atomically (temp dir + rename): ``write(folder)`` fills
    ``<parent>/.partial-<name>/<name>``, every file is fsynced, then the folder is renamed to ``final``; a previous
    ``final`` is moved to ``.replaced-<name>`` for the instant of the swap, then removed. A kill leaves ``final``
    whole (old or new) or, within the swap, missing; :func:`tidy_folders` removes the leftovers."""
    final = Path(final)
    partial, old = final.parent / f".partial-{final.name}", final.parent / f".replaced-{final.name}"
    for path in (partial, old):
        shutil.rmtree(path, ignore_errors=True)
    partial.mkdir(parents=True)
    folder = partial / final.name
    write(folder)
    mode = 0o666 & ~umask()  # safetensors writes 0600: the mode the user's umask asks for, as commit() does
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        os.chmod(path, mode)
        _fsync(path)
    _fsync(folder)
    swap_dir(folder, final, old, sync=_fsync)
    shutil.rmtree(partial, ignore_errors=True)
    return final


def tidy_folders(parent: Path) -> None:
    """Remove what a kill inside :func:`publish_folder` left in ``parent`` (``.partial-*``, ``.replaced-*``)."""
    for path in list(Path(parent).iterdir()) if Path(parent).is_dir() else []:
        if path.name.startswith((".partial-", ".replaced-")):
            shutil.rmtree(path, ignore_errors=True)


def point_checkpoint_link(directory: Path, target: Path) -> None:
    """Atomically make ``<run>/checkpoint`` a relative symlink to ``target`` (a directory of the run)."""
    link = Path(directory) / "checkpoint"
    tmp = Path(directory) / f".checkpoint.link-{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    os.symlink(os.path.relpath(target, directory), tmp)
    os.replace(tmp, link)


def clean(directory: Path, keep: Path) -> None:
    """Remove every checkpoint but ``keep`` and whatever a killed save left (partials, trash, link temp files)."""
    directory = Path(directory)
    root = directory / CHECKPOINTS
    for path in list(root.iterdir()) if root.is_dir() else []:
        if path == keep:
            continue
        if path.name.startswith("step-"):
            trash = path.with_name(f".trash-{path.name}-{os.getpid()}")
            os.replace(path, trash)  # never a half-deleted step-* directory
            path = trash
        shutil.rmtree(path, ignore_errors=True)
    for path in directory.iterdir():
        if path.name.startswith((".trash-", ".checkpoint.link-")):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def verify(step_path: Path) -> dict[str, Any]:
    """The ``COMPLETE`` record of a checkpoint after checking every file it lists (size and sha256)."""
    try:
        record = json.loads((step_path / COMPLETE).read_text())
        files = record["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{step_path / COMPLETE} is unreadable ({exc}); delete {step_path} to resume from "
                              "scratch, or set run.overwrite=true") from None
    for name, expected in files.items():
        path = step_path / name
        if not path.is_file():
            problem = "is missing"
        elif path.stat().st_size != expected["bytes"]:
            problem = f"has {path.stat().st_size} bytes, {expected['bytes']} were written"
        elif _sha256(path) != expected["sha256"]:
            problem = "is corrupt (its sha256 differs from the one written with it)"
        else:
            continue
        raise CheckpointError(f"checkpoint file {path} {problem}: the run cannot resume exactly from step "
                              f"{record.get('step')}; restore the file, or start over with run.overwrite=true")
    return record


DISK_TEXTS = ("No space left", "File too large", "Disk quota", "unexpected pos", "file write failed",
              *(f"os error {code})" for code in DISK_ERRNOS))


def disk_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed write for lack of space (ENOSPC / quota / file size limit): an OSError with that
    errno, torch's ``inline_container`` RuntimeError for a short write, or safetensors' ``I/O error ... (os error
    28)``."""
    if isinstance(exc, OSError):
        return exc.errno in DISK_ERRNOS
    return any(text in str(exc) for text in DISK_TEXTS)


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem holding ``path`` (the disk to free)."""
    path = Path(path).resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def disk_message(directory: Path, step: int | None, exc: BaseException) -> str:
    """One line for a write that failed for lack of space: what, how much is free where, what is kept, what to do
    (``step``: the checkpoint being written, None for another write of the run)."""
    usage = shutil.disk_usage(directory)
    last = latest_step(directory)
    kept = f"the last complete checkpoint (step {last}) is intact" if last is not None else "no checkpoint yet"
    name = getattr(exc, "filename", None)
    what = f"the step-{step} checkpoint in {directory}" if step is not None else \
        (f"{name}" if name else f"to {directory}")
    return (f"could not write {what}: the disk is full or a size limit was hit "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:120]}); {usage.free / 2**20:.0f} MiB free of "
            f"{usage.total / 2**30:.1f} GiB on the filesystem mounted at {mount_point(directory)}; {kept}; free "
            "space (or point run.output elsewhere) and run the same command with run.resume=true")
