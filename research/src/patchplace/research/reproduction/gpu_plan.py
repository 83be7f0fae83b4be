"""The GPU's ordered plan (``research/gpu/plan.txt``): one device command per line, each at most 9 minutes with its
expected minutes (``# ~N min``), and which are done, read from ``results/`` alone. Whenever a GPU is at hand, the
first line not done runs before anything else:

    python -m patchplace.research.reproduction.gpu_plan status   every line, done or not, and the next one
    python -m patchplace.research.reproduction.gpu_plan next     the command a lent GPU runs next

A line is done when every step of its ``gpu_evidence.sh`` command is (:func:`step_done`): ``table2`` when
``results/benchmark_mp3_table2.json`` holds GPU rows of both attention kernels; ``speed:M,...`` when
``results/benchmark_speed.json`` holds a GPU row of each method; ``profile:O,...`` when
``results/benchmark_profile.json`` holds a GPU row of each objective; ``position4px:W`` when every unit of waves
1..W has its bundle in ``results/study_v5_gpu4px_bundles`` (less the rows the stopping rule took out);
``onnx-prepare`` / ``onnx`` when ``results/onnx_cuda.json`` exists.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PLAN = Path(__file__).resolve().parents[5] / "research" / "gpu" / "plan.txt"
MAX_MINUTES = 9.0  # a lent command has 10 minutes, start-up included
GPU4PX = "pipelines/configs/study_v5_gpu4px.yaml"
BUNDLES4PX = "study_v5_gpu4px_bundles"


class PlanError(ValueError):
    """A plan file that is not one (the message is the one line a user sees)."""


@dataclass(frozen=True)
class Line:
    number: int
    command: str
    minutes: float
    note: str

    @property
    def steps(self) -> list[str]:
        return self.command.split()[2:]  # bash research/gpu/gpu_evidence.sh STEP ...


def read_plan(path: Path = PLAN) -> list[Line]:
    """The plan's lines in order; a line without its expected minutes, over :data:`MAX_MINUTES`, or not a
    ``gpu_evidence.sh`` command is a :class:`PlanError`."""
    lines = []
    for number, text in enumerate(Path(path).read_text().splitlines(), 1):
        if not text.strip():
            continue
        command, _, comment = text.partition("#")
        found = re.search(r"~(\d+(?:\.\d+)?) min", comment)
        if not command.strip().startswith("bash research/gpu/gpu_evidence.sh ") or not found:
            raise PlanError(f"{path}:{number}: not 'bash research/gpu/gpu_evidence.sh STEP ...  # ~N min': {text}")
        minutes = float(found.group(1))
        if minutes > MAX_MINUTES:
            raise PlanError(f"{path}:{number}: ~{minutes:g} min is over a command's {MAX_MINUTES:g}; split it")
        lines.append(Line(number, command.strip(), minutes, comment.strip()))
    return lines


def _rows(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    rows = data.get("results") if isinstance(data, dict) else None
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def _on_gpu(row: dict[str, Any]) -> bool:
    return str(row.get("device", "")).startswith("cuda")


def position4px_done(results: Path, wave: int, config: str = GPU4PX) -> bool:
    """Every unit of waves 1..``wave`` has its bundle (the rows the stopping rule took out need none)."""
    from patchplace.pipelines.config import load
    from patchplace.research.reproduction.plan import StudyConfig
    from patchplace.research.reproduction.protocol import load_protocol
    from patchplace.research.reproduction.sittings import unit_id
    from patchplace.research.reproduction.waves import SIZING, wave_units, with_sizing

    bundles = results / BUNDLES4PX
    sized = json.loads((bundles / SIZING).read_text()) if (bundles / SIZING).is_file() else None
    if not sized:
        return False
    cfg = with_sizing(load(StudyConfig, config, []), bundles)
    gpu = load_protocol(cfg.protocol).data["gpu"]
    stopped = {r for g in (sized.get("stop") or {}).values() for r in g["rows_stopped"]}
    units = [u for w in range(1, wave + 1) for u in wave_units(cfg, gpu, w, stopped)]
    return all((bundles / f"{unit_id(u.groups, u.seed, u.only)}.json").is_file() for u in units)


def step_done(step: str, results: Path) -> bool:
    """Whether ``results`` shows one ``gpu_evidence.sh`` step done (see the module)."""
    name, _, arg = step.partition(":")
    if name == "table2":
        rows = [r for r in _rows(results / "benchmark_mp3_table2.json") if _on_gpu(r)]
        return {"sdpa", "math"} <= {r.get("kernel") for r in rows}
    if name == "speed":
        rows = [r for r in _rows(results / "benchmark_speed.json") if _on_gpu(r)]
        return all(any(r.get("name") == f"speed/{m}" for r in rows) for m in arg.split(","))
    if name == "profile":
        rows = [r for r in _rows(results / "benchmark_profile.json") if _on_gpu(r)]
        return all(any(r.get("name") == f"profile/{o}" for r in rows) for o in arg.split(","))
    if name == "position4px":
        return position4px_done(results, int(arg))
    if name in ("onnx-prepare", "onnx"):
        return (results / "onnx_cuda.json").is_file()
    raise PlanError(f"plan step {step!r}: no rule says when it is done (table2, speed:M,..., profile:O,..., "
                    "position4px:W, onnx-prepare, onnx)")


def status(results: Path, path: Path = PLAN) -> list[tuple[Line, bool]]:
    return [(line, all(step_done(s, results) for s in line.steps)) for line in read_plan(path)]


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    from patchplace.pipelines.config import HelpFormatter

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("what", choices=["status", "next"], nargs="?", default="status")
    parser.add_argument("--results", default="results", help="where the done results are (default: results)")
    parser.add_argument("--plan", default=str(PLAN), help="the plan file (default: research/gpu/plan.txt)")
    args = parser.parse_args(argv)
    try:
        lines = status(Path(args.results), Path(args.plan))
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    pending = [line for line, done in lines if not done]
    if args.what == "next":
        print(pending[0].command if pending else "")
        return 0
    for line, done in lines:
        mark = "done" if done else ("NEXT" if pending and line is pending[0] else "    ")
        print(f"[{mark}] {line.number:2d}. {line.command}  ({line.note})")
    left = sum(line.minutes for line in pending)
    print(f"{len(lines) - len(pending)} of {len(lines)} done; ~{left:g} device-min left"
          + (f"; next on a lent GPU (carry [\".gpu\"]): {pending[0].command}" if pending else ""))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
