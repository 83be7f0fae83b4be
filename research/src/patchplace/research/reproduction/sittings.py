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

A bundle is read only when it is whole (:func:`bundle_problem`): a JSON object with every field of its kind, its
unit one of this config's and named after its own groups / seed / rows, the file named ``<unit>.json`` (a copy under
another name — ``main.seed0 (1).json``, ``main.seed0.old.json`` — is refused, so no stale copy replaces a unit's
numbers: rename the one to keep to ``<unit>.json``), rows present where its unit measures rows (a curve unit: its
curve), each row one of its unit's on its seed, and measured at this config's budget. Any other file is one line
naming it and what is wrong, and its unit stays pending: a sitting measures it again, ``merge`` reports it. Two
bundles of different units that measured the same (row, seed) — a study switched to ``unit_per_row`` — merge the
newer sitting's, in one line.

    python pipelines/study.py --config pipelines/configs/study_gpu.yaml --sitting 9 --bundles results/study_gpu_bundles
    python pipelines/study.py --config pipelines/configs/study_gpu.yaml --merge --bundles results/study_gpu_bundles
"""

from __future__ import annotations

import json
import math
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

from patchplace.data.atomic import write_json_atomic
from patchplace.pipelines.stages import hardware_line
from patchplace.research.reproduction.corpora import study_corpora
from patchplace.research.reproduction.metrics import HARNESS_VERSION, read_json
from patchplace.research.reproduction.plan import GROUPS, RUNS, StudyConfig, measures_controls

LOG = "sittings.jsonl"  # one line per sitting: device, units finished, units cut off, seconds
# files a bundles directory holds beside the bundles: the GPU waves' sizing (reproduction/waves.py)
NOT_BUNDLES = ("sizing.json",)


def unit_id(groups: Sequence[str], seed: int, only: Sequence[str] = ()) -> str:
    """A unit's name in bundles and logs (a file name: no commas or spaces): ``main+mp3_pe.seed0``,
    ``curves.mp3.seed0``; per row (``unit_per_row``) ``main.mae.seed1``, ``main.controls.seed0``,
    ``main+mp3_pe.mp3+mp3_ft_none+mp3_ft_relbias2d.seed0``."""
    return ".".join(["+".join(groups), *(["+".join(only)] if only else []), f"seed{seed}"])


NOT_READ = "not read"  # the end of a problem that leaves no unit pending (a copy, another config's unit)
# a bundle's fields and the JSON types each must have (None: JSON null allowed)
BUNDLE_FIELDS: dict[str, tuple[type, ...]] = {
    "unit": (str,), "groups": (list,), "seed": (int,), "only": (list,), "seconds": (int, float), "sitting": (str,),
    "device": (str,), "torch": (str,), "harness": (int,), "config": (dict,), "rows": (dict,),
    "controls": (dict, type(None)), "curves": (dict, type(None))}


def bundle_problem(path: Path, bundle: Any, units: Sequence[str] | None = None) -> str | None:
    """What makes ``bundle`` (read from ``path``) not a finished unit's bundle, or None (see the module's
    docstring); ``units``: the unit ids of this config (one not among them is not this study's)."""
    from patchplace.research.reproduction.metrics import BUDGET_FIELDS

    if not isinstance(bundle, dict):
        return f"not a bundle (a JSON {type(bundle).__name__}, not an object)"
    missing = [k for k in BUNDLE_FIELDS if k not in bundle]
    if missing:
        return f"not a bundle: no {', '.join(missing)}"
    for key, types in BUNDLE_FIELDS.items():
        value = bundle[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            expected = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            return f"{key} is {json.dumps(value)[:40]}, expected {expected}"
    groups, only, seed, unit = bundle["groups"], bundle["only"], bundle["seed"], bundle["unit"]
    if not groups or not all(isinstance(g, str) and g in GROUPS for g in groups) or \
            not all(isinstance(o, str) for o in only):
        return f"groups {groups} / only {only}: not the study's groups ({', '.join(GROUPS)}) and row names"
    if unit != unit_id(groups, seed, only):
        return f"its unit {unit!r} is not the one its groups / seed / only name ({unit_id(groups, seed, only)!r})"
    if path.name != f"{unit}.json":
        return (f"holds unit {unit} but is not named {unit}.json (a copy?): only {unit}.json counts; remove this "
                f"file, or rename it to {unit}.json if it holds the numbers to keep; {NOT_READ}")
    if units is not None and unit not in units:
        return f"unit {unit} is not one of this config's units (its groups, seeds, only, unit_per_row); {NOT_READ}"
    if not math.isfinite(bundle["seconds"]) or bundle["seconds"] < 0:
        return f"seconds is {bundle['seconds']}, not a duration"
    lacking = [k for k in BUDGET_FIELDS if k not in bundle["config"]]
    if lacking:
        return f"its config lacks the budget field(s) {', '.join(lacking)}: not a bundle this harness wrote"
    names = {r.name for r in RUNS if r.group in groups and (not only or r.name in only)}
    for run, metrics in bundle["rows"].items():
        if run not in names:
            return f"rows of {run!r}, not a row of unit {unit} ({', '.join(sorted(names)) or 'none'})"
        if not isinstance(metrics, list) or not all(isinstance(m, dict) and m.get("seed") == seed for m in metrics):
            return f"rows of {run!r} are not a list of measurements on seed {seed}"
    if names and not any(bundle["rows"].values()):
        return f"holds no rows (unit {unit} measures {', '.join(sorted(names))}): it measured nothing"
    if "curves" in groups and not bundle["curves"]:
        return f"holds no learning curve (unit {unit} measures one)"
    return None


def read_bundle(path: Path, units: Sequence[str] | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """(the bundle in ``path``, None), or (None, what is wrong with the file) — never an exception."""
    if path.is_dir():
        return None, "a directory, not a bundle file"
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8 text (damaged)"
    except OSError as exc:
        return None, f"unreadable ({exc.strerror or exc})"
    if not text.strip():
        return None, "empty (a copy cut short?)"
    try:
        bundle = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON ({exc.msg}: line {exc.lineno} column {exc.colno}; truncated or edited?)"
    problem = bundle_problem(path, bundle, units)
    return (None, problem) if problem else (bundle, None)


def scan_bundles(directory: Path, cfg: StudyConfig | None = None, units: Sequence[str] | None = None
                 ) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """(every finished unit's bundle in ``directory`` by unit id; one line per ``*.json`` file that is not one, each
    naming the file and what is wrong). With ``cfg``, only those measured at its budget (a unit measured at another
    budget is pending again: a study raised to 100 epochs reruns every unit, and its report merges only those; one
    line says how many); ``units``: this config's unit ids, a bundle of another unit is refused."""
    from patchplace.research.reproduction.metrics import budget_changes

    found, problems, other_budget = {}, [], {}
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        if path.name in NOT_BUNDLES:
            continue
        bundle, problem = read_bundle(path, units)
        if problem:
            pending = "" if problem.endswith(NOT_READ) else "; its unit stays pending"
            problems.append(f"[bundles] {path}: {problem}{pending}")
        elif cfg is not None and (changed := budget_changes(bundle, cfg)):
            other_budget[bundle["unit"]] = changed
        else:
            found[bundle["unit"]] = bundle
    if other_budget:
        fields = sorted({f for changed in other_budget.values() for f in changed})
        problems.append(f"[bundles] {directory}: {len(other_budget)} bundle(s) measured at another budget "
                        f"({', '.join(fields)} differ: {', '.join(sorted(other_budget))}); pending at this one")
    return found, problems


def bundles_of(directory: Path, cfg: StudyConfig | None = None, units: Sequence[str] | None = None,
               quiet: bool = False) -> dict[str, dict[str, Any]]:
    """Every finished unit's bundle in ``directory`` by unit id (:func:`scan_bundles`); the files that are not
    one are said on stderr, one line each (``quiet``: not said), and their units stay pending."""
    found, problems = scan_bundles(directory, cfg, units)
    for line in [] if quiet else problems:
        print(line, file=sys.stderr, flush=True)
    return found


def attempts_of(directory: Path) -> list[dict[str, Any]]:
    """The sittings logged in ``directory`` (a line that is not a sitting's record is said and skipped)."""
    log = directory / LOG
    attempts = []
    for i, line in enumerate(log.read_text(errors="replace").splitlines() if log.is_file() else [], 1):
        try:
            record = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            record = "damaged"
        if record is None:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("cut_off", {}), dict):
            print(f"[bundles] {log}:{i}: not a sitting's record; skipped", file=sys.stderr, flush=True)
            continue
        attempts.append(record)
    return attempts


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
    from patchplace.research.reproduction.metrics import BUDGET_FIELDS

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

    bundles_dir.mkdir(parents=True, exist_ok=True)
    budget, start = minutes * 60, time.monotonic()
    sitting = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    budget_now, work_now = budget_of(cfg), work_of(asdict(cfg))
    ids = [unit_id(u.groups, u.seed, u.only) for u in units]
    done = bundles_of(bundles_dir, cfg, ids)
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
        bundle = unit_bundle(cfg, unit, results, seconds, sitting)
        if not keep_bundle(bundle, bundles_dir, out, ids):
            continue
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


def unit_bundle(cfg: StudyConfig, unit: Any, results: Path, seconds: float, sitting: str) -> dict[str, Any]:
    """The bundle of a finished unit (``study.Unit``) whose process wrote its report to ``results``."""
    import torch

    measured = read_json(results / f"{cfg.name}.json") or {}
    return {"unit": unit_id(unit.groups, unit.seed, unit.only), "groups": list(unit.groups), "seed": unit.seed,
            "only": list(unit.only), "seconds": seconds, "sitting": sitting, "device": device_line(),
            "torch": torch.__version__, "harness": HARNESS_VERSION, "config": asdict(cfg),
            "rows": unit_rows(measured.get("results", {}), unit.groups, unit.seed, unit.only),
            "controls": measured.get("controls") if measures_controls(unit.groups, unit.only) else None,
            "curves": measured.get("curves") if "curves" in unit.groups else None,
            "corpora": measured.get("corpora")}  # what its controls / curves were measured on


def keep_bundle(bundle: dict[str, Any], bundles_dir: Path, out: Path | None, ids: Sequence[str]) -> bool:
    """Write ``bundle`` to ``bundles_dir`` (and ``out``) where it is a whole bundle of one of ``ids``; else say why
    in one line and write nothing (its unit stays pending)."""
    name = bundle["unit"]
    problem = bundle_problem(bundles_dir / f"{name}.json", json.loads(json.dumps(bundle)), ids)
    if problem:  # e.g. a unit that measured no rows: no bundle, the unit stays pending
        print(f"[sitting] {name}: finished, but its bundle would not count ({problem}); pending",
              file=sys.stderr, flush=True)
        return False
    for path in (bundles_dir, *([out] if out else [])):
        write_json_atomic(path / f"{name}.json", bundle)
    return True


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


def merged_study(cfg: StudyConfig, bundles_dir: Path, units: Sequence[str] | None = None) -> dict[str, Any]:
    """A ``study.json``-shaped payload of every bundle measured at this budget (rows by run, seeds in order;
    controls and curves from the units that measured them; minutes per group), ready for ``report``. The files
    that are not such bundles are said, one line each (:func:`scan_bundles`; ``units``: this config's unit ids);
    a (row, seed) two units measured is the newer sitting's, said in one line."""
    found = bundles_of(bundles_dir, cfg, units)
    rows: dict[str, dict[int, dict[str, Any]]] = {}
    by: dict[tuple[str, int], str] = {}  # (run, seed) -> the unit whose measurement is kept
    controls, curves, minutes, devices, corpora = None, {}, {}, set(), None
    for name, bundle in sorted(found.items(), key=lambda item: (item[1]["sitting"], item[0])):  # newest last
        for run, metrics in bundle["rows"].items():
            for m in metrics:
                kept = rows.get(run, {}).get(m["seed"])
                if kept is not None and {k: v for k, v in kept.items() if k not in ("sitting", "device")} != m:
                    print(f"[bundles] {run} seed {m['seed']}: measured by {by[(run, m['seed'])]} (sitting "
                          f"{kept['sitting']}) and {name} (sitting {bundle['sitting']}); {name}'s, the newer, is "
                          "merged", file=sys.stderr, flush=True)
                rows.setdefault(run, {})[m["seed"]] = {**m, "sitting": bundle["sitting"], "device": bundle["device"]}
                by[(run, m["seed"])] = name
        controls = bundle.get("controls") or controls
        corpora = bundle.get("corpora") if bundle.get("controls") or bundle.get("curves") else corpora
        curves.update(bundle.get("curves") or {})
        group = "+".join(bundle["groups"])
        minutes.setdefault(group, {})
        minutes[group]["sitting units"] = minutes[group].get("sitting units", 0.0) + bundle["seconds"] / 60
        devices.add(f"{bundle['device']}, torch {bundle['torch']}")
    return {"harness": HARNESS_VERSION, "config": asdict(cfg), "hardware": "; ".join(sorted(devices)),
            "results": {run: [by_seed[s] for s in sorted(by_seed)] for run, by_seed in rows.items()},
            "controls": controls, "curves": curves, "wall_clock": {"minutes": minutes, "resumed": {}},
            # a bundle from before corpora were recorded: this config's (the merge trusts its budget alike)
            "corpora": corpora or study_corpora(cfg),
            "commands": [f"sittings: {bundles_dir}"]}


def pending_units(units: list[Any], bundles_dir: Path, cfg: StudyConfig) -> list[str]:
    """The ids of the units no whole bundle in ``bundles_dir`` holds at ``cfg``'s budget, in priority order (the
    files that are not bundles are not said here: :func:`bundles_of` says them)."""
    ids = [unit_id(u.groups, u.seed, u.only) for u in units]
    done = bundles_of(bundles_dir, cfg, ids, quiet=True)
    return [n for n in ids if n not in done]

