"""The stage lock (pipelines/stages.py): a LOCK left by a dead process, or empty (its process died between creating
and writing it), is taken over; one held by a live process is refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from patchplace.pipelines.stages import StageError, _Lock


@pytest.mark.parametrize("left", ["", "not a pid", "dead"])
def test_a_stale_or_empty_lock_is_taken_over(tmp_path, left):
    if left == "dead":
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait()
        left = str(child.pid)
    lock = tmp_path / "LOCK"
    lock.write_text(left)
    with _Lock(lock, "stage"):
        assert lock.read_text() == str(os.getpid())
    assert not lock.exists()


def test_a_lock_held_by_a_live_process_is_refused(tmp_path):
    lock = tmp_path / "LOCK"
    lock.write_text(str(os.getppid()))
    with pytest.raises(StageError, match="being run by process"), _Lock(lock, "stage"):
        pass
    assert lock.read_text() == str(os.getppid())
