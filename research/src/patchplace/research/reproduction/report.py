"""The report of a pre-registered protocol: its hash and commit, the rows it refuses, the position rows against
their PE-free ceilings, the doubling decisions, the claims one Holm family per question, the corrections stated
since, what it does not run, the learned gate and the wall-clock; ``results/<name>.{json,md}``."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from patchplace.data import Manifest
from patchplace.data.atomic import atomic_file, write_json_atomic
from patchplace.pipelines.stages import hardware_line
from patchplace.research.reproduction.claims import ALPHA, Claim, measure, protocol_items
from patchplace.research.reproduction.corpora import study_corpora
from patchplace.research.reproduction.corrections import correction_lines
from patchplace.research.reproduction.gate import gate, gate_budgets
from patchplace.research.reproduction.metrics import HARNESS_VERSION, budget_changes, collect, read_json
from patchplace.research.reproduction.plan import RUNS, StudyConfig
from patchplace.research.reproduction.protocol import (
    Commit,
    Protocol,
    load_protocol,
    machines_of,
    protocol_commit,
    refusals,
)
from patchplace.research.reproduction.runner import Study
from patchplace.research.reproduction.stats import MIN_SEEDS, per_seed, seeds_of
from patchplace.research.reproduction.wallclock import stage_minutes, wall_clock


def gate_table(rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The learned gate per pretrained row and budget: the validation probe over seeds beside the random init of
    the same architecture and feature on the same seeds, the one-sided Welch p and the outcome (fails closed)."""
    labels = {r.name: r.label for r in RUNS}
    lines = ["| row | pretraining epochs | seeds | validation linear probe | random init (same feature, same seeds) | "
             "raw pixels | one-sided Welch p | learned? |", "|" + " --- |" * 8]
    for run in RUNS:
        measured = [m for m in rows.get(run.name, []) if m.get("gate")]
        for budget in gate_budgets(rows, run.name):
            probes = [m["gate"]["probe"][budget] for m in measured]
            judged = gate(rows, run.name, budget)
            lines.append(
                f"| {labels[run.name]} ({measured[0]['gate']['random_init']}) | {budget} | {seeds_of(measured)} | "
                f"{_pct(probes)} | {_pct([m['gate']['random'] for m in measured])} | "
                f"{_pct([m['gate']['pixels'] for m in measured])} | "
                f"{f'{judged.p:.2g}' if judged.p is not None else '-'} | "
                f"{'yes' if judged.passed else 'no' if judged.p is not None else f'no (< {MIN_SEEDS} seeds)'} |")
    ungated = [labels[r.name] for r in RUNS if r.name in rows and not r.classifier_only and not r.speech
               and not gate_budgets(rows, r.name)]
    if ungated:
        lines += ["", f"Gate not measured (rows merged from a study before the gate): {', '.join(ungated)}; they "
                  "fail closed, so no claim reads them in regime."]
    return lines

def _mean_sd(values: list[float] | None) -> tuple[float, float] | None:
    if not values:
        return None
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _pct(values: list[float] | None) -> str:
    ms = _mean_sd(values)
    if ms is None:
        return "-"
    return f"{ms[0] * 100:.1f}" + (f" ± {ms[1] * 100:.1f}" if values and len(values) > 1 else "")

def commands_so_far(cfg: StudyConfig, argv: list[str]) -> list[str]:
    """The study commands whose rows the report holds: those of an earlier ``study.json`` at this budget, then this
    one (``--report-only`` measures nothing and is not recorded)."""
    earlier = read_json(Path(cfg.results) / f"{cfg.name}.json") or {}
    commands = [] if budget_changes(earlier, cfg) else list(earlier.get("commands", []))
    if "--report-only" not in argv:
        command = "python pipelines/study.py " + " ".join(argv)
        commands = [c for c in commands if c != command] + [command]
    return commands

def speech_corpus(cfg: StudyConfig) -> str:
    """The speech corpus's name (its train manifest's dataset, else the directory's name)."""
    path = Path(cfg.spoken_keywords) / "train"
    return Manifest.load(path).dataset if (path / "manifest.json").is_file() else Path(cfg.spoken_keywords).name

def protocol_header(protocol: Protocol, commit: Commit | None) -> str:
    """The line naming the protocol the report reads: its path, sha256 and commit (or that it is not committed)."""
    where = (f"committed at {commit.sha[:10]} ({commit.time.isoformat()})" + (
        "; **the file differs from that commit**" if commit.dirty else "")) if commit else "**not committed**"
    return f"Protocol: `{protocol.path}`, sha256 `{protocol.sha256}`, {where}."


def position_table(rows: dict[str, list[dict[str, Any]]], protocol: Protocol, patch: int) -> list[str]:
    """Each position row's regime measure against its PE-free ceiling at ``patch`` px: validation (the regime's)
    and test."""
    lines = ["| row | measure | seeds | validation | PE-free ceiling (validation) | share of it | regime level | "
             "test |", "|" + " --- |" * 8]
    seen = set()
    for spec in protocol.claims:
        for req in spec["regime"]:
            p = req.get("pretext")
            if not p or (p["row"], p["measure"]) in seen:
                continue
            seen.add((p["row"], p["measure"]))
            ceiling = protocol.ceiling(p["ceiling"], patch)
            val = list(per_seed(rows, p["row"], measure(p["measure"], "validation")).values())
            test = list(per_seed(rows, p["row"], measure(p["measure"])).values())
            share = f"{statistics.mean(val) / ceiling:.2f}" if val else "-"
            lines.append(f"| {p['row']} | {p['measure']} | {len(val) or '-'} | {_pct(val or None)} | "
                         f"{ceiling * 100:.1f} (`{p['ceiling']}@{patch}`) | {share} | "
                         f"{protocol.share * ceiling * 100:.1f} | {_pct(test or None)} |")
    return lines


def family_tables(items: list[Claim], protocol: Protocol) -> list[str]:
    """The claims, one table per Holm family, each after its question and the count it decides."""
    lines = []
    for family, question in protocol.data["families"].items():
        mine = [c for c in items if c.family == family]
        if not mine:
            continue
        tested, pending = [c for c in mine if c.tested], [c for c in mine if c.pending]
        decided = [c for c in tested if c.adjusted is not None and c.adjusted < ALPHA]
        holm_over = f"no Holm yet: {len(pending)} pending, the family is decided once every planned seed has run" \
            if pending else f"Holm over these {len(tested)}"
        lines += [f"### {family}: {question}", "",
                  f"{len(tested)} of {len(mine)} in regime and tested ({holm_over}); decided {len(decided)}.", "",
                  "| claim (paper) | paper's setting -> this study's | regime (validation) | in regime? | seeds | "
                  "raw p | Holm p | this study |", "|" + " --- |" * 8]
        for c in mine:
            status = "-" if c.in_regime is None else "pending" if c.pending else ("yes" if c.in_regime else "no")
            lines.append(f"| {c.claim} | {c.setting} | {c.regime} | {status} | {c.seeds or '-'} | "
                         f"{f'{c.p:.2g}' if c.p is not None and not c.pending else '-'} | "
                         f"{f'{c.adjusted:.2g}' if c.adjusted is not None else '-'} | {c.verdict} |")
        lines.append("")
    return lines


def decisions_of(cfg: StudyConfig) -> dict[str, Any]:
    """The doubling rule's recorded decisions (``results/<name>_decisions.json``), or {}."""
    return read_json(Path(cfg.results) / f"{cfg.name}_decisions.json") or {}

def claims_of(cfg: StudyConfig, protocol: Protocol, rows: dict[str, list[dict[str, Any]]]) -> list[Claim]:
    """The protocol's claims decided on ``rows`` at the rows' patch size, with the study's speech corpus."""
    settings = {"speech_corpus": speech_corpus(cfg), "patch_size": cfg.patch_size or protocol.patch_size}
    return protocol_items(rows, protocol, settings)


def markdown(cfg: StudyConfig, protocol: Protocol, commit: Commit | None, rows: dict[str, list[dict[str, Any]]],
             refused: list[str], minutes: dict[str, Any]) -> str:
    """``results/<name>.md``: one section after the other, in the order the report reads."""
    patch = cfg.patch_size or protocol.patch_size
    items, decisions = claims_of(cfg, protocol, rows), decisions_of(cfg)
    models = sorted({model for ms in rows.values() for m in ms for model in machines_of(m)})
    lines = [f"# Reproduction study v{protocol.data['version']} (pre-registered)", "",
             protocol_header(protocol, commit), "",
             f"Hardware of this report: {hardware_line()}; machine models of the rows counted: "
             f"{'; '.join(models) or 'none'}.", "",
             f"Rows counted: {sum(len(ms) for ms in rows.values())}; refused: {len(refused)} line(s)"
             + (":" if refused else "."), *[f"- {line}" for line in refused], "",
             "## Position rows against the PE-free ceiling", "", *position_table(rows, protocol, patch), "",
             "## The doubling rule (seed 0, validation)", "",
             *([f"- {group}: {json.dumps(d)}" for group, d in decisions.get("groups", {}).items()]
               or [f"No decision recorded yet (`{cfg.name}_decisions.json`)."]), "",
             "## The claims, one Holm family per question", "", *family_tables(items, protocol),
             *correction_lines(protocol, items),
             "## Not run in this version", "",
             *[f"- {n['claim']}: {n['why']}" for n in protocol.data.get("not_run", [])], ""]
    if any(gate_budgets(rows, r.name) for r in RUNS):
        lines += ["## The learned gate (validation split)", "", *gate_table(rows), ""]
    spent = wall_clock(minutes)
    if spent:
        lines += ["## Wall-clock per part (minutes of the finished stages)", "", *spent, ""]
    return "\n".join(lines) + "\n"


def report(cfg: StudyConfig, argv: list[str]) -> str:
    """The report of the pre-registered protocol ``cfg.protocol``: the rows it refuses (one line each, also
    printed) and :func:`markdown`; writes ``results/<name>.{json,md}`` and returns the markdown."""
    protocol = load_protocol(cfg.protocol)
    commit = protocol_commit(protocol.path)
    study, out = Study(cfg), Path(cfg.results)
    out.mkdir(parents=True, exist_ok=True)
    measured = collect(study)
    rows, refused = refusals(measured, protocol.sha256, commit, protocol.path.resolve().parent)
    for line in refused:
        print(f"[study] {line}", flush=True)
    minutes = stage_minutes(study)
    text = markdown(cfg, protocol, commit, rows, refused, minutes)
    payload = {"harness": HARNESS_VERSION, "commands": commands_so_far(cfg, argv), "config": asdict(cfg),
               "protocol": {"path": str(protocol.path), "sha256": protocol.sha256,
                            "commit": commit.sha if commit else None, "dirty": commit.dirty if commit else None},
               "hardware": hardware_line(), "results": measured, "refused": refused, "decisions": decisions_of(cfg),
               "claims": [{**asdict(c), "verdict": c.verdict} for c in claims_of(cfg, protocol, rows)],
               "corpora": study_corpora(cfg), "wall_clock": minutes}
    write_json_atomic(out / f"{cfg.name}.json", payload)  # two study processes may finish at once
    with atomic_file(out / f"{cfg.name}.md") as tmp:
        tmp.write_text(text)
    return text
