"""Resumable multi-stage jobs (demo, study): a stage runs once, then leaves ``<dir>/DONE`` with its wall-clock.
A stage's ``run`` is a command line's ``main`` in this process, or :func:`as_process`: the command line as a process
of its own."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from patchplace.data.atomic import pid_alive


class StageError(RuntimeError):
    """A stage's pipeline returned a non-zero exit code."""


def stage(directory: Path, run: Callable[[list[str]], int], argv: list[str], label: str = "") -> float:
    """Run ``run(argv)`` unless ``directory/DONE`` exists; returns the stage's wall-clock seconds (the recorded ones
    when it was done before). A failing stage leaves no DONE, so the next invocation retries (and resumes). DONE
    records the arguments: a stage done with other arguments (another budget in the same directory) is refused,
    never silently reused."""
    directory.mkdir(parents=True, exist_ok=True)
    done = directory / "DONE"
    name = label or str(directory)
    settings = config_fingerprint(argv)
    if done.is_file():
        record = json.loads(done.read_text())
        if what_it_computes(record.get("argv") or []) != what_it_computes(argv):
            changed = sorted(set(record.get("argv") or ["(not recorded)"]) ^ set(argv))
            raise StageError(f"{name} was done with other arguments (differing: {' '.join(changed[:6])}); remove "
                             f"{directory} to redo it, or write this run elsewhere")
        if record.get("config") not in (None, settings):  # DONE files older than the fingerprint: argv only
            raise StageError(f"{name} was done with other settings in {argv[argv.index('--config') + 1]} (it "
                             f"changed since); remove {directory} to redo it, or write this run elsewhere")
        print(f"[{name}] done before, skipping ({done})")
        return float(record["seconds"])
    with _Lock(directory / "LOCK", name):
        print(f"[{name}] {' '.join(argv)}", flush=True)
        start = time.perf_counter()
        if run(argv) != 0:
            raise StageError(f"{name} failed; fix the error above and run the same command again (it resumes)")
        seconds = time.perf_counter() - start
        record = {"seconds": round(seconds, 1), "argv": list(argv)}
        done.write_text(json.dumps(record | ({"config": settings} if settings else {})))
    return seconds


def as_process(module: str) -> Callable[[list[str]], int]:
    """A stage's ``run``: ``python -m <module> <argv>`` (this interpreter) as a process of its own; returns its exit
    code. Every such stage starts afresh: its own Accelerate state (mixed precision included), memory and CUDA
    context. It trains with this process's torch thread count (``OMP_NUM_THREADS``). The SIGINT / SIGTERM this
    process receives reach it once each (it runs in its own process group; Ctrl-C: a checkpoint at its next step,
    a second Ctrl-C stops it at once, as for the command line run directly), and on Linux it receives SIGTERM when
    this process dies."""
    def run(argv: list[str]) -> int:
        return _run_process([sys.executable, "-m", module, *argv])

    run.__name__ = run.__qualname__ = f"as_process({module!r})"
    return run


def by_precision(module: str) -> Callable[[list[str]], int]:
    """A stage's ``run``: ``<module>.main(argv)`` in this process when the stage trains in float32 (Accelerate keeps
    one mixed precision per process, and every in-process stage keeps the default ``no``), else :func:`as_process`.
    A stage's precision is the last ``run.mixed_precision=`` of its argv, else its ``--config`` file's, else ``no``.
    In-process stages save the start of a Python process and its imports (seconds each, hundreds of stages)."""
    own_process = as_process(module)

    def run(argv: list[str]) -> int:
        if stage_precision(argv) != "no":
            return own_process(argv)
        import importlib

        return importlib.import_module(module).main(list(argv))

    run.__name__ = run.__qualname__ = f"by_precision({module!r})"
    return run


def stage_precision(argv: list[str]) -> str:
    """The precision a stage's command line trains in: its ``run.mixed_precision`` (``auto`` resolved on this
    machine), ``no`` when neither it nor its config sets it."""
    from patchplace.pipelines.config import given_setting
    from patchplace.pipelines.engine.hardware import resolve_precision

    value = given_setting(argv, "run.mixed_precision")
    return "no" if value in (None, "no") else resolve_precision(str(value).strip()).value


def _run_process(command: list[str]) -> int:
    import torch

    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    forward = threading.current_thread() is threading.main_thread()  # signal handlers: the main thread only
    child = subprocess.Popen(command, env=env, start_new_session=forward,
                             preexec_fn=_stop_with_parent if forward and sys.platform == "linux" else None)
    previous: dict[int, object] = {}
    try:
        if forward:
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, lambda signum, frame: child.send_signal(signum))
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if child.poll() is None:  # this process is leaving on an error of its own: the stage goes with it
            child.terminate()
            child.wait()


def _stop_with_parent() -> None:
    """In the stage process before it starts (Linux): SIGTERM when the process that started it dies."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def what_it_computes(argv: list[str]) -> list[str]:
    """``argv`` less ``run.resume=`` / ``run.overwrite=``: how a stage treats its own directory on a retry (resume
    a checkpoint, replace a failed attempt's files), not what it computes."""
    return [a for a in argv if not a.startswith(("run.resume=", "run.overwrite="))]


def config_fingerprint(argv: list[str]) -> str | None:
    """sha256 (16 hex) of the settings in the stage's ``--config`` (a file or a shipped config's name, parsed as
    the command reads it: comments and layout do not count), so that a stage done before the file's settings
    changed is not silently reused; None without ``--config``."""
    from patchplace.pipelines.config import config_path, parse_yaml

    if "--config" not in argv[:-1]:
        return None
    settings = parse_yaml(config_path(argv[argv.index("--config") + 1]).read_text())
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


class _Lock:
    """``directory/LOCK`` holding the pid of the process running the stage; a lock left by a dead process is
    taken over (a killed job resumes), one held by a live process is refused."""

    def __init__(self, path: Path, name: str):
        self.path, self.name = path, name

    def __enter__(self) -> None:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                pid = int(self.path.read_text() or 0)  # empty: its process died between creating and writing it
            except (ValueError, FileNotFoundError):
                pid = 0
            if not pid_alive(pid):
                self.path.unlink(missing_ok=True)  # stale: its process is gone
                return self.__enter__()
            raise StageError(f"{self.name} is being run by process {pid} ({self.path}); wait for it or run "
                             "other groups") from None
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))

    def __exit__(self, *exc) -> None:
        self.path.unlink(missing_ok=True)


def stage_seconds(directory: Path) -> float | None:
    """Recorded wall-clock of a finished stage, None when it has not finished."""
    done = directory / "DONE"
    return float(json.loads(done.read_text())["seconds"]) if done.is_file() else None


def stage_resumed(directory: Path) -> bool:
    """Whether a finished training stage took more than one attempt (its ``log.jsonl`` has the start-ups of several
    processes): its recorded seconds are then the last attempt's only."""
    log = directory / "log.jsonl"
    if not (directory / "DONE").is_file() or not log.is_file():
        return False
    startups = {json.loads(line).get("startup_s") for line in log.read_text().splitlines() if '"startup_s"' in line}
    return len(startups) > 1


def hardware_line() -> str:
    """'<CPU model>, <n> cores, torch <v> (<threads> threads), <GPU or no GPU>' for the head of result tables."""
    import torch

    from patchplace.pipelines.engine.hardware import cpu_info

    cpu = cpu_info().name
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), {gpu}"
