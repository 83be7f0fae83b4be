"""Fault injection for ``test_faults.py``: kills, signals and write failures at chosen instants of a real
``pipelines/pretrain.py`` run (one process, ``OMP_NUM_THREADS=1``, so forked children are safe and runs are exact).

    python tests/fault_driver.py kills REPORT.json OUT_DIR SEED COUNT -- <pretrain arguments>
        Runs the arguments straight once, counts the Python line events of every checkpoint save (the kill points),
        then, for COUNT kill points drawn with SEED (half among the lines of engine/protocol.py, the checkpoint protocol
        itself, half among all of them), has a child SIGKILL itself at that line of that save, resumes the killed run
        with run.resume=true, and records whether it resumed, from which step, whether its final weights equal the
        straight run's, and what stray files were left after the resume's saves. The children are forked from one
        run paused as each save with kill points begins (:func:`sweep`): a kill costs that save's traced part and the
        resume, not a process start or the steps before it.
    python tests/fault_driver.py signal SIGNAME STEP -- <pretrain arguments>
        Sends SIGNAME to itself when the run reaches optimizer step STEP (a real signal, delivered mid-training).
    python tests/fault_driver.py fsize BYTES STEP -- <pretrain arguments>
        From the checkpoint of step STEP on, no file may grow beyond BYTES (RLIMIT_FSIZE): writes fail like on a
        full disk.
    python tests/fault_driver.py logfull STEP -- <pretrain arguments>
        At the log record of step STEP, log.jsonl may grow by 10 bytes only: that record is torn, as by a full disk.
    python tests/fault_driver.py nan STEP -- <pretrain arguments>
        The inputs of optimizer step STEP are NaN (so is its loss).

``kills`` runs ``pipelines/finetune.py`` instead when the arguments start with ``finetune``, and with KILL_SAVE=last
kills only in the run's last save (the one that seals the end-of-run metrics). In-process tests stop a run at a
given step as a user does, with :func:`sigterm_at`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import resource
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from safetensors.torch import load_file

from patchplace.data import atomic
from patchplace.pipelines import (
    engine,
    finetune,
    pretrain,
)
from patchplace.pipelines.engine import protocol

ROOT = Path(__file__).resolve().parents[1]

RUNDIR_FILE = str(Path(protocol.__file__).resolve())
# the protocol's lines: engine/protocol.py and the folder swap it calls (patchplace.data.atomic.swap_dir)
PROTOCOL_FILES = {RUNDIR_FILE, str(Path(atomic.__file__).resolve())}


class Pausing:
    """What a tracer needs to serve the kills of :func:`sweep`: ``pauses`` (call number -> the kill points in it,
    numbered), and ``kill_at`` (call number, line event), where a forked child SIGKILLs itself."""

    def __init__(self) -> None:
        self.kill_at: tuple[int, int] | None = None
        self.pauses: dict[int, list[tuple[int, tuple[int, int]]]] = {}
        self.channel: tuple[int, int] = (-1, -1)  # (to the driver, from the driver)
        self.rundir = Path()

    def start(self) -> None:
        """Forget the calls counted so far: the sweep's run counts its own from its start."""

    def pause(self, index: int) -> None:
        """At the start of call ``index`` of the sweep's run, before it is traced: for each kill point in it, put the
        run directory back as it is now, fork a child that goes on from here and SIGKILLs itself at that point, hand
        its wait status to the driver and wait while the driver resumes the killed run in that directory. Then the
        run goes on (the directory put back again) to its next pause, or ends after the last one."""
        here = self.pauses.pop(index, None)
        if here is None:
            return
        pristine = self.rundir.with_name(f"{self.rundir.name}-pristine")
        shutil.copytree(self.rundir, pristine, symlinks=True)
        for n, point in here:
            restore(pristine, self.rundir)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the killed run: this one, from this instant on, with its kill point
                self.kill_at, self.pauses = point, {}
                return
            _, status = os.waitpid(pid, 0)
            os.write(self.channel[0], f"{n} {status}\n".encode())
            if os.read(self.channel[1], 1) != b"+":  # the driver ended
                os._exit(3)
        if not self.pauses:
            os._exit(0)
        restore(pristine, self.rundir)
        shutil.rmtree(pristine)


def restore(pristine: Path, rundir: Path) -> None:
    """``rundir`` made a copy of ``pristine`` (the paused run's own lock then stays on the file it replaced, so a
    resume can take the lock of the copy, as it takes a killed run's)."""
    shutil.rmtree(rundir, ignore_errors=True)
    shutil.copytree(pristine, rundir, symlinks=True)


def sweep(tracer: Pausing, points: list[tuple[int, int]], rundir: Path, run: Callable[[], int],
          check: Callable[[int, int], None]) -> None:
    """The kill of every ``(call, event)`` in ``points``, each from a warm run at the instant the call begins: ``run``
    (the run, writing to ``rundir``) goes on in a forked process that pauses at each call holding kill points
    (:meth:`Pausing.pause`), so a killed run repeats neither the process start nor the steps before that call.
    ``check(n, wait_status)`` runs here for kill number ``n`` with the killed run in ``rundir`` (it resumes it there,
    then moves it away)."""
    pauses: dict[int, list[tuple[int, tuple[int, int]]]] = {}
    for n, point in enumerate(points):
        pauses.setdefault(point[0], []).append((n, point))
    up_read, up_write = os.pipe()
    down_read, down_write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the paused run
        os.close(up_read)
        os.close(down_write)
        tracer.kill_at, tracer.pauses, tracer.channel, tracer.rundir = None, pauses, (up_write, down_read), rundir
        tracer.start()
        os._exit(10 + run())  # reached only when the run ends before its last pause
    os.close(up_write)
    os.close(down_read)
    served, pending = [], b""
    try:
        while chunk := os.read(up_read, 64):
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                n, status = map(int, line.split())
                check(n, status)
                served.append(n)
                os.write(down_write, b"+")
    finally:
        os.close(up_read)
        os.close(down_write)
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"the paused run ended with wait status {status}"
    assert sorted(served) == list(range(len(points))), f"kills served: {sorted(served)} of {len(points)}"


class LineCounter(Pausing):
    """``sys.settrace`` tracer that counts line events (and notes which ones are in engine/protocol.py); at event number
    ``kill_at`` of save number ``save_index`` it SIGKILLs the process. With ``counting`` every save is traced (the run
    that finds the kill points); without, only the save of ``kill_at`` is (a save's events are counted from its own
    start, so the others and a resume's run untraced)."""

    def __init__(self, kill_at: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.kill_at = kill_at
        self.counting = True
        self.saves: list[dict] = []  # per save: {"step", "events", "rundir_events": [indices]}

    def start(self) -> None:
        self.saves = []

    def trace(self, frame, event, arg):
        if event == "line":
            save = self.saves[-1]
            save["events"] += 1
            if frame.f_code.co_filename in PROTOCOL_FILES:
                save["rundir_events"].append(save["events"])
                save["rundir_lines"].setdefault(f"{frame.f_code.co_name}:{frame.f_lineno}", save["events"])
            if self.kill_at == (len(self.saves) - 1, save["events"]):
                os.kill(os.getpid(), signal.SIGKILL)
        return self.trace

    def install(self) -> None:
        save = engine.Trainer.save_checkpoint
        counter = self

        def traced_save(trainer, step, **kwargs):
            counter.saves.append({"step": step, "events": 0, "rundir_events": [], "rundir_lines": {}})
            index = len(counter.saves) - 1
            counter.pause(index)
            if not counter.counting and (counter.kill_at is None or counter.kill_at[0] != index):
                return save(trainer, step, **kwargs)
            sys.settrace(counter.trace)
            try:
                return save(trainer, step, **kwargs)
            finally:
                sys.settrace(None)

        engine.Trainer.save_checkpoint = traced_save


def output_of(args: list[str]) -> Path:
    return Path(next(a.split("=", 1)[1] for a in args if a.startswith("run.output=")))


def with_output(args: list[str], out: Path) -> list[str]:
    return [a for a in args if not a.startswith("run.output=")] + [f"run.output={out}"]


def weights(out: Path) -> dict:
    return {name: load_file(str(out / "checkpoint" / name)) for name in ("model.safetensors", "objective.safetensors")
            if (out / "checkpoint" / name).is_file()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        x.keys() == y.keys() and all((x[k] == y[k]).all() for k in x) for x, y in ((a[n], b[n]) for n in a))


def strays(out: Path) -> list[str]:
    """What a finished run directory should not hold: partial / trash / temp entries, or more than one step."""
    names = [p.name for p in out.iterdir() if p.name.startswith(".") and p.name != ".lock"]
    root = out / "checkpoints"
    inside = [p.name for p in root.iterdir()] if root.is_dir() else []
    return names + [n for n in inside if not n.startswith("step-")] + (inside[1:] if len(inside) > 1 else [])


def kills(report: Path, base: Path, seed: int, count: int, args: list[str]) -> None:
    script = pretrain
    if args and args[0] in ("pretrain", "finetune"):
        script, args = (finetune if args[0] == "finetune" else pretrain), args[1:]
    straight = base / "straight"
    counter = LineCounter()
    counter.install()
    resumed: list[int] = []
    resume_step = engine.RunDir.resume_step
    engine.RunDir.resume_step = lambda rundir: resumed.append(resume_step(rundir)) or resumed[-1]
    assert script.main(with_output(args, straight)) == 0
    # Count on a second straight run: the first one also ran one-time work (lazy imports, first-call caches) that
    # the forked children, started from this warmed-up process, will not repeat.
    counter.saves = []
    assert script.main(with_output(args, base / "counted")) == 0
    assert same(weights(straight), weights(base / "counted"))
    saves = [dict(s) for s in counter.saves]
    # Every distinct line of the checkpoint protocol (engine/protocol.py) in a save that has a previous checkpoint to
    # lose, then COUNT random points: alternately a line of the protocol and any line of the save path, in any save.
    middle = len(saves) - 1 if os.environ.get("KILL_SAVE") == "last" else len(saves) // 2
    points = [(middle, event) for event in sorted(saves[middle]["rundir_lines"].values())]
    rng = random.Random(seed)
    for i in range(count):
        save = middle if os.environ.get("KILL_SAVE") == "last" else rng.randrange(len(saves))
        pool = saves[save]["rundir_events"] if i % 2 == 0 else range(1, saves[save]["events"] + 1)
        points.append((save, rng.choice(list(pool))))
    # The further resume of a finished run (it must accept its own files): after every kill in the last save, where
    # the end-of-run metrics are sealed and the kill decides what the resume finds; elsewhere at every 4th kill, as
    # that resume is then one code path whatever the kill.
    every = 1 if os.environ.get("KILL_SAVE") == "last" else 4
    counter.counting = False
    out = base / "killed"
    results: dict[int, dict] = {}

    def check(n: int, status: int) -> None:
        point = points[n]
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir()) if (out / "checkpoints").is_dir() else []
        counter.kill_at, counter.saves = None, []
        code = script.main([*with_output(args, out), "run.resume=true"])
        resumed_from = resumed[-1]
        again = script.main([*with_output(args, out), "run.resume=true"]) if n % every == 0 else None
        log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
        steps = [r["step"] for r in log if "loss" in r]
        results[n] = {"save": point[0], "save_step": saves[point[0]]["step"], "line": point[1], "killed": killed,
                      "left": checkpoints, "resume_code": code, "resumed_from": resumed_from,
                      "again_code": again, "metrics": sealed_metrics(out),
                      "same_weights": code == 0 and same(weights(straight), weights(out)),
                      "steps_logged_once": steps == sorted(set(steps)), "strays": strays(out)}
        out.rename(base / f"kill{n}")  # kept to look at; the next kill starts from the paused run's copy

    sweep(counter, points, out, lambda: script.main(with_output(args, out)), check)
    report.write_text(json.dumps({"saves": [{"step": s["step"], "events": s["events"],
                                             "rundir_events": len(s["rundir_events"]),
                                             "rundir_lines": len(s["rundir_lines"])} for s in saves],
                                  "kills": [results[n] for n in sorted(results)]}, indent=1))


def sealed_metrics(out: Path) -> dict | None:
    """The metrics in the final checkpoint's config.json, after checking the checkpoint against its seal."""
    if not (out / "checkpoint").exists():
        return None
    protocol.verify((out / "checkpoint").resolve().parent)
    return json.loads((out / "checkpoint" / "config.json").read_text())["metadata"].get("metrics")


def log_full(step: int, args: list[str]) -> int:
    write = engine.JsonlLog.write

    def limited_write(log, record):
        if record.get("step") == step and "loss" in record:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
            resource.setrlimit(resource.RLIMIT_FSIZE, (log.path.stat().st_size + 10, resource.RLIM_INFINITY))
        return write(log, record)

    engine.JsonlLog.write = limited_write
    return pretrain.main(args)


def nan_at(step: int, args: list[str]) -> int:
    inputs = engine.Trainer._inputs
    seen = [0]

    def poisoned(self, batch):
        seen[0] += 1
        x, y = inputs(self, batch)
        return (x * float("nan"), y) if seen[0] == step else (x, y)

    engine.Trainer._inputs = poisoned
    return pretrain.main(args)


@contextlib.contextmanager
def sigterm_at(step: int):
    """Within the block, a run in this process gets SIGTERM during optimizer step ``step`` (counted from the run's
    start, resumed runs included), as from a user's ``kill``: it finishes that step, saves it and exits 143."""
    train_step = engine.Trainer.train_step
    sent = []

    def signalled(trainer, batch, done):
        if done + 1 == step and not sent:  # once: a second SIGTERM would end the process at once
            sent.append(step)
            os.kill(os.getpid(), signal.SIGTERM)
        return train_step(trainer, batch, done)

    engine.Trainer.train_step = signalled
    try:
        yield
    finally:
        engine.Trainer.train_step = train_step


def signal_at(name: str, step: int, args: list[str]) -> int:
    inputs = engine.Trainer._inputs
    seen = [0]

    def traced_inputs(self, batch):
        seen[0] += 1
        if seen[0] == step:  # during step `step`: the run stops after finishing it
            os.kill(os.getpid(), getattr(signal, name))
        return inputs(self, batch)

    engine.Trainer._inputs = traced_inputs
    return pretrain.main(args)


def file_size_limit(limit: int, step: int, args: list[str]) -> int:
    save = engine.Trainer.save_checkpoint

    def limited_save(trainer, at, **kwargs):
        if at >= step:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        return save(trainer, at, **kwargs)

    engine.Trainer.save_checkpoint = limited_save
    return pretrain.main(args)


def main() -> int:
    split = sys.argv.index("--")
    mode, *params = sys.argv[1:split]
    args = sys.argv[split + 1:]
    if mode == "kills":
        kills(Path(params[0]), Path(params[1]), int(params[2]), int(params[3]), args)
        return 0
    if mode == "signal":
        return signal_at(params[0], int(params[1]), args)
    if mode == "fsize":
        return file_size_limit(int(params[0]), int(params[1]), args)
    if mode == "logfull":
        return log_full(int(params[0]), args)
    if mode == "nan":
        return nan_at(int(params[0]), args)
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    sys.exit(main())
