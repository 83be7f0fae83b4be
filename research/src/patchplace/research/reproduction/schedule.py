"""The order a pre-registered protocol's rows run in (``make study-v5``; ``study.py`` with a config naming a
``protocol``): nothing runs unless the protocol is committed and the config says what it says; then seed 0 of each
doubling group's rows at the protocol's epochs, the doubling rule read on their validation measures and recorded
once (``results/<name>_decisions.json``, never revised), then every row and seed at the decided epochs (run
directories name their epochs, so a doubled group never meets the shorter one's stages). Every step resumes."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from patchplace.data.atomic import write_json_atomic
from patchplace.pipelines.config import load
from patchplace.research.reproduction.claims import measure
from patchplace.research.reproduction.metrics import collect, read_json
from patchplace.research.reproduction.plan import RUNS, StudyConfig
from patchplace.research.reproduction.protocol import Protocol, doubling_decision, load_protocol, unregistered
from patchplace.research.reproduction.runner import Study


def decisions_path(cfg: StudyConfig) -> Path:
    return Path(cfg.results) / f"{cfg.name}_decisions.json"


def group_epochs(protocol: Protocol, decisions: dict[str, Any] | None = None) -> dict[str, float]:
    """{row: pretraining epochs} of the doubling groups' rows: the protocol's, or the decided ones."""
    decided, out = (decisions or {}).get("groups", {}), {}
    for name in protocol.data["doubling"]["groups"]:
        group = protocol.data["epochs"][name]
        out.update(dict.fromkeys(group["rows"], float(decided.get(name, {}).get("epochs", group["pretrain"]))))
    return out


def mismatch(cfg: StudyConfig, protocol: Protocol) -> str | None:
    """One line where the config does not run what the protocol states (seeds, epochs, stopping, patch size,
    the validation measures and epochs in the run directories its doubling rule needs), else None."""
    seeds, epochs = protocol.data["seeds"], protocol.data["epochs"]
    position = [r for g in protocol.data["doubling"]["groups"] for r in epochs[g]["rows"]]
    expected: dict[str, Any] = {
        "patch_size": protocol.data["data"]["patch_size"], "holdout": protocol.data["data"]["holdout"],
        "close_seeds": tuple(seeds["position"]),
        "close_rows": tuple(sorted(position)), "seeds": tuple(seeds["classifiers"]),
        "speech_seeds": tuple(seeds["speech"]),
        "pretraining epochs": group_epochs(protocol),
        "classifier_epochs": float(epochs["classifiers"]["cap"]),
        "classifier_eval_epochs": float(epochs["classifiers"]["eval_every_epochs"]),
        "classifier_patience": epochs["classifiers"]["patience"],
        "speech_pretrain_epochs": float(epochs["speech"]["pretrain"]),
        "speech_finetune_epochs": float(epochs["speech"]["cap"]),
        "speech_eval_epochs": float(epochs["speech"]["eval_every_epochs"]),
        "speech_patience": epochs["speech"]["patience"], "validation_positions": True, "epochs_in_path": True}
    got = {k: getattr(cfg, k) for k in expected if hasattr(cfg, k)}
    got["close_rows"] = tuple(sorted(cfg.close_rows))
    study = Study(cfg)
    got["pretraining epochs"] = {r.name: study.epochs(r)[0] for r in RUNS if r.name in position}
    wrong = [f"{k}={got[k]!r} (the protocol: {v!r})" for k, v in expected.items() if got[k] != v]
    return (f"the config does not run what {protocol.path} states: {'; '.join(wrong)}") if wrong else None


def thresholds(protocol: Protocol, rows: list[str], patch: int | None = None) -> dict[str, tuple[str, float]]:
    """{row: (its regime measure, the level on validation at ``patch`` px)} from the claims' pretext regimes (the
    first per row)."""
    out: dict[str, tuple[str, float]] = {}
    for spec in protocol.claims:
        for req in spec["regime"]:
            p = req.get("pretext")
            if p and p["row"] in rows and p["row"] not in out:
                out[p["row"]] = (p["measure"], protocol.share * protocol.ceiling(p["ceiling"], patch))
    return out


def decide(cfg: StudyConfig, protocol: Protocol, group: str) -> dict[str, Any]:
    """The doubling rule on one group: its rows' seed-0 regime measures on validation (collected from the runs)."""
    rows = protocol.data["epochs"][group]["rows"]
    levels = thresholds(protocol, rows, cfg.patch_size)
    measured = collect(Study(cfg))
    seed = protocol.data["doubling"]["seed"]
    values = {r: next((v for m in measured.get(r, []) if m["seed"] == seed
                       and (v := measure(levels[r][0], "validation")(m)) is not None), None) for r in levels}
    rule = protocol.data["doubling"]
    return doubling_decision(values, {r: t for r, (_, t) in levels.items()},
                             float(protocol.data["epochs"][group]["pretrain"]), float(rule["factor"]))


def with_decisions(cfg: StudyConfig) -> StudyConfig:
    """``cfg`` at the recorded decided epochs (the report and every unit read the same ones)."""
    recorded = read_json(decisions_path(cfg)) or {}
    if not cfg.protocol or not recorded.get("groups"):
        return cfg
    pretrain, per_row = epochs_fields(cfg, group_epochs(load_protocol(cfg.protocol), recorded))
    return replace(cfg, pretrain_epochs=pretrain, row_pretrain_epochs=per_row)


def epochs_fields(cfg: StudyConfig, epochs: dict[str, float]) -> tuple[float, dict[str, float]]:
    """(pretrain_epochs, row_pretrain_epochs) that give each row of ``epochs`` its epochs: a row whose name holds a
    dot (``mp3_eta0.75``: a config key cannot name it) takes ``pretrain_epochs``, so those rows share theirs."""
    dotted = {e for r, e in epochs.items() if "." in r}
    if len(dotted) > 1:
        raise ValueError(f"rows with a dot in their name need one pretraining budget, got {sorted(dotted)}")
    pretrain = dotted.pop() if dotted else cfg.pretrain_epochs
    return pretrain, {**cfg.row_pretrain_epochs, **{r: e for r, e in epochs.items() if "." not in r}}


def epochs_overrides(cfg: StudyConfig, epochs: dict[str, float]) -> list[str]:
    """The command-line overrides of :func:`epochs_fields` (what each unit's process is given)."""
    pretrain, per_row = epochs_fields(cfg, epochs)
    return [f"pretrain_epochs={pretrain:g}",
            "row_pretrain_epochs={" + ", ".join(f"{r}: {e:g}" for r, e in sorted(per_row.items())) + "}"]


def run_protocol(args: argparse.Namespace, cfg: StudyConfig,
                 run_jobs: Callable[[argparse.Namespace, StudyConfig], int]) -> int:
    """Seed 0 of the doubling groups, the decisions, then everything at the decided epochs (see the module);
    returns the exit code (2: a protocol not committed, or a config that does not run what it states)."""
    protocol = load_protocol(cfg.protocol)
    cfg = load(StudyConfig, args.config, args.overrides)  # as configured: ``cfg`` may hold decided epochs already
    problem = unregistered(protocol.path) or mismatch(cfg, protocol)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    path, recorded = decisions_path(cfg), read_json(decisions_path(cfg)) or {}
    if recorded and recorded.get("protocol_sha256") != protocol.sha256:
        print(f"error: {path} was decided under protocol {str(recorded.get('protocol_sha256'))[:12]}, not "
              f"{protocol.sha256[:12]}: a decision is never revised; give this protocol its own name=", file=sys.stderr)
        return 2
    groups = dict(recorded.get("groups", {}))
    for group in protocol.data["doubling"]["groups"]:
        if group in groups:
            continue
        rows = protocol.data["epochs"][group]["rows"]
        phase = [f"only=[{','.join(rows)}]", "close_seeds=[0]", "ablation_seeds=[0]", "seeds=[0]"]
        first = argparse.Namespace(**{**vars(args), "overrides": [*args.overrides, *phase]})
        if run_jobs(first, load(StudyConfig, args.config, first.overrides)) != 0:
            return 1
        groups[group] = decide(load(StudyConfig, args.config, first.overrides), protocol, group)
        print(f"[study] doubling rule, {group}: {groups[group]}", flush=True)
        write_json_atomic(path, {"protocol_sha256": protocol.sha256, "groups": groups})
    decided = {"protocol_sha256": protocol.sha256, "groups": groups}
    overrides = [*args.overrides, *epochs_overrides(cfg, group_epochs(protocol, decided))]
    rest = argparse.Namespace(**{**vars(args), "overrides": overrides})
    return run_jobs(rest, load(StudyConfig, args.config, rest.overrides))
