"""Learning-curve snapshots (``run.keep_epochs``) and early stopping (``run.early_stop_patience``) under kills, for
``test_snapshots_early_stop.py``. The pipeline is ``pipelines/pretrain.py`` with an ``evaluate`` callback that
reports a scripted top-1 per step (:func:`scripted_main`), so where the run stops is known in advance.

    python tests/curve_driver.py kills REPORT.json BASE_DIR SEED COUNT SWEEP -- <pretrain arguments>
        Runs the arguments straight, then once more counting the Python line events of every snapshot, best/ and
        checkpoint write and every optimizer step (the kill points). For each kill point (SWEEP, a comma list of:
        step: as each optimizer step begins; best / snapshot: every distinct line of ``engine/protocol.py`` in the last
        write of that kind, which nothing rewrites later; then COUNT more drawn with SEED among all events of every
        write), has a child SIGKILL itself there, resumes the killed run with run.resume=true (then, at every 4th
        kill, once more: a finished run is complete), and records whether every snapshot, best/, the final weights
        and the early stop equal the straight run's. The children are forked from one run paused as each call with
        kill points begins (``fault_driver.sweep``): a kill costs that call's traced part and the resume, not a
        process start or the steps before it.

Run with ``OMP_NUM_THREADS=1`` (forked children are safe and runs exact).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import fault_driver
from safetensors import safe_open

from patchplace.data import atomic
from patchplace.pipelines import (
    engine,
    pretrain,
)
from patchplace.pipelines.engine import protocol

ROOT = Path(__file__).resolve().parents[1]

RUNDIR_FILE = str(Path(protocol.__file__).resolve())
# the protocol's lines: engine/protocol.py and the folder swap it calls (patchplace.data.atomic.swap_dir)
PROTOCOL_FILES = {RUNDIR_FILE, str(Path(atomic.__file__).resolve())}
# top-1 by step: bests at 2, 4 and 8; 10, 12 (a tie is no better) and 14 are not: patience 3 stops at step 14
SCRIPT = {2: 0.30, 4: 0.50, 6: 0.45, 8: 0.55, 10: 0.52, 12: 0.55, 14: 0.54, 16: 0.60}


def scripted_main(argv: list[str], script: dict[int, float] | None = None) -> int:
    """``pretrain.main`` with an evaluation that reports ``script[step]`` as top-1 (None: no evaluation)."""
    try:
        cfg, accelerator, data = engine.start(pretrain.PretrainConfig, pretrain.__doc__, argv)
        m = data.manifest
        objective, backbone = pretrain.build_objective(cfg, m.num_classes, int(m.info.get("channels", 1)),
                                                       m.modality, data)
        evaluate = None if script is None else (lambda model, step: {"top1": script.get(step, 0.0), "count": 32})
        trainer = engine.Trainer(accelerator, objective, backbone, data, cfg.optim, cfg.run, config=cfg,
                                 metadata={"method": cfg.method, **engine.data_metadata(data, cfg.data)},
                                 evaluate=evaluate, command="scripted")
    except engine.USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return trainer.train(cfg.data.batch_size)[1]


def folder_files(folder: Path) -> dict[str, object]:
    """Every file of a backbone folder, to compare bit for bit: the bytes, or for a safetensors file its header
    metadata and each tensor's dtype, shape and bytes (safetensors writes its header's keys in no fixed order)."""
    return {str(p.relative_to(folder)): tensors(p) if p.suffix == ".safetensors" else p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def tensors(path: Path) -> dict[str, object]:
    with safe_open(str(path), "pt") as f:
        return {"metadata": f.metadata(), **{k: (str(t.dtype), tuple(t.shape), t.numpy().tobytes())
                                            for k in sorted(f.keys()) for t in [f.get_tensor(k)]}}


def outcome(out: Path) -> dict:
    """What a finished run must reproduce: every snapshot and best/ (bytes of every file), the final weights, the
    early stop record and the logged steps."""
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    snapshots = out / "snapshots"
    return {"snapshots": {p.name: folder_files(p) for p in sorted(snapshots.iterdir())} if snapshots.is_dir() else {},
            "best": folder_files(out / "best") if (out / "best").is_dir() else {},
            "weights": tensors(out / "checkpoint" / "model.safetensors"),
            "early_stop": [r for r in log if "early_stop" in r],
            "steps": [r["step"] for r in log if "loss" in r],
            "snapshot_records": [r for r in log if "snapshot" in r]}


def strays(out: Path) -> list[str]:
    """Leftovers of an interrupted write: partial / replaced folders, partial or trashed checkpoints."""
    found = [p.name for d in (out, out / "snapshots") if d.is_dir() for p in d.iterdir()
             if p.name.startswith((".partial-", ".replaced-", ".trash-"))]
    root = out / "checkpoints"
    inside = [p.name for p in root.iterdir()] if root.is_dir() else []
    return found + [n for n in inside if not n.startswith("step-")] + (inside[1:] if len(inside) > 1 else [])


# the traced methods (the Trainer's and its callbacks') and the kind of kill point each is
TRACED = {(engine.KeepEpochs, "snapshot"): "snapshot", (engine.KeepBest, "save_best"): "best",
          (engine.Trainer, "save_checkpoint"): "checkpoint", (engine.Trainer, "_inputs"): "step"}


class Killer(fault_driver.Pausing):
    """Counts the line events of each traced call (snapshot, best/, checkpoint writes and optimizer steps) and
    SIGKILLs the process at event ``kill_at = (call index, event index)``. With ``counting`` every call is traced (the
    run that finds the kill points); without, only the call of ``kill_at`` is (a call's events are counted from its
    own start, so the others and a resume's run untraced)."""

    def __init__(self) -> None:
        super().__init__()
        self.counting = True
        self.inside = False
        self.calls: list[dict] = []

    def start(self) -> None:
        self.calls = []

    def trace(self, frame, event, arg):
        if event == "line":
            call = self.calls[-1]
            call["events"] += 1
            if frame.f_code.co_filename in PROTOCOL_FILES:
                call["rundir_lines"].setdefault(f"{frame.f_code.co_name}:{frame.f_lineno}", call["events"])
            if self.kill_at == (len(self.calls) - 1, call["events"]):
                os.kill(os.getpid(), signal.SIGKILL)
        return self.trace

    def wrap(self, owner: type, name: str, kind: str) -> None:
        original: Callable = getattr(owner, name)
        killer = self

        def traced(instance, *args, **kwargs):
            if killer.inside:  # nested (a best/ write inside a checkpoint's call): counted there
                return original(instance, *args, **kwargs)
            killer.calls.append({"kind": kind, "events": 0, "rundir_lines": {}})
            index = len(killer.calls) - 1
            killer.pause(index)
            killer.inside = True
            if killer.counting or (killer.kill_at is not None and killer.kill_at[0] == index):
                sys.settrace(killer.trace)
            try:
                return original(instance, *args, **kwargs)
            finally:
                sys.settrace(None)
                killer.inside = False

        setattr(owner, name, traced)

    def install(self) -> None:
        for (owner, name), kind in TRACED.items():
            self.wrap(owner, name, kind)


def with_output(args: list[str], out: Path) -> list[str]:
    return [a for a in args if not a.startswith("run.output=")] + [f"run.output={out}"]


def kills(report: Path, base: Path, seed: int, count: int, sweep: list[str], args: list[str]) -> None:
    straight = base / "straight"
    assert scripted_main(with_output(args, straight), SCRIPT) == 0
    expected = outcome(straight)
    killer = Killer()
    killer.install()
    assert scripted_main(with_output(args, base / "counted"), SCRIPT) == 0  # warm: the children repeat no set-up
    calls = [dict(c) for c in killer.calls]
    points = [(i, 1) for i, c in enumerate(calls) if c["kind"] == "step" and "step" in sweep]  # as a step begins
    for kind in [k for k in sweep if k in ("best", "snapshot")]:  # every protocol line of the kind's last write
        index = [i for i, c in enumerate(calls) if c["kind"] == kind][-1]
        points += [(index, event) for event in sorted(calls[index]["rundir_lines"].values())]
    rng = random.Random(seed)
    writes = [i for i, c in enumerate(calls) if c["kind"] != "step"]
    for _ in range(count):
        index = rng.choice(writes)
        points.append((index, rng.randrange(1, calls[index]["events"] + 1)))
    killer.counting = False
    out = base / "killed"
    results: dict[int, dict] = {}

    def check(n: int, status: int) -> None:
        point = points[n]
        killer.kill_at, killer.calls = None, []
        code = scripted_main([*with_output(args, out), "run.resume=true"], SCRIPT)
        # a further resume of a finished run is one code path whatever the kill: checked at every 4th point
        again = scripted_main([*with_output(args, out), "run.resume=true"], SCRIPT) if n % 4 == 0 else 0
        got = outcome(out) if code == 0 else {}
        results[n] = {"kind": calls[point[0]]["kind"], "point": point,
                      "killed": os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL,
                      "resume_code": code, "again_code": again,
                      "differs": sorted(k for k in expected if got.get(k) != expected[k]),
                      "steps_logged_once": got.get("steps") == sorted(set(got.get("steps", []))),
                      "strays": strays(out)}
        out.rename(base / f"kill{n}")  # kept to look at; the next kill starts from the paused run's copy

    fault_driver.sweep(killer, points, out, lambda: scripted_main(with_output(args, out), SCRIPT), check)
    report.write_text(json.dumps({"calls": [{"kind": c["kind"], "events": c["events"]} for c in calls],
                                  "expected": {"steps": expected["steps"], "early_stop": expected["early_stop"],
                                               "snapshots": sorted(expected["snapshots"])},
                                  "kills": [results[n] for n in sorted(results)]}, indent=1))


def main() -> int:
    split = sys.argv.index("--")
    mode, *params = sys.argv[1:split]
    if mode != "kills":
        raise SystemExit(f"unknown mode {mode}")
    kills(Path(params[0]), Path(params[1]), int(params[2]), int(params[3]), params[4].split(","),
          sys.argv[split + 1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
