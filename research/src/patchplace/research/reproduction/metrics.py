"""What the study measured: each (run, seed)'s numbers read from its stages' ``results.json`` files, merged with
an earlier ``results/<name>.json`` measured at the same budget and harness version."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from patchplace.pipelines.stages import stage_seconds
from patchplace.research.reproduction.corpora import corpus_of, corpus_record, same_corpus, study_corpora
from patchplace.research.reproduction.plan import RUNS, Run, StudyConfig
from patchplace.research.reproduction.protocol import PROVENANCE, read_starts
from patchplace.research.reproduction.runner import Study


def read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def early_stop(log: Path) -> dict[str, Any] | None:
    """The early-stop record of a finished training stage (``run.early_stop_patience``), or None."""
    if not (log.parent / "DONE").is_file() or not log.is_file():
        return None
    stops = [row["early_stop"] for line in log.read_text().splitlines() if line.strip()
             and "early_stop" in (row := json.loads(line))]
    return stops[-1] if stops else None


def still_improving(log: Path) -> bool:
    """Whether a training stage's best validation top-1 is its last evaluation (it ran to its epoch cap while still
    improving: its number is a lower bound of training to convergence)."""
    tops = [row["eval"]["top1"] for line in log.read_text().splitlines() if line.strip()
            and "top1" in (row := json.loads(line)).get("eval", {})] if log.is_file() else []
    return bool(tops) and tops[-1] >= max(tops)


def metrics_of(study: Study, run: Run, seed: int) -> dict[str, Any] | None:
    """The numbers of one (run, seed), or None when none of its evaluations has finished."""
    d = study.dir(run, seed)
    ev = read_json(d / "eval" / "results.json")
    probe = ev if run.speech else read_json(d / "probe" / "results.json") or {}
    probes_only = study.probe_only(run) or not study.full_label(run, seed)
    if ev is None and not (probes_only and probe):
        return None
    ev = ev or {}
    m: dict[str, Any] = {"seed": seed, "top1": ev["classification"]["top1"] if ev else None}
    corpus = corpus_of(run.name)
    m["corpus"] = corpus_record(getattr(study.cfg, corpus), corpus)  # what a later report merges it by
    m.update(training_of(study, run, d, probes_only))
    if "consistency" in ev:
        m["consistency_curve"] = ev["consistency"]
        if "0.15" in ev["consistency"]:
            m["consistency"] = ev["consistency"]["0.15"]["consistency"]
            m["diff_norm"] = ev["consistency"]["0.15"]["diff_norm"]
    gate = gate_of(study, run, seed)
    if gate:
        m["gate"] = gate
    m.update(probe_metrics(probe, run))
    m.update(provenance_of(d), **validation_of(d), **training_stop(study, run, seed))
    return m


def training_of(study: Study, run: Run, d: Path, probes_only: bool) -> dict[str, Any]:
    """What a (run, seed) trained: its pretraining and fine-tuning epochs, their minutes and the PE it fine-tuned
    with."""
    pre, ft = study.epochs(run)
    if probes_only:
        return dict(pretrain_epochs=pre, finetune_epochs=0.0, minutes=(stage_seconds(d / "pretrain") or 0) / 60,
                    finetune_pe="(probes only)")
    if run.classifier_only:
        return dict(pretrain_epochs=0.0, finetune_epochs=ft if run.speech else pre + ft,
                    minutes=(stage_seconds(d / "train") or 0) / 60,
                    finetune_pe="learned" if not run.speech else "sincos1d")
    return dict(pretrain_epochs=pre, finetune_epochs=ft,
                minutes=((stage_seconds(d / "pretrain") or 0) + (stage_seconds(d / "finetune") or 0)) / 60,
                finetune_pe={"keep": "sincos1d" if run.speech else "sincos2d (kept)"}.get(run.finetune_pe,
                                                                                          run.finetune_pe))


def probe_metrics(probe: dict[str, Any], run: Run) -> dict[str, Any]:
    """The frozen-feature numbers of a probe evaluation's results: the linear probes, the method's own position
    accuracy (MP3's eta curve, DropPos's grid)."""
    m: dict[str, Any] = {}
    if "linear_probe" in probe:
        m["linear_probe"] = probe["linear_probe"]["top1"]
        m["linear_probe_1pct"] = probe["linear_probe_low_label"]["top1"]
        # the random-init control it is read against: the same architecture (PE) and feature
        m["probe_feature"], m["probe_pos_embed"] = probe.get("probe_feature"), probe.get("probe_pos_embed")
    if "mp3_position_accuracy" in probe:
        m["mp3_eta_curve"] = probe["mp3_position_accuracy"]
        eta = next((float(o.split("=")[1]) for o in run.objective if o.startswith("objective.eta=")), 0.5)
        m["position_accuracy"] = probe["mp3_position_accuracy"][str(eta)]["top1"]
    if "droppos_grid" in probe:
        m["droppos_grid"] = probe["droppos_grid"]
        m["position_accuracy"] = probe["droppos_grid"]["mean"]
    return m


def provenance_of(d: Path) -> dict[str, Any]:
    """{"provenance": {"starts": [...]}} of a (row, seed) directory (``protocol.record_start``), or {}."""
    starts = read_starts(d / PROVENANCE)
    return {"provenance": {"starts": starts}} if starts else {}


def validation_of(d: Path) -> dict[str, Any]:
    """{"validation": {"mp3_eta_curve" | "droppos_grid": ..., "position_accuracy": ...}} of a position row's
    validation stage (``runner.Study.position_validation``), or {}."""
    measured = read_json(d / "position_val" / "results.json") or {}
    if "mp3_position_accuracy" in measured:
        return {"validation": {"mp3_eta_curve": measured["mp3_position_accuracy"]}}
    if "droppos_grid" in measured:
        return {"validation": {"droppos_grid": measured["droppos_grid"],
                               "position_accuracy": measured["droppos_grid"]["mean"]}}
    return {}


def training_stop(study: Study, run: Run, seed: int) -> dict[str, Any]:
    """How a classifier's training stopped where it stopped on validation (``classifier_patience`` /
    ``speech_patience``): ``stopped`` (early | cap | cap, improving), the epoch cap, and ``validation_top1`` (the
    best validation top-1, the checkpoint tested)."""
    c, d = study.cfg, study.dir(run, seed)
    patience = c.speech_patience if run.speech else c.classifier_patience
    log = d / ("train" if run.classifier_only else "finetune") / "log.jsonl"
    if not patience or not (log.parent / "DONE").is_file():
        return {}
    tops = [row["eval"]["top1"] for line in log.read_text().splitlines() if line.strip()
            and "top1" in (row := json.loads(line)).get("eval", {})]
    pre, ft = study.epochs(run)
    cap = ft if run.speech or not run.classifier_only else (c.classifier_epochs or pre + ft)
    return {"stopped": "early" if early_stop(log) else ("cap, improving" if still_improving(log) else "cap"),
            "epochs_cap": cap, **({"validation_top1": max(tops)} if tops else {})}


def gate_of(study: Study, run: Run, seed: int) -> dict[str, Any] | None:
    """The learned gate's numbers of one (row, seed) on the validation split (``<run>/gate``): the linear probe
    of its features by pretraining epochs, the random init of the same architecture and feature on this seed, and
    raw pixels; None before the gate stage finished."""
    measured = read_json(study.dir(run, seed) / "gate" / "controls.json")
    if not measured:
        return None
    final = study.epochs(run)[0]
    probes = {f"{r.get('epoch') or final:g}": r["linear"]["probe_set"] for r in measured["checkpoints"].values()}
    controls = measured["controls"]
    return {"probe": dict(sorted(probes.items(), key=lambda kv: float(kv[0]))),
            "random": controls["random_linear"]["probe_set"][0], "random_init": measured["random_inits"][0],
            "pixels": controls["pixels_linear"]["probe_set"][0], "val_samples": measured["test_samples"]}


# Fields that change a run's numbers: an earlier results/study.json is reused only when all of them match.
BUDGET_FIELDS = ("preset", "holdout", "pretrain_epochs", "finetune_epochs", "probe_only", "batch_size",
                 "finetune_overrides", "probe_train_samples", "probe_val_samples", "probe_epochs", "curve_samples",
                 "speech_pretrain_epochs", "speech_finetune_epochs", "test_samples", "overrides", "speech_overrides",
                 "label_subset_seed")


def earlier_study(cfg: StudyConfig) -> dict[str, Any]:
    """An earlier ``results/study.json`` measured at this budget (another machine, or a ``runs/`` since cleaned),
    or {}: its rows and stage minutes stand where ``runs/`` no longer holds them. A different
    budget is ignored, with a note; so is what was made on another corpus (:func:`on_these_corpora`)."""
    path = Path(cfg.results) / f"{cfg.name}.json"
    earlier = read_json(path)
    if not earlier:
        return {}
    changed = budget_changes(earlier, cfg)
    if changed:
        print(f"[study] {path}: measured at another budget ({', '.join(changed)} differ); not reused")
        return {}
    return on_these_corpora(earlier, cfg)


def on_these_corpora(earlier: dict[str, Any], cfg: StudyConfig) -> dict[str, Any]:
    """``earlier`` without the rows made on another corpus than ``cfg`` reads (each row's recorded manifest
    fingerprints, ``reproduction.corpora``): a row is never reported for a corpus it was not measured on."""
    now = study_corpora(cfg)
    results = {name: [m for m in rows if same_corpus(m.get("corpus"), now[corpus_of(name)], corpus_of(name))]
               for name, rows in (earlier.get("results") or {}).items()}
    return {**earlier, "results": results}


def earlier_results(cfg: StudyConfig) -> dict[str, list[dict[str, Any]]]:
    """Rows of an earlier ``study.json`` at this budget (``earlier_study``): seeds accumulate across study
    invocations."""
    path = Path(cfg.results) / f"{cfg.name}.json"
    rows = earlier_study(cfg).get("results", {})
    for metrics in rows.values():
        for m in metrics:
            m.setdefault("source", str(path))
    return rows


# Version of the training / evaluation harness behind the numbers, recorded with every result: rows
# measured by another version are never merged. This one: the optimizer on the backbone's parameter groups with
# layer decay applied, probes of the feature the training trained, one Diff. Norm (the head's input), the in-memory
# data path with batched augmentation, MP3 pretraining feeding the class token, fine-tuning pooled as each method's
# protocol does, the lr schedule set once per optimizer step, validation held out of the train split.
HARNESS_VERSION = 4


def budget_changes(earlier: dict[str, Any], cfg: StudyConfig) -> list[str]:
    """The BUDGET_FIELDS in which an earlier ``study.json`` differs from ``cfg`` (and ``harness`` when it was
    measured by another harness version)."""
    now = asdict(cfg)
    changed = [k for k in BUDGET_FIELDS if _normal(earlier.get("config", {}).get(k)) != _normal(now[k])]
    return changed + (["harness"] if earlier and earlier.get("harness", 1) != HARNESS_VERSION else [])


def _normal(value: Any) -> Any:
    return list(value) if isinstance(value, tuple | list) else value


def earlier_rows(study: Study) -> dict[str, dict[int, dict[str, Any]]]:
    """{row: {seed: metrics}} of an earlier ``study.json`` at this budget (:func:`earlier_results`), without the
    rows pretrained for other epochs than this study's (``row_pretrain_epochs``: another budget)."""
    rows, earlier = {}, earlier_results(study.cfg)
    for run in RUNS:
        pre = study.epochs(run)[0]
        found = {m["seed"]: m for m in earlier.get(run.name, []) if run.classifier_only
                 or run.speech or not isinstance(m.get("pretrain_epochs"), int | float) or m["pretrain_epochs"] == pre}
        if found:
            rows[run.name] = found
    return rows


def collect(study: Study) -> dict[str, list[dict[str, Any]]]:
    """Every (run, seed) measured below ``runs/`` (configured seeds), plus the earlier rows of ``study.json`` at
    the same budget that are not measured here; ordered by seed."""
    earlier = earlier_rows(study)
    rows = {}
    for run in RUNS:
        found = dict(earlier.get(run.name, {}))
        found.update({s: m for s in study.seeds(run) if (m := metrics_of(study, run, s)) is not None})
        if found:
            rows[run.name] = [found[s] for s in sorted(found)]
    return rows
