"""The wall-clock of a study: the process-minutes of its finished stages per group and kind of stage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from patchplace.pipelines.stages import stage_resumed, stage_seconds
from patchplace.research.reproduction.metrics import earlier_study
from patchplace.research.reproduction.plan import RUNS
from patchplace.research.reproduction.runner import Study

STAGE_KINDS = (("pretraining", ("pretrain",)), ("all-label training", ("train", "finetune")),
               ("label efficiency", ("label",)), ("probes", ("probe",)), ("learned gate", ("gate",)),
               ("evaluation + ONNX", ("eval", "export", "ort")), ("privacy", ("privacy",)))


def stage_minutes(study: Study) -> dict[str, Any]:
    """{"minutes": {group: {kind: process-minutes}}, "resumed": {group: stages finished in a resumed attempt}} of
    the finished stages below ``runs/`` (the study's processes share the machine: per-process time, summed); a
    group with no finished stage there keeps the minutes of an earlier ``study.json`` at this budget."""
    group = {r.name: r.group for r in RUNS}
    minutes: dict[str, dict[str, float]] = {}
    resumed: dict[str, int] = {}

    def add(group_name: str, kind: str, stage_dir: Path) -> None:
        per_group = minutes.setdefault(group_name, {})
        per_group[kind] = per_group.get(kind, 0.0) + (stage_seconds(stage_dir) or 0.0) / 60
        resumed[group_name] = resumed.get(group_name, 0) + int(stage_resumed(stage_dir))

    for done in sorted(study.root.glob("seed*/*/*/DONE")):
        run, stage_name = done.parent.parent.name.split("@e")[0], done.parent.name  # <row>@e<epochs>: the row
        add(group.get(run, "other"), next((k for k, prefixes in STAGE_KINDS if stage_name.startswith(prefixes)),
                                          "other"), done.parent)
    for done in sorted([*study.root.glob("curves/*/*/DONE"), *study.root.glob("controls/DONE")]):
        add("curves" if "curves" in done.parts else "controls",
            "pretraining" if done.parent.name == "pretrain" else "probes", done.parent)
    earlier = earlier_study(study.cfg).get("wall_clock") or {}
    measured = set(minutes)
    minutes.update({g: m for g, m in (earlier.get("minutes") or {}).items() if g not in measured})
    resumed.update({g: n for g, n in (earlier.get("resumed") or {}).items() if g not in measured})
    return {"minutes": minutes, "resumed": resumed}


def wall_clock(spent: dict[str, Any]) -> list[str]:
    """The table of ``stage_minutes``: minutes per group and kind of stage, and their total."""
    minutes = spent["minutes"]
    if not minutes:
        return []
    known = [k for k, _ in STAGE_KINDS]
    kinds = [k for k in known if any(k in m for m in minutes.values())]
    kinds += sorted({k for m in minutes.values() for k in m} - set(known))  # kinds not in STAGE_KINDS, after them
    lines = ["| group | " + " | ".join(kinds) + " | total |", "|" + " --- |" * (len(kinds) + 2)]
    for g, m in minutes.items():
        lines.append(f"| {g} | " + " | ".join(f"{m.get(k, 0):.1f}" for k in kinds) + f" | {sum(m.values()):.1f} |")
    total = sum(sum(m.values()) for m in minutes.values())
    resumed = sum(spent["resumed"].values())
    return [*lines, "", f"Process-minutes in all: {total:.1f} (divide by the number of study processes for the "
            "elapsed time when they ran side by side)." + (
                f" {resumed} stage(s) finished in a resumed attempt: they count that attempt's minutes only, so "
                "the total is a lower bound." if resumed else "")]
