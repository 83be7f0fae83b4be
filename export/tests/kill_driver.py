"""Kill sweep over the export's commit, for ``test_damage.py``:

    python export/tests/kill_driver.py OLD_CHECKPOINT NEW_CHECKPOINT OUT_DIR REPORT.json

Exports OLD_CHECKPOINT to ``OUT_DIR/model.onnx`` (the older pair), then NEW_CHECKPOINT over it once, counting the
Python line events of the commit (:func:`patchplace.export.exporter.write_pair`, the functions it calls in the
export package and in ``patchplace.data.atomic``, and its return). Then, at the first event of every distinct
line: puts the older pair back, forks a child that exports NEW_CHECKPOINT over it and SIGKILLs itself at that event,
asks the evaluator's loader (``OnnxModel``) about the pair left behind, re-runs the export and lists the temporary
directories left. The graph torch.onnx.export
wrote for NEW_CHECKPOINT is reused by the later exports (what is killed here is the commit, not the tracing), so a
kill point takes about a second. One process, ``OMP_NUM_THREADS=1``: the forked children are safe.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import torch

from patchplace.data import atomic
from patchplace.export import ExportError, export_checkpoint, exporter
from patchplace.export.evaluate import OnnxModel
from patchplace.models import load_pretrained

COMMIT = exporter.write_pair.__code__
EXPORT_DIR = str(Path(exporter.__file__).parent)  # the commit's own steps: files.py, pair.py, ...
TRACED_FILES = (atomic.__file__,)  # and the shared fsync


class Killer:
    """``sys.settrace`` tracer: counts the line events of the commit (and its return), SIGKILLs at ``kill_at``."""

    def __init__(self, kill_at: int | None = None) -> None:
        self.kill_at, self.events, self.lines, self.active = kill_at, 0, [], False

    def trace(self, frame, event, arg):
        code = frame.f_code
        if event == "call":
            if code is COMMIT:
                self.active = True
            elif not (self.active and (code.co_filename.startswith(EXPORT_DIR)
                                       or code.co_filename in TRACED_FILES)):
                return None
        if event == "line" or (event == "return" and code is COMMIT):
            self.events += 1
            self.lines.append(f"{code.co_name}:{frame.f_lineno}" + (" return" if event == "return" else ""))
            if self.events == self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            self.active = self.active and not (event == "return" and code is COMMIT)
        return self.trace


def cache_torch_export() -> None:
    """From now on torch.onnx.export runs once and later calls write the same file (one checkpoint is exported)."""
    real, saved = torch.onnx.export, {}

    def cached(module, args, f, **kwargs):
        if "bytes" not in saved:
            real(module, args, f, **kwargs)
            saved["bytes"] = Path(f).read_bytes()
        Path(f).write_bytes(saved["bytes"])

    torch.onnx.export = cached


def verdict(out: Path, models: dict[str, torch.nn.Module]) -> dict:
    """What the evaluator's loader says of the pair at ``out``: refused (its message), or which checkpoint the sidecar
    names and which one the graph computes — "old" / "new" when both agree, "mixed" when they do not."""
    try:
        model = OnnxModel(out)
    except ExportError as exc:
        return {"state": "refused", "message": str(exc)}
    x = torch.randn(3, 1, 32, 32, generator=torch.Generator().manual_seed(0))
    logits = model.run(x)[0]
    with torch.no_grad():
        computes = [name for name, m in models.items() if np.allclose(logits, m(x)[0].numpy(), atol=1e-4)]
    named = model.meta["provenance"]["checkpoint_sha256"]
    names = [name for name, m in models.items() if m.sha256 == named]
    state = names[0] if names == computes and len(names) == 1 else "mixed"
    return {"state": state, "sidecar_names": names, "graph_computes": computes}


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def main(old_ckpt: str, new_ckpt: str, out_dir: str, report: str) -> None:
    torch.set_num_threads(1)
    out, pristine = Path(out_dir) / "model.onnx", Path(out_dir + ".old")
    export_checkpoint(old_ckpt, pristine / "model.onnx", optimize=False)
    models = {}
    for name, ckpt in (("old", old_ckpt), ("new", new_ckpt)):
        models[name] = exporter.Classifier(load_pretrained(ckpt)[0].eval()).eval()
        models[name].sha256 = exporter.sha256_file(Path(ckpt) / "model.safetensors")

    def restore_old() -> None:
        shutil.rmtree(out.parent, ignore_errors=True)
        shutil.copytree(pristine, out.parent)

    cache_torch_export()
    restore_old()
    counter = Killer()
    sys.settrace(counter.trace)
    try:
        export_checkpoint(new_ckpt, out, optimize=False)
    finally:
        sys.settrace(None)
    firsts = {line: n for n, line in reversed(list(enumerate(counter.lines, 1)))}  # each distinct line, once
    points = []
    for kill_at in sorted(firsts.values()):
        restore_old()
        pid = os.fork()
        if pid == 0:  # the child: export, dying at event kill_at of the commit
            sys.settrace(Killer(kill_at).trace)
            try:
                export_checkpoint(new_ckpt, out, optimize=False)
            finally:
                os._exit(3)
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        point = {"event": kill_at, "line": counter.lines[kill_at - 1], "killed": killed,
                 "after_kill": verdict(out, models), "left_by_kill": leftovers(out)}
        export_checkpoint(new_ckpt, out, optimize=False)  # the re-run
        point.update(rerun=verdict(out, models), leftovers=leftovers(out))
        points.append(point)
    lines = {f"{COMMIT.co_name}:{n}" for _, _, n in COMMIT.co_lines() if n and n != COMMIT.co_firstlineno}
    executed = set(counter.lines)
    result = {"events": counter.events, "distinct": len(firsts), "commit_lines": sorted(lines & executed),
              "never_executed": sorted(lines - executed), "points": points}
    Path(report).write_text(json.dumps(result, indent=2) + "\n")

if __name__ == "__main__":
    main(*sys.argv[1:])
