"""The GPU's share of a pre-registered study in one lent command (``bash research/gpu/gpu_evidence.sh
position4px:W``): the 4 px position claims (MP3 Fig. 3 both rows, DropPos Table 3) in priority waves.

    python -m patchplace.research.reproduction.waves --config pipelines/configs/study_v5_gpu4px.yaml --wave 1 \\
        --bundles results/study_v5_gpu4px_bundles --out $OUT --seconds 500

One command: measure the study ViT's rate (MP3 pretraining as the units run it, ``gpu.processes`` processes
sharing the device, ~``gpu.rate_seconds`` s), size the epochs from it once (recorded in ``sizing.json`` beside the
bundles: every later wave trains the same epochs, so its units pair with the first wave's), then run the first
pending wave up to ``--wave`` (wave k: seed k - 1 of every row, the units side by side) and write each finished
unit's bundle at once (``--bundles`` and ``--out``); a unit still running at the end is killed and stays pending.
After the first wave, the protocol's stopping rule: a group whose seed-0 row is below its regime on validation is
out of regime at a one-command budget, recorded, and its rows run no later wave.

``--standin`` (or ``PATCHPLACE_GPU_STANDIN=1``) rehearses it on the CPU: the "GPU" is the CPU, the stages train in
float32, every number only proves the machinery (tests/test_study_v5.py).
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # `python -m patchplace.research.reproduction.waves`, before the imports below load
    # torch: the arguments parse without it (--help, a usage error), then this module runs imported by its name
    from patchplace.research import cli

    sys.exit(cli.main("waves"))

import argparse
import json
import math
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from patchplace.data import Manifest
from patchplace.data.atomic import write_json_atomic
from patchplace.pipelines import CONFIGS
from patchplace.pipelines.config import ConfigError, load
from patchplace.research.cli import waves_parser
from patchplace.research.reproduction.claims import measure
from patchplace.research.reproduction.metrics import read_json
from patchplace.research.reproduction.plan import RUNS, StudyConfig
from patchplace.research.reproduction.protocol import Protocol, ProtocolError, load_protocol
from patchplace.research.reproduction.runner import Study
from patchplace.research.reproduction.schedule import epochs_fields, epochs_overrides, thresholds
from patchplace.research.reproduction.sittings import keep_bundle, unit_bundle, unit_id
from patchplace.research.reproduction.units import study_units

SIZING = "sizing.json"  # beside the bundles: the epochs every wave trains, and the stopping rule's record


def standin() -> bool:
    return os.environ.get("PATCHPLACE_GPU_STANDIN") == "1"


def with_sizing(cfg: StudyConfig, bundles: Path) -> StudyConfig:
    """``cfg`` at the epochs recorded in ``bundles/sizing.json`` (unchanged without one)."""
    sized = read_json(Path(bundles) / SIZING) or {}
    if "epochs" not in sized:
        return cfg
    pretrain, per_row = epochs_fields(cfg, dict.fromkeys(sized["rows"], float(sized["epochs"])))
    return replace(cfg, pretrain_epochs=pretrain, row_pretrain_epochs=per_row)


def wave_units(cfg: StudyConfig, gpu: dict[str, Any], wave: int, stopped: set[str]) -> list[Any]:
    """Wave ``wave``'s units (seed ``gpu.seeds[wave - 1]`` of every row not stopped), in the protocol's row order,
    as the study plans them (the same unit ids as ``--sitting`` / ``--merge``)."""
    seed = gpu["seeds"][wave - 1]
    units = {u.only[0]: u for u in study_units(cfg) if u.seed == seed and len(u.only) == 1}
    return [units[row] for row in gpu["rows"] if row not in stopped and row in units]


def rate_command(cfg: StudyConfig, out: Path, seed: int) -> list[str]:
    """MP3's pretraining as a unit runs it (the same data, batch, patch size and precision), without end."""
    run = next(r for r in RUNS if r.name == "mp3_eta0")
    study = Study(cfg)
    return [sys.executable, "-m", "patchplace.pipelines.pretrain", "--config", str(CONFIGS / f"{run.config}.yaml"),
            *study.common(run, seed), *study.model_overrides(run), *run.objective, f"run.output={out}",
            "optim.max_steps=100000000", "run.log_every=10", "run.eval_every=0", "run.checkpoint_every=0",
            "run.resume=false"]


def measure_rate(cfg: StudyConfig, processes: int, seconds: float, scratch: Path, limit: float) -> dict[str, Any]:
    """The study ViT's images/s with ``processes`` MP3 pretrainings sharing the device: each runs until ``seconds``
    of its steady steps are logged (start-up apart), or ``limit`` seconds pass; the sum of their last rates."""
    procs, logs, start = [], [], time.monotonic()
    for i in range(processes):
        out = scratch / f"rate{i}"
        logs.append(scratch / f"rate{i}.out")
        procs.append(subprocess.Popen(rate_command(cfg, out, i), stdout=logs[-1].open("w"), stderr=subprocess.STDOUT,
                                      start_new_session=True))
    rates: dict[int, float] = {}
    first: dict[int, float] = {}
    while time.monotonic() - start < limit and len(rates) < processes:
        time.sleep(0.5)
        for i in range(processes):
            rate = read_rate(scratch / f"rate{i}" / "log.jsonl")
            if rate is not None:
                first.setdefault(i, time.monotonic())
                if time.monotonic() - first[i] >= seconds:
                    rates[i] = rate
            if procs[i].poll() not in (None, 0):
                raise RuntimeError(f"rate run {i} exited {procs[i].returncode}: {logs[i].read_text()[-1500:]}")
    for proc in procs:
        _kill(proc)
    for i in range(processes):  # a process still starting at the limit counts with the rate it logged, or none
        if i not in rates and (rate := read_rate(scratch / f"rate{i}" / "log.jsonl")) is not None:
            rates[i] = rate
    if not rates:
        raise RuntimeError(f"no rate logged within {limit:.0f} s: {logs[0].read_text()[-1500:]}")
    return {"images_per_s": sum(rates.values()), "per_process": sorted(rates.values()), "processes": processes,
            "seconds": round(time.monotonic() - start, 1)}


def read_rate(log: Path) -> float | None:
    """The last images/s a training log records (None before its first record)."""
    try:
        rates = [json.loads(line)["samples_per_s"] for line in log.read_text().splitlines()
                 if '"samples_per_s"' in line]
    except (OSError, ValueError, KeyError):
        return None
    return float(rates[-1]) if rates else None


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait)
                return
            except (subprocess.TimeoutExpired, ProcessLookupError):
                continue


def size_epochs(per_process: float, seconds_left: float, gpu: dict[str, Any], train_images: int) -> float:
    """The protocol's sizing rule: floor(2 x safety x rate per process x (seconds left - eval reserve) / train
    images) / 2 epochs, at least ``min_epochs``."""
    usable = max(0.0, seconds_left - float(gpu["eval_reserve_seconds"]))
    epochs = math.floor(2 * float(gpu["safety"]) * per_process * usable / train_images) / 2
    return max(float(gpu["min_epochs"]), epochs)


def stop_rule(cfg: StudyConfig, protocol: Protocol, bundles: Path) -> dict[str, Any]:
    """After the first wave: the rows of each doubling group whose seed-0 validation measure (its bundle) is below
    its regime at this patch size; {} while a seed-0 unit of a group is pending."""
    gpu, out = protocol.data["gpu"], {}
    for group in protocol.data["doubling"]["groups"]:
        rows = [r for r in protocol.data["epochs"][group]["rows"] if r in gpu["rows"]]
        levels = thresholds(protocol, rows, cfg.patch_size)
        values = {}
        for row in rows:
            found = [b for b in _bundles(bundles) if b.get("seed") == gpu["seeds"][0] and row in b.get("only", [])]
            if not found:
                return {}
            m = next(iter(found[0]["rows"].get(row, [])), {})
            values[row] = measure(levels[row][0], "validation")(m)
        below = sorted(r for r, v in values.items() if v is None or v < levels[r][1])
        out[group] = {"seed0_validation": values, "below": below, "rows_stopped": rows if below else []}
    return out


def _bundles(directory: Path) -> list[dict[str, Any]]:
    return [b for p in sorted(Path(directory).glob("*.json")) if p.name != SIZING
            and isinstance(b := read_json(p), dict) and "unit" in b]


def run_wave(cfg: StudyConfig, units: list[Any], command: list[str], bundles: Path, out: Path | None,
             seconds: float, ids: list[str]) -> tuple[list[str], list[str]]:
    """Every unit of a wave at once, each a study process in its own scratch directory; a bundle per finished unit
    the moment it finishes; those still running after ``seconds`` are killed (pending). -> (finished, cut off)."""
    scratch, sitting = Path(tempfile.mkdtemp(prefix="wave-")), datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    running, finished, start = {}, [], time.monotonic()
    for unit in units:
        name = unit_id(unit.groups, unit.seed, unit.only)
        argv = [*command, *unit.overrides(), f"runs={scratch / name / 'runs'}", f"results={scratch / name / 'res'}",
                "compare_with=null"]
        log = (scratch / f"{name}.log").open("w")
        running[name] = (unit, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True),
                         time.monotonic())
        print(f"[waves] {name}: started", flush=True)
    while running and time.monotonic() - start < seconds:
        time.sleep(1.0)
        for name, (unit, proc, began) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[name]
            if proc.returncode != 0:
                print(f"[waves] {name}: failed (exit {proc.returncode}); its log ends:\n"
                      f"{(scratch / f'{name}.log').read_text()[-2000:]}", file=sys.stderr, flush=True)
                continue
            bundle = unit_bundle(cfg, unit, scratch / name / "res", time.monotonic() - began, sitting)
            if keep_bundle(bundle, bundles, out, ids):
                finished.append(name)
                print(f"[waves] {name}: finished in {(time.monotonic() - began) / 60:.1f} min -> {bundles}",
                      flush=True)
    for name, (_, proc, _) in running.items():
        _kill(proc)
        print(f"[waves] {name}: cut off at the command's end; pending", flush=True)
    return finished, sorted(running)


def main(argv: list[str] | None = None) -> int:
    args, began = waves_parser().parse_args(argv), time.monotonic()  # (research/cli.py: without torch)
    try:
        cfg = load(StudyConfig, args.config, args.overrides)
        protocol = load_protocol(cfg.protocol or "")
    except (ConfigError, ProtocolError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import torch

    rehearsal = args.standin or standin()
    if not rehearsal and not torch.cuda.is_available():
        print("error: no GPU here: run it on a lent GPU machine, or --standin to rehearse on the CPU",
              file=sys.stderr)
        return 2
    gpu, bundles = protocol.data["gpu"], Path(args.bundles)
    if not 1 <= args.wave <= len(gpu["seeds"]):
        print(f"error: --wave must be 1..{len(gpu['seeds'])} (wave k runs seed k - 1)", file=sys.stderr)
        return 2
    bundles.mkdir(parents=True, exist_ok=True)
    overrides = [*args.overrides, *(["precision=no"] if rehearsal else [])]
    return run_command(args, load(StudyConfig, args.config, overrides), protocol, overrides, began)


def run_command(args: argparse.Namespace, cfg: StudyConfig, protocol: Protocol, overrides: list[str],
                began: float) -> int:
    """Size (once), then the first pending wave up to ``--wave`` and the stopping rule after the first."""
    gpu, bundles = protocol.data["gpu"], Path(args.bundles)
    sized = read_json(bundles / SIZING) or {}
    if "epochs" not in sized:
        scratch = Path(tempfile.mkdtemp(prefix="rate-"))
        rate = measure_rate(cfg, int(gpu["processes"]), float(gpu["rate_seconds"]), scratch,
                            limit=max(30.0, args.seconds / 4))
        train = Manifest.load(Path(cfg.fashion_mnist) / "train").num_samples - cfg.holdout
        left = args.seconds - (time.monotonic() - began)
        per_process = rate["images_per_s"] / rate["processes"]
        sized = {"epochs": size_epochs(per_process, left, gpu, train), "rows": gpu["rows"], "rate": rate,
                 "seconds_left": round(left, 1), "train_images": train, "device": _device()}
        print(f"[waves] rate {rate['images_per_s']:.0f} images/s ({rate['processes']} processes): "
              f"{sized['epochs']:g} epochs per unit", flush=True)
        _write(bundles, args.out, sized)
    cfg = with_sizing(cfg, bundles)
    sized_overrides = epochs_overrides(cfg, dict.fromkeys(sized["rows"], float(sized["epochs"])))
    command = [sys.executable, "-m", "patchplace.research.study", "--config", args.config, *overrides,
               *sized_overrides]
    ids = [unit_id(u.groups, u.seed, u.only) for w in range(1, len(gpu["seeds"]) + 1)
           for u in wave_units(cfg, gpu, w, set())]
    done = {b["unit"] for b in _bundles(bundles)}
    stopped = {r for g in (sized.get("stop") or {}).values() for r in g["rows_stopped"]}
    for wave in range(1, args.wave + 1):
        pending = [u for u in wave_units(cfg, gpu, wave, stopped) if unit_id(u.groups, u.seed, u.only) not in done]
        if not pending:
            continue
        left = args.seconds - (time.monotonic() - began)
        print(f"[waves] wave {wave}: {len(pending)} unit(s), {left:.0f} s left", flush=True)
        finished, cut = run_wave(cfg, pending, command, bundles, Path(args.out) if args.out else None, left - 5, ids)
        if wave == 1 and not cut and (stop := stop_rule(cfg, protocol, bundles)):
            sized["stop"] = stop
            _write(bundles, args.out, sized)
        print(f"[waves] wave {wave}: finished {len(finished)}, pending {len(cut)}", flush=True)
        return 0
    print(f"[waves] waves 1-{args.wave}: nothing pending", flush=True)
    return 0


def _device() -> str:
    from patchplace.research.reproduction.protocol import machine_model

    return machine_model()


def _write(bundles: Path, out: str | None, sized: dict[str, Any]) -> None:
    for where in (bundles, *([Path(out)] if out else [])):
        where.mkdir(parents=True, exist_ok=True)
        write_json_atomic(where / SIZING, sized)


if __name__ == "__main__":
    sys.exit(main())
