"""The study in sittings: short, bounded stretches of a machine (a lent GPU for ~9 minutes, starting bare each time)
whose results add up.

A **sitting** runs the study's pending units (``study.py``'s (groups, seed) units, or (row, seed) units with
``unit_per_row``, in priority order) that fit its time budget, each in a fresh run directory, and writes one
**bundle** per finished unit: a small JSON file with the unit's rows (every metric of every (run, seed) it
measured), its controls / learning curve when it measured them, its seconds, the sitting, the device and the torch
version. A unit is atomic: one that does not finish inside the sitting is killed and left pending (the next sitting
reruns it from scratch). ``merge`` rebuilds ``results/<name>.{json,md}`` from every bundle (the rows of one seed
from however many bundles measured them), so the report of a study run in many sittings, on machines that start
bare, is the report of one study.

    python pipelines/study.py --config pipelines/configs/study_gpu.yaml --sitting 9 --bundles results/study_gpu_bundles
    python pipelines/study.py --config pipelines/configs/study_gpu.yaml --merge --bundles results/study_gpu_bundles
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from core.stages import hardware_line
from patchplace.data.atomic import write_json_atomic
from reproduction.metrics import HARNESS_VERSION, read_json
from reproduction.plan import RUNS, StudyConfig, measures_controls

LOG = "sittings.jsonl"  # one line per sitting: device, units finished, units cut off, seconds


def unit_id(groups: Sequence[str], seed: int, only: Sequence[str] = ()) -> str:
    """A unit's name in bundles and logs (a file name: no commas or spaces): ``main+mp3_pe.seed0``,
    ``curves.mp3.seed0``; per row (``unit_per_row``) ``main.mae.seed1``, ``main.controls.seed0``,
    ``main+mp3_pe.mp3+mp3_ft_none+mp3_ft_relbias2d.seed0``."""
    return ".".join(["+".join(groups), *(["+".join(only)] if only else []), f"seed{seed}"])


def bundles_of(directory: Path, cfg: StudyConfig | None = None) -> dict[str, dict[str, Any]]:
    """Every finished unit's bundle in ``directory`` by unit id (a damaged file is reported and left pending);
    with ``cfg``, only those measured at its budget (a unit measured at another budget is pending again: a study
    raised to 100 epochs reruns every unit, and its report merges only those)."""
    from reproduction.metrics import budget_changes

    found = {}
    for path in sorted(directory.glob("*.json")):
        try:
            bundle = json.loads(path.read_text())
            if cfg is None or not budget_changes(bundle, cfg):
                found[bundle["unit"]] = bundle
        except (json.JSONDecodeError, KeyError) as exc:
            print(f"[sitting] {path}: not a bundle ({exc}); its unit stays pending", file=sys.stderr)
    return found


def attempts_of(directory: Path) -> list[dict[str, Any]]:
    log = directory / LOG
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []


def estimate(unit: str, groups: Sequence[str], bundles: dict[str, dict[str, Any]],
             attempts: list[dict[str, Any]], only: Sequence[str] = ()) -> tuple[float | None, float]:
    """(seconds a unit is expected to take, seconds it is known to need at least): the longest finished unit of
    the same groups and rows (``only``; another seed) is the estimate; a sitting that cut the unit off after s
    seconds says it needs more than s. ``bundles`` / ``attempts``: those measured at this config's work
    (:func:`work_of`)."""
    same = [b["seconds"] for b in bundles.values() if b["groups"] == list(groups)
            and list(b.get("only") or []) == list(only)]
    at_least = max([a["cut_off"][unit] for a in attempts if unit in a.get("cut_off", {})], default=0.0)
    guesses = [*same, *([at_least * 1.2] if at_least else [])]
    return (max(guesses) if guesses else None), at_least


def budget_of(cfg: StudyConfig) -> dict[str, Any]:
    """The budget fields of ``cfg`` as JSON has them: a cut-off measured at another budget says nothing here."""
    from reproduction.metrics import BUDGET_FIELDS

    return json.loads(json.dumps({k: asdict(cfg)[k] for k in BUDGET_FIELDS}))


# config fields that pick or name units and where they run, not what a unit does (and so not how long it takes)
NOT_WORK = ("groups", "only", "only_seeds", "ablation_seeds", "speech_seeds", "unit_per_row", "runs", "results",
            "name", "compare_with")


def work_of(config: dict[str, Any]) -> dict[str, Any]:
    """What a unit's time depends on: every config field (``asdict``, or a bundle's ``config``) but ``NOT_WORK``,
    as JSON has them. A unit's time at other epochs, probes, thread counts, ``ort``, ``controls``... says nothing
    about it here: :func:`estimate` reads only bundles and cut-offs of the same work."""
    return json.loads(json.dumps({k: v for k, v in config.items() if k not in NOT_WORK}))


def unit_rows(rows: dict[str, list[dict[str, Any]]], groups: Sequence[str], seed: int,
              only: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """The rows one unit measured (its groups' runs on its seed, those in ``only`` when given; a curve or controls
    unit has none)."""
    names = {r.name for r in RUNS if r.group in groups and (not only or r.name in only)}
    kept = {n: [m for m in ms if m.get("seed") == seed] for n, ms in rows.items() if n in names}
    return {n: ms for n, ms in kept.items() if ms}


def device_line() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else hardware_line()


def run_sitting(cfg: StudyConfig, units: list[Any], command: list[str], bundles_dir: Path, minutes: float,
                out: Path | None = None, max_units: int | None = None) -> int:
    """Run the pending ``units`` (``study.Unit``, priority order) that fit ``minutes``, each as
    ``command + unit overrides`` in a fresh run directory; a bundle per finished unit into ``bundles_dir`` (and
    ``out``: the folder a lent machine sends back). Returns how many units finished."""
    import torch

    bundles_dir.mkdir(parents=True, exist_ok=True)
    budget, start = minutes * 60, time.monotonic()
    sitting = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    budget_now, work_now = budget_of(cfg), work_of(asdict(cfg))
    done = bundles_of(bundles_dir, cfg)
    attempts = [a for a in attempts_of(bundles_dir)  # cut-offs at this budget and work (a log before "work": budget)
                if a.get("budget") == budget_now and a.get("work", work_now) == work_now]
    pending = [u for u in units if unit_id(u.groups, u.seed, u.only) not in done]
    print(f"[sitting] {sitting}: {len(done)} unit(s) in {bundles_dir}, {len(pending)} pending, {minutes:g} min "
          f"on {device_line()}", flush=True)
    finished, cut_off, scratch = [], {}, Path(tempfile.mkdtemp(prefix="sitting-"))
    for unit in pending:
        if max_units is not None and len(finished) >= max_units:
            break
        name = unit_id(unit.groups, unit.seed, unit.only)
        left = budget - (time.monotonic() - start)
        expected, at_least = estimate(name, unit.groups, {n: b for n, b in done.items() if work_of(
            b.get("config", {})) == work_now}, attempts, unit.only)
        if at_least >= budget:
            print(f"[sitting] {name}: needs more than {at_least / 60:.1f} min, more than a whole sitting; lower its "
                  "epochs (pretrain_epochs / finetune_epochs ...) or give the sitting more minutes", flush=True)
            continue
        if expected is not None and expected > left:
            print(f"[sitting] {name}: ~{expected / 60:.1f} min expected, {left / 60:.1f} left: next sitting",
                  flush=True)
            continue
        if left < 30:
            break
        runs, results = scratch / name / "runs", scratch / name / "results"
        argv = [*command, *unit.overrides(), f"runs={runs}", f"results={results}", "compare_with=null"]
        print(f"[sitting] {name}: running ({left / 60:.1f} min left)", flush=True)
        began = time.monotonic()
        code = _run_bounded(argv, left, scratch / f"{name}.log")
        seconds = time.monotonic() - began
        if code is None:
            cut_off[name] = seconds
            print(f"[sitting] {name}: cut off after {seconds / 60:.1f} min (the sitting's end); pending, rerun "
                  "from scratch next sitting", flush=True)
            continue
        if code != 0:
            tail = (scratch / f"{name}.log").read_text()[-2000:]
            print(f"[sitting] {name}: failed (exit {code}); its log ends:\n{tail}", file=sys.stderr, flush=True)
            continue
        measured = read_json(results / f"{cfg.name}.json") or {}
        bundle = {"unit": name, "groups": list(unit.groups), "seed": unit.seed, "only": list(unit.only),
                  "seconds": seconds, "sitting": sitting, "device": device_line(), "torch": torch.__version__,
                  "harness": HARNESS_VERSION, "config": asdict(cfg),
                  "rows": unit_rows(measured.get("results", {}), unit.groups, unit.seed, unit.only),
                  "controls": measured.get("controls") if measures_controls(unit.groups, unit.only) else None,
                  "curves": measured.get("curves") if "curves" in unit.groups else None}
        for path in (bundles_dir, *([out] if out else [])):
            write_json_atomic(path / f"{name}.json", bundle)
        done[name] = bundle
        finished.append(name)
        print(f"[sitting] {name}: finished in {seconds / 60:.1f} min -> {bundles_dir / (name + '.json')}",
              flush=True)
    record = {"sitting": sitting, "device": device_line(), "minutes": minutes, "finished": finished,
              "cut_off": cut_off, "seconds": time.monotonic() - start, "budget": budget_now, "work": work_now}
    for path in (bundles_dir, *([out] if out else [])):
        with (path / LOG).open("a") as f:
            f.write(json.dumps(record) + "\n")
    still = pending_units(units, bundles_dir, cfg)
    print(f"[sitting] {sitting}: finished {len(finished)} unit(s) in {record['seconds'] / 60:.1f} min; "
          f"pending: {', '.join(still) or 'none'}", flush=True)
    return len(finished)


def _run_bounded(argv: list[str], seconds: float, log: Path) -> int | None:
    """Run ``argv`` with its output in ``log``; its exit code, or None when it was still running after ``seconds``
    (then it and its children are killed)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=max(1.0, seconds))
        except subprocess.TimeoutExpired:
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=wait)
                    break
                except (subprocess.TimeoutExpired, ProcessLookupError):
                    continue
            return None


def merged_study(cfg: StudyConfig, bundles_dir: Path) -> dict[str, Any]:
    """A ``study.json``-shaped payload of every bundle measured at this budget (rows by run, seeds in order;
    controls and curves from the units that measured them; minutes per group), ready for ``report``."""
    from reproduction.metrics import budget_changes

    rows: dict[str, dict[int, dict[str, Any]]] = {}
    controls, curves, minutes, devices = None, {}, {}, set()
    for name, bundle in bundles_of(bundles_dir).items():
        changed = budget_changes(bundle, cfg)
        if changed:
            print(f"[sitting] {name}: measured at another budget ({', '.join(changed)} differ); not merged")
            continue
        for run, metrics in bundle["rows"].items():
            for m in metrics:
                rows.setdefault(run, {})[m["seed"]] = {**m, "sitting": bundle["sitting"], "device": bundle["device"]}
        controls = bundle.get("controls") or controls
        curves.update(bundle.get("curves") or {})
        group = "+".join(bundle["groups"])
        minutes.setdefault(group, {})
        minutes[group]["sitting units"] = minutes[group].get("sitting units", 0.0) + bundle["seconds"] / 60
        devices.add(f"{bundle['device']}, torch {bundle['torch']}")
    return {"harness": HARNESS_VERSION, "config": asdict(cfg), "hardware": "; ".join(sorted(devices)),
            "results": {run: [by_seed[s] for s in sorted(by_seed)] for run, by_seed in rows.items()},
            "controls": controls, "curves": curves, "wall_clock": {"minutes": minutes, "resumed": {}},
            "commands": [f"sittings: {bundles_dir}"]}


def pending_units(units: list[Any], bundles_dir: Path, cfg: StudyConfig) -> list[str]:
    """The ids of the units no bundle in ``bundles_dir`` holds at ``cfg``'s budget, in priority order."""
    done = bundles_of(bundles_dir, cfg)
    return [n for u in units if (n := unit_id(u.groups, u.seed, u.only)) not in done]

