"""The file protocol of a run directory: one run at a time (:class:`RunLock`), and checkpoints that a kill at any
instant cannot lose.

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
Pure file-system code (no torch, no Accelerate): the lines ``tests/fault_driver.py`` kills a save at, each.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from patchplace.data.atomic import fsync, swap_dir, umask
from patchplace.data.manifest import sha256_file
from patchplace.pipelines.config import ConfigError

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
LOCK = ".lock"
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class CheckpointError(ConfigError):
    """A checkpoint that cannot be written or read back; the message names the file and the fix."""


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



def newest_state(directory: Path) -> tuple[Path, Path] | None:
    """(state/, its checkpoint directory) of the newest complete checkpoint, or None when there is none yet. A
    newer ``step-*`` directory without its ``COMPLETE`` record is refused (damage: a save writes ``COMPLETE``
    before the directory gets its name)."""
    steps = complete_steps(directory)
    newest = steps[-1][0] if steps else -1
    unsealed = [path for number, path in unsealed_steps(directory) if number > newest]
    if unsealed:
        raise CheckpointError(
            f"{unsealed[-1]} has no {unsealed[-1] / 'COMPLETE'} record, so it cannot be verified (it was removed "
            "or the directory was copied in part): restore the record, or delete that directory to resume from "
            + (f"step {newest}" if steps else "scratch") + ", or start over with run.overwrite=true")
    return (steps[-1][1] / "state", steps[-1][1]) if steps else None


def commit(partial: Path, step: int) -> Path:
    """Seal ``partial`` (every file fsynced, ``COMPLETE`` written last) and rename it to ``step-N``."""
    files = {}
    mode = 0o666 & ~umask()  # safetensors writes 0600: give every file the mode the user's umask asks for
    for path in sorted(p for p in partial.rglob("*") if p.is_file()):
        os.chmod(path, mode)
        fsync(path)
        files[str(path.relative_to(partial))] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    record = partial / COMPLETE
    record.write_text(json.dumps({"step": step, "files": files}, indent=1) + "\n")
    fsync(record)
    for sub in sorted({p.parent for p in partial.rglob("*")} | {partial}, key=lambda p: -len(p.parts)):
        fsync(sub)
    final = step_dir(partial.parent.parent, step)
    # the same step saved again (e.g. a resumed run interrupted at once): the old one is retired as .trash-*
    swap_dir(partial, final, final.with_name(f".trash-{final.name}-{os.getpid()}"), sync=fsync)
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
        fsync(path)
    fsync(folder)
    swap_dir(folder, final, old, sync=fsync)
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
        elif sha256_file(path) != expected["sha256"]:
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
