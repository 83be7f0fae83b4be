"""Atomic file and directory writes: readers never see a half-written shard, manifest, split, run folder or export.

The one home of the write protocol every package that may import ``patchplace.data`` shares (the pipelines' run
directories, the export's graph + sidecar): :func:`swap_dir` (a folder replaced by two renames), :func:`fsync` (a file
or folder flushed, so a rename survives a power cut), :func:`pid_alive` (whether a temporary's owner still runs);
the sha256 of a file is :func:`patchplace.data.manifest.sha256_file`."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def path_problem(what: str, path: str | os.PathLike) -> str | None:
    """The one line for a path this file system cannot hold (ENAMETOOLONG: a part longer than its NAME_MAX, or the
    whole longer than its PATH_MAX, read from the deepest folder of it that exists), or None; checked before
    anything is created or read, where the system call would raise an OSError mid-way."""
    absolute = os.path.abspath(path)
    folder = absolute
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:  # (isdir: False on ENAMETOOLONG)
        folder = os.path.dirname(folder)
    try:
        name_max, path_max = os.pathconf(folder, "PC_NAME_MAX"), os.pathconf(folder, "PC_PATH_MAX")
    except (OSError, ValueError):  # no limits to read: the system call will say
        return None
    longest = max(Path(absolute).parts, key=lambda part: len(os.fsencode(part)))
    if len(os.fsencode(longest)) > name_max:
        return (f"{what}: the name {longest[:24]}... in it is {len(os.fsencode(longest))} bytes long, and this file "
                f"system takes names of at most {name_max}: choose a shorter {what}")
    if len(os.fsencode(absolute)) >= path_max:
        return (f"{what}: its path is {len(os.fsencode(absolute))} bytes long, and this system takes paths of fewer "
                f"than {path_max}: choose a shorter {what}")
    return None


def umask() -> int:
    """The process umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: str | os.PathLike) -> None:
    """Give a ``tempfile.mkdtemp`` / ``mkstemp`` result (0700 / 0600) the mode a plain ``mkdir`` / ``open`` would
    have given it (0777 / 0666 minus the umask), so shards, manifests and checkpoints stay readable by whoever the
    user's umask lets read them (shared clusters)."""
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~umask())


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling of ``final``; on success it replaces ``final``, on error it is removed.

    An existing ``final`` is only removed after the new content is complete.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    follow_umask(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    swap_dir(tmp, final, final.with_name(f".{final.name}.old-{os.getpid()}"))


def fsync(path: str | os.PathLike) -> None:
    """Flush ``path`` (a file's bytes, or a folder's entries) to the disk, so that a file renamed after it, or a
    rename inside the folder, survives a power cut whole. Folders cannot be opened on Windows: skipped there."""
    if os.name != "posix" and os.path.isdir(path):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a lock's or a temporary's owner): signal 0 probes without
    signalling. Another user's process counts alive (EPERM); ``pid`` <= 0 is none (``kill`` would address a process
    group); on Windows, where ``os.kill(pid, 0)`` would end the process, every pid counts alive."""
    if pid <= 0:
        return False
    if os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def swap_dir(new: Path, final: Path, old: Path, sync: Callable[[Path], None] | None = None) -> None:
    """Put the complete folder ``new`` at ``final`` with two renames (POSIX-atomic on one filesystem): a previous
    ``final`` moves to ``old`` for the instant of the swap, then is removed. A kill leaves ``final`` whole (old or
    new) or, between the renames, missing with ``old`` whole. ``sync(final.parent)`` (an fsync of the folder, for
    writers that must survive a power cut) runs once the renames are done, before ``old`` is removed."""
    if final.exists():
        os.replace(final, old)
    os.replace(new, final)
    if sync is not None:
        sync(final.parent)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling of ``final`` (same suffix, e.g. for ``np.savez``) to write; on success it replaces
    ``final`` (POSIX-atomic on one filesystem), on error it is removed."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=final.suffix, dir=final.parent)
    os.close(fd)
    follow_umask(tmp)
    try:
        yield Path(tmp)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON to ``path`` through :func:`atomic_file`."""
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
