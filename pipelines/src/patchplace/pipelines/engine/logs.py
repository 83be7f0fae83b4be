"""What a run writes as it goes: the JSON-lines log (:class:`JsonlLog`; read back, and cut back on resume), the
per-step throughput record (:class:`Throughput`), lines printed clear of the progress bar, and the command line a
resume hint repeats."""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from patchplace.data.atomic import atomic_file


def say(text: str, file: Any = None) -> None:
    """Print a line clear of the progress bars (``tqdm.write``: the Trainer's bar is cleared, the line printed,
    the bar drawn again below it), flushed; ``file``: default stdout. For what prints while a bar runs, e.g. the
    ``evaluate`` callbacks a pipeline hands the :class:`Trainer`."""
    stream = sys.stdout if file is None else file
    tqdm.write(text, file=stream)
    stream.flush()


class Console:
    """The main process's lines during a training, clear of the Trainer's progress bar once it runs (``bar``)."""

    def __init__(self, main: bool) -> None:
        self.main = main
        self.bar: tqdm | None = None

    def print(self, text: str) -> None:
        if self.main:
            (self.bar.write if self.bar is not None else print)(text)


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


class Throughput:
    """The throughput a training step's log record reports: samples/s and the share of the time spent waiting for
    data (``data_share``), measured from the end of this session's first step; what came before it (reading the
    data from ``started`` on, building the model, spawning workers, that first step) is ``startup_s``."""

    def __init__(self, started: float) -> None:
        self.started = started  # when reading the data began
        self.start = self.fetch = time.perf_counter()
        self.startup = self.waited = 0.0
        self.samples = 0  # samples this process trained on since ``start`` (a last batch may be short)

    def waiting(self) -> None:
        """The loop waits for its next batch from now on (logging, checkpoints and evaluation are not data time)."""
        self.fetch = time.perf_counter()

    def arrived(self, samples: int) -> None:
        """A batch of ``samples`` arrived."""
        self.samples += samples
        self.waited += time.perf_counter() - self.fetch

    def first_step_done(self) -> None:
        """The session's first optimizer step ended: the rates count from here."""
        self.start = time.perf_counter()
        self.waited, self.samples = 0.0, 0
        self.startup = self.start - self.started

    def record(self, processes: int) -> dict[str, float]:
        """``startup_s``, and from the second step of the session on ``data_share`` and ``samples_per_s`` over
        ``processes`` (every rank reads as many samples)."""
        elapsed = time.perf_counter() - self.start
        seen = self.samples * processes
        found = {"startup_s": round(self.startup, 2)}
        if seen:
            found.update(data_share=round(self.waited / elapsed, 4), samples_per_s=round(seen / elapsed, 1))
        return found


# ---------------------------------------------------------------------------------------------- experiment trackers
def trackers(run: Any) -> list[str]:
    """Every experiment tracker a run logs train/* and val/* to: TensorBoard (``run.tensorboard``) first, then
    ``run.log_with`` (an evaluation's run section has neither: none)."""
    return list(dict.fromkeys([*(["tensorboard"] if run.tensorboard else []), *getattr(run, "log_with", ())]))


def accelerator_log_with(run: Any) -> Any:
    """``Accelerator(log_with=...)`` for ``run``: None, "tensorboard" alone as ever, or with other trackers a
    TensorBoard tracker of its own, so that its events stay in output/tensorboard/ while the others take
    ``run.log_project`` as their project (Accelerate names both after one ``init_trackers`` argument)."""
    names = trackers(run)
    if not names or names == ["tensorboard"]:
        return names[0] if names else None
    from accelerate.tracking import TensorBoardTracker  # it opens its writer in start(): on the main process

    return [TensorBoardTracker("tensorboard", run.output) if n == "tensorboard" else n for n in names]


def tracker_project(run: Any) -> str:
    """The ``init_trackers`` project: "tensorboard" for TensorBoard alone (output/tensorboard/), else
    ``run.log_project``."""
    return "tensorboard" if trackers(run) == ["tensorboard"] else run.log_project


class StepLog:
    """A training step's record in log.jsonl (and the trackers' train/*): the objective's scalars averaged over
    ranks, the lr the step trained with (groups carry it x their layer-decay lr_scale), the epoch, the weight decay
    under a schedule of it, the throughput (``meter``), the shards data.skip_corrupt skipped; the bar's loss."""

    def __init__(self, acc: Any, log: JsonlLog, run: Any, data: Any, meter: Throughput, bar: tqdm,
                 decaying: Any | None) -> None:
        self.acc, self.log, self.run, self.data, self.meter, self.bar = acc, log, run, data, meter, bar
        self.decaying = decaying  # the optimizer whose weight decay follows optim.weight_decay_end, else None

    def write(self, step: int, epoch: int, out: dict[str, Any], lr: float) -> None:
        acc = self.acc
        scalars = {k: float(acc.reduce(v.detach().float(), "mean")) for k, v in out.items()
                   if torch.is_tensor(v) and v.numel() == 1}
        scalars.update(lr=lr, epoch=epoch)
        if self.decaying is not None:  # the weight decay the decaying groups trained with
            scalars["wd"] = max(group["weight_decay"] for group in self.decaying.param_groups)
        scalars.update(self.meter.record(acc.num_processes))
        if self.data.train.skipped:  # data.skip_corrupt (counted in this process; workers warn)
            scalars["skipped_shards"] = len(set(self.data.train.skipped))
        self.log.write({"step": step, **scalars, "world_size": acc.num_processes, "data": self.data.path})
        if trackers(self.run):  # namespaced as TensorBoard groups them: train/loss, train/lr, ...
            acc.log({f"train/{k}": v for k, v in scalars.items()}, step=step)
        self.bar.set_postfix(loss=f"{scalars['loss']:.4f}")
