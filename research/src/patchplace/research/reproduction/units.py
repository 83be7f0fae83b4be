"""The study's units: what one study process runs (``study.py --jobs``, a sitting, a GPU wave): groups on one
seed, or, with ``unit_per_row``, one row on one seed; in the config's priority order."""

from __future__ import annotations

from dataclasses import dataclass

from patchplace.research.reproduction.metrics import measured_before
from patchplace.research.reproduction.plan import (
    CONTROLS,
    StudyConfig,
    group_seeds,
    measures_controls,
    run_seeds,
    runs_of,
)
from patchplace.research.reproduction.runner import Study


@dataclass(frozen=True)
class Unit:
    """Groups run together on one seed by one study process (mp3_pe rides with main: it fine-tunes main's MP3);
    a learning curve is a unit of its own, and with ``unit_per_row`` every row (``only``: the unit's rows, or
    ``controls``)."""

    groups: tuple[str, ...]
    seed: int
    only: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{'+'.join(self.groups)}{' ' + ','.join(self.only) if self.only else ''} seed {self.seed}"

    def overrides(self) -> list[str]:
        return [f"groups=[{','.join(self.groups)}]", f"only_seeds=[{self.seed}]",
                *([f"only=[{','.join(self.only)}]"] if self.only else [])]


def study_units(cfg: StudyConfig) -> list[Unit]:
    """Every (groups, seed) unit once, in the priority order of ``cfg.groups``, then by seed; one unit per
    learning curve. ``unit_per_row``: every (row, seed) instead (:func:`row_units`)."""
    if cfg.unit_per_row:
        return with_curves(cfg, row_units(cfg))
    units: dict[tuple[str, int], list[str]] = {}
    for group in cfg.groups:
        if group == "curves":
            continue
        for seed in seeds_of_group(cfg, group):
            host = ("main", seed) if group == "mp3_pe" and ("main", seed) in units else (group, seed)
            units.setdefault(host, []).append(group)
    return with_curves(cfg, [Unit(tuple(groups), seed) for (_, seed), groups in units.items()])


def reused(cfg: StudyConfig) -> set[tuple[str, int]]:
    """``reuse_results``: the (row, seed)s results/<name>.json holds whole at this budget, not run again."""
    return measured_before(Study(cfg)) if cfg.reuse_results else set()


def seeds_of_group(cfg: StudyConfig, group: str) -> list[int]:
    """Every seed a row of ``group`` runs (its group's seeds and the rows' ``row_seeds``), ascending."""
    return sorted({*group_seeds(cfg, group), *(s for run in runs_of((group,), cfg.only, cfg.skip)
                                                for s in run_seeds(cfg, run))})


def row_units(cfg: StudyConfig) -> list[Unit]:
    """One unit per (row, seed) of the groups (``only`` / ``skip`` applied), in the order of the groups, then the
    seed, then the group's rows. A row that fine-tunes another row's pretraining (``pretrain_from``: MP3 Table 3's
    fine-tunes of main's MP3) joins that row's unit of its seed, or shares one with its siblings where that row
    has no unit (a fresh run directory per unit: apart, each would pretrain again); main's probe controls (all
    seeds at once) are a unit of their own on the first main seed, ahead of its rows."""
    units: dict[tuple[str, int], tuple[list[str], list[str]]] = {}  # (host row, seed) -> (groups, rows)
    for group in cfg.groups:
        if group == "curves":
            continue
        for seed in seeds_of_group(cfg, group):
            if group == "main" and seed == cfg.seeds[0] and cfg.controls and measures_controls(("main",), cfg.only):
                units[(CONTROLS, seed)] = (["main"], [CONTROLS])
            for run in runs_of((group,), cfg.only, cfg.skip):
                if (run.name == "speech_null" and not cfg.speech_null) or seed not in run_seeds(cfg, run):
                    continue
                groups, rows = units.setdefault((run.pretrain_from or run.name, seed), ([], []))
                groups += [] if group in groups else [group]
                rows.append(run.name)
    done = reused(cfg)
    return [Unit(tuple(sorted(groups, key=cfg.groups.index)), seed, tuple(rows))
            for (_, seed), (groups, rows) in units.items() if not all((row, seed) in done for row in rows)]


def with_curves(cfg: StudyConfig, ordered: list[Unit]) -> list[Unit]:
    """``ordered`` with a unit per learning curve (``only``: its row) where the groups put the curves."""
    if "curves" not in cfg.groups or not cfg.curve_epochs:
        return ordered
    curves = [Unit(("curves",), cfg.curve_seed, (name,)) for name in cfg.curve_rows]
    at = cfg.groups.index("curves")
    before = sum(1 for u in ordered if cfg.groups.index(u.groups[0]) < at)
    return ordered[:before] + curves + ordered[before:]
