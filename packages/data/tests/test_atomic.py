"""The shared write protocol of patchplace.data.atomic: the folder swap, fsync, a temporary's owner alive or not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from patchplace.data.atomic import atomic_dir, fsync, pid_alive, swap_dir


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def test_swap_dir_replaces_a_folder_whole_and_syncs_its_parent_between_the_renames(tmp_path):
    final, new, old = tmp_path / "split", tmp_path / ".split.new", tmp_path / ".split.old"
    final.mkdir()
    (final / "a.txt").write_text("old a")
    (final / "gone.txt").write_text("only in the old folder")
    new.mkdir()
    (new / "a.txt").write_text("new a")
    seen = []

    def sync(folder: Path) -> None:  # the instant after the renames: the new folder in place, the old one aside
        seen.append((folder, _tree(final), old.is_dir()))

    swap_dir(new, final, old, sync=sync)
    assert seen == [(tmp_path, {"a.txt": "new a"}, True)]
    assert _tree(final) == {"a.txt": "new a"} and not old.exists() and not new.exists()


def test_atomic_dir_leaves_the_previous_folder_on_error(tmp_path):
    final = tmp_path / "out"
    with atomic_dir(final) as tmp:
        (tmp / "x").write_text("1")
    with pytest.raises(RuntimeError), atomic_dir(final) as tmp:
        (tmp / "x").write_text("2")
        raise RuntimeError("killed mid-write")
    assert _tree(final) == {"x": "1"} and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_fsync_flushes_the_path_itself(tmp_path, monkeypatch, kind):
    path = tmp_path / "f"
    path.mkdir() if kind == "folder" else path.write_bytes(b"payload")
    flushed, real = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (flushed.append(os.fstat(fd).st_ino), real(fd)))
    fsync(path)
    assert flushed == [path.stat().st_ino]
    with pytest.raises(FileNotFoundError):
        fsync(tmp_path / "missing")


def test_pid_alive_tells_a_running_process_from_a_finished_one():
    assert pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names no process
    assert not pid_alive(child.pid)


@pytest.mark.skipif(os.name != "posix", reason="signal 0 is POSIX")
def test_pid_alive_counts_no_process_group_and_another_users_process_alive():
    # os.kill(0, 0) and os.kill(-1, 0) succeed (they address process groups): a pid read from an empty lock is none
    assert not pid_alive(0) and not pid_alive(-1)
    # pid 1 is init: root's, so EPERM for anyone else (alive), and alive for root
    assert pid_alive(1)
