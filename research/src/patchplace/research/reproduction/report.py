"""The study's report: markdown tables, the claims table, PNG figures and ``results/study.{json,md}``."""

from __future__ import annotations

import json
import platform
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from patchplace.data import Manifest
from patchplace.data.atomic import atomic_file, write_json_atomic
from patchplace.pipelines.engine.hardware import resolve_precision
from patchplace.pipelines.evaluation import plot_privacy_grid
from patchplace.pipelines.stages import hardware_line, stage_resumed, stage_seconds
from patchplace.research.reproduction.claims import (
    ALPHA,
    MIN_SEEDS,
    PRIVACY_METRICS,
    PRIVACY_RUNS,
    Claim,
    claim_items,
    claims,
    claims_versus,
    gate,
    gate_budgets,
    label_items,
    mean_of,
    measure,
    null_control,
    paired_test,
    per_seed,
    privacy_metric,
    protocol_items,
    seeds_of,
    stat,
)
from patchplace.research.reproduction.corpora import study_corpora
from patchplace.research.reproduction.metrics import (
    HARNESS_VERSION,
    budget_changes,
    collect,
    controls_of,
    curves_of,
    earlier_study,
    read_json,
)
from patchplace.research.reproduction.plan import RUNS, StudyConfig, fraction_key
from patchplace.research.reproduction.protocol import (
    Commit,
    Protocol,
    load_protocol,
    machines_of,
    protocol_commit,
    refusals,
)
from patchplace.research.reproduction.runner import Study


def privacy_table(rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """MJP Table 5 in miniature: (a) attack the update on x, compare with x; (b) on x~, compare with x~; (c) that
    reconstruction vs x. Less privacy = lower MSE, higher PSNR / SSIM / FFT2D."""
    labels = {r.name: r.label for r in RUNS}
    lines = ["| model | seeds | attack | setting | " + " | ".join(h for h, _, _ in PRIVACY_METRICS) + " |",
             "|" + " --- |" * (4 + len(PRIVACY_METRICS))]
    for name in PRIVACY_RUNS:
        measured = [m for m in rows.get(name, []) if "privacy" in m]
        if not measured:
            lines.append(f"| {labels[name]} | not run |" + " - |" * (2 + len(PRIVACY_METRICS)))
            continue
        for attack in ("analytic", "gradient_matching", "random"):
            for setting in ("a", "b", "c"):
                cells = []
                for _, key, digits in PRIVACY_METRICS:
                    values = list(per_seed(rows, name, privacy_metric(attack, setting, key)).values())
                    if not values:
                        break
                    mean = statistics.mean(values)
                    cells.append(f"{mean:.{digits}f}" + (f" ± {statistics.stdev(values):.{digits}f}"
                                                         if len(values) > 1 else ""))
                if cells:
                    lines.append(f"| {labels[name]} | {seeds_of(measured)} | {attack.replace('_', ' ')} | "
                                 f"({setting}) | " + " | ".join(cells) + " |")
    return lines


TEXT_COLUMNS = ("finetune_pe", "pretrain_epochs", "finetune_epochs")  # shown as their distinct values, not a mean


def cell(metrics: list[dict[str, Any]], key: str, pct: bool) -> str:
    """A table cell: mean ± std over the seeds that measured ``key``, naming those seeds when they are fewer than
    the row's; text columns (epochs, PE) as their distinct values with the seeds each applies to."""
    if key in TEXT_COLUMNS:
        values: dict[str, list[int]] = {}
        for m in metrics:
            v = m.get(key)
            values.setdefault(f"{v:g}" if isinstance(v, float) else str(v), []).append(m["seed"])
        if len(values) == 1:
            return next(iter(values))
        return ", ".join(f"{v} (seed {','.join(map(str, s))})" for v, s in values.items())
    measured = [m for m in metrics if m.get(key) is not None]
    text = stat(metrics, key, pct)
    if measured and len(measured) < len(metrics):
        text += f" (seed {seeds_of(measured)})"
    return text


def table(rows: dict[str, list[dict[str, Any]]], names: list[str], columns: list[tuple[str, str, bool]],
          first: str = "run") -> list[str]:
    """Markdown table: one row per run present, columns (header, metric key, as percent)."""
    labels = {r.name: r.label for r in RUNS}
    lines = ["| " + " | ".join([first, "seeds", *(h for h, _, _ in columns)]) + " |",
             "|" + " --- |" * (len(columns) + 2)]
    for name in names:
        if name in rows:
            cells = [cell(rows[name], k, pct) for _, k, pct in columns]
            lines.append("| " + " | ".join([labels[name], seeds_of(rows[name]), *cells]) + " |")
        elif any(r.name == name for r in RUNS):
            lines.append(f"| {labels[name]} | not run | " + " | ".join("-" for _ in columns) + " |")
    return lines


def plots(rows: dict[str, list[dict[str, Any]]], out: Path, stem: str = "study") -> list[str]:
    """PNG figures ``<stem>_*.png``; returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, written = {r.name: r.label for r in RUNS}, []
    main = [r.name for r in RUNS if r.group == "main" and r.name in rows]
    if main:
        fig, ax = plt.subplots(figsize=(7, 3.2))
        x = range(len(main))
        bars = [(key, name) for key, name in (("top1", "fine-tuned top-1"), ("linear_probe", "linear probe"),
                                              ("knn", "kNN (best layer)"))
                if any(mean_of(rows, n, key) is not None for n in main)]  # a metric no run measured: no bar
        grouped_bars(ax, [(name, [mean_of(rows, n, key) or 0 for n in main], None) for key, name in bars])
        ax.set_xticks(list(x), [labels[n] for n in main], rotation=20)
        ax.set(ylabel="Fashion-MNIST test accuracy", ylim=(0, 1), title="same ViT, same data, same total epochs")
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        fig.savefig(out / f"{stem}_main.png", dpi=120)
        plt.close(fig)
        written.append(f"{stem}_main.png")
    written += label_efficiency_figure(rows, out, stem, plt)
    curves = {n: rows[n][0]["mp3_eta_curve"] for n in ("mp3_eta0", "mp3", "mp3_eta0.75")
              if n in rows and "mp3_eta_curve" in rows[n][0]}
    if curves:
        fig, ax = plt.subplots(figsize=(4.5, 3.2))
        for n, curve in curves.items():
            etas = sorted(curve, key=float)
            ax.plot([float(e) for e in etas], [curve[e]["top1"] for e in etas], marker="o",
                    label={"mp3": "train eta 0.5"}.get(n, n.replace("mp3_eta", "train eta ")))
        ax.set(xlabel="evaluation eta", ylabel="position top-1", title="MP3 position accuracy (Fig. 3)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{stem}_mp3_eta.png", dpi=120)
        plt.close(fig)
        written.append(f"{stem}_mp3_eta.png")
    mjp = [n for n in ("supervised", "mjp_gamma0", "mjp_gamma0.03", "mjp", "mjp_gamma0.27") if n in rows]
    if mjp:
        fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
        for n in mjp:
            curve = rows[n][0].get("consistency_curve", {})
            gammas = sorted(curve, key=float)
            label = {"mjp": "MJP gamma 0.15"}.get(n, labels[n])
            axes[0].plot([float(g) for g in gammas], [curve[g]["consistency"] for g in gammas], marker="o",
                         label=label)
            axes[1].plot([float(g) for g in gammas], [curve[g]["diff_norm"] for g in gammas], marker="o",
                         label=label)
        axes[0].set(xlabel="evaluation gamma", ylabel="consistency", title="MJP consistency (Fig. 3)")
        axes[1].set(xlabel="evaluation gamma", ylabel="Diff. Norm", title="||F(x) - F(x~)||")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{stem}_mjp_consistency.png", dpi=120)
        plt.close(fig)
        written.append(f"{stem}_mjp_consistency.png")
    return written


def grouped_bars(ax: Any, series: list[tuple[str, list[float], list[float] | None]]) -> None:
    """One bar per (series, group) side by side within each group; ``series``: (label, heights, error bars)."""
    width = 0.8 / max(1, len(series))
    for k, (label, heights, errors) in enumerate(series):
        offset = (k - (len(series) - 1) / 2) * width
        ax.bar([i + offset for i in range(len(heights))], heights, width=width, label=label, yerr=errors,
               capsize=2 if errors else 0)


def label_efficiency_figure(rows: dict[str, list[dict[str, Any]]], out: Path, stem: str, plt: Any) -> list[str]:
    """Fine-tuned top-1 per main run at each label fraction and with every label: mean over seeds, error bar = std
    over seeds (the label-efficiency table as a picture)."""
    fractions = sorted({float(k.split("@")[1]) for ms in rows.values() for m in ms for k in m
                        if k.startswith("top1@")})
    main = [r.name for r in RUNS if r.group == "main" and r.name in rows
            and any(fraction_key("top1", f) in m for m in rows[r.name] for f in fractions)]
    if not fractions or not main:
        return []
    labels = {r.name: r.label for r in RUNS}
    keys = [(fraction_key("top1", f), f"{f:.0%} of the labels") for f in fractions] + [("top1", "all labels")]
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    series = []
    for key, name in keys:
        values = [list(per_seed(rows, n, key).values()) for n in main]
        series.append((name, [statistics.mean(v) if v else 0 for v in values],
                       [statistics.stdev(v) if len(v) > 1 else 0 for v in values]))
    grouped_bars(ax, series)
    ax.set_xticks(range(len(main)), [labels[n] for n in main], rotation=20)
    ax.set(ylabel="Fashion-MNIST test top-1", ylim=(0, 1),
           title="fine-tuned on a fraction of the labels (supervised: from scratch on it)")
    ax.legend(fontsize=7, loc="upper center", ncol=len(keys))
    fig.tight_layout()
    fig.savefig(out / f"{stem}_label_efficiency.png", dpi=120)
    plt.close(fig)
    return [f"{stem}_label_efficiency.png"]


def privacy_figure(study: Study, out: Path, rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    picture = f"{study.cfg.name}_privacy.png"
    """MJP Fig. 5 style grid from the privacy stages' ``privacy.npz`` (first seed of each model that has one):
    originals, each model's reconstruction of its update on x (a), the jigsaw x~, each model's reconstruction of
    its update on x~ (b). APRIL where the model has a learned PE, else gradient matching. Kept as is when no run
    directory holds the images but the merged ``rows`` hold privacy results (a report from merged results); a
    figure left by an earlier study without them is not linked."""
    import numpy as np

    found = {}
    for run in (r for r in RUNS if r.privacy):
        path = next((p for s in study.seeds(run) if (p := study.dir(run, s) / "privacy" / "privacy.npz").is_file()),
                    None)
        if path is not None:
            found[run.label] = dict(np.load(path))
    if not found:
        measured = any("privacy_setup" in m for ms in rows.values() for m in ms)
        return [picture] if measured and (out / picture).is_file() else []

    def reconstructions(setting: str) -> dict[str, np.ndarray]:
        recs = {}
        for label, arrays in found.items():
            attack = "analytic" if f"analytic_{setting}" in arrays else "gradient_matching"
            recs[f"{label}\n{'APRIL' if attack == 'analytic' else 'grad. matching'}"] = arrays[f"{attack}_{setting}"]
        return recs

    first = next(iter(found.values()))
    plot_privacy_grid(first["originals"], first["shuffled"], reconstructions("a"), reconstructions("b"), out / picture,
                      "gradient inversion of one-image updates (MJP Table 5 settings (a), (b); Fig. 5)")
    return [picture]


def label_table(cfg: StudyConfig, rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Label efficiency, a question of this study (not a paper claim): per label fraction, the supervised ViT
    trained from scratch on the subset, each pretrained row's fine-tune on it (else its frozen linear probe: the
    proxy, in both directions) and the seed-paired difference, tested as its own Holm family
    (:func:`claims.label_items`: in regime where the row's features pass the gate and the baseline converged);
    then how the label-subset trainings stopped."""
    labels = {r.name: r.label for r in RUNS}
    names = [r.name for r in RUNS if r.label_efficiency]
    items = label_items(rows, tuple(cfg.label_fractions))
    header = ["method", "seeds"]
    for f in cfg.label_fractions:
        header += [f"fine-tuned {f:.0%}", f"linear probe {f:.0%}", f"vs supervised {f:.0%}"]
    lines = ["| " + " | ".join([*header, "all labels"]) + " |", "|" + " --- |" * (len(header) + 1)]
    for name in names:
        if name not in rows:
            lines.append(f"| {labels[name]} | not run |" + " - |" * (len(header) - 1))
            continue
        cells = [labels[name], seeds_of(rows[name])]
        for f in cfg.label_fractions:
            top1, probe = fraction_key("top1", f), fraction_key("linear_probe", f)
            item = items.get((name, f))
            judged = "(baseline)" if name == "supervised" else (
                f"{item.verdict}{' (linear probe)' if 'proxy' in item.claim else ''}" if item else "not run")
            cells += [stat(rows[name], top1), stat(rows[name], probe), judged]
        lines.append("| " + " | ".join([*cells, stat(rows[name], "top1")]) + " |")
    tested = [c for c in items.values() if c.tested]
    decided = [c for c in tested if c.adjusted is not None and c.adjusted < ALPHA]
    above = sum(1 for c in decided if c.agrees)
    lines += ["", f"Pretraining vs supervised training from scratch on the same labels: {len(tested)} of {len(items)} "
              f"comparisons in regime (Holm over these at alpha = {ALPHA}); decided {len(decided)}: {above} with the "
              f"pretrained row above, {len(decided) - above} below; out of regime: "
              f"{sum(1 for c in items.values() if c.in_regime is False)}. One proxy rule everywhere: where a "
              "pretrained row was not fine-tuned on the subset, its frozen linear probe stands in for the fine-tune "
              "in both directions (above or below), as in the ablation claims."]
    stops = []
    for name in names:
        for f, cap in zip(cfg.label_fractions, cfg.label_finetune_epochs, strict=True):
            how = [m[fraction_key("stopped", f)] for m in rows.get(name, []) if fraction_key("stopped", f) in m]
            if how:
                early, improving = how.count("early"), how.count("cap, improving")
                stops.append(f"{labels[name]} {f:.0%}: stopped early on {early} of {len(how)} seed(s)"
                             + (f", ran to the {cap:g}-epoch cap on {len(how) - early}" if early < len(how) else "")
                             + (f" ({improving} still improving at the cap: a lower bound of training to "
                                "convergence)" if improving else ""))
    if stops:
        lines += ["", "How the label-subset trainings stopped (validation early stopping): " + "; ".join(stops)
                  + "."]
    return lines


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
               and not r.pretrain_from and not gate_budgets(rows, r.name)]
    if ungated:
        lines += ["", f"Gate not measured (rows merged from a study before the gate): {', '.join(ungated)}; they "
                  "fail closed, so no claim reads them in regime."]
    return lines


def eta_table(rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """MP3 Fig. 3 as the paper draws it: position top-1 vs evaluation eta for each training eta (mean ± sd over
    seeds), with the paired contrasts its two rows test."""
    names = [n for n in ("mp3_eta0", "mp3", "mp3_eta0.75") if any("mp3_eta_curve" in m for m in rows.get(n, []))]
    if not names:
        return []
    etas = sorted({e for n in names for m in rows[n] for e in m.get("mp3_eta_curve", {})}, key=float)

    def at(name: str, eta: str) -> dict[int, float]:
        return per_seed(rows, name, lambda m: m.get("mp3_eta_curve", {}).get(eta, {}).get("top1"))

    lines = ["| train eta | seeds | " + " | ".join(f"eval {e}" for e in etas) + " |", "|" + " --- |" * (len(etas) + 2)]
    for n in names:
        lines.append(f"| {({'mp3': '0.5'}).get(n, n.removeprefix('mp3_eta'))} | "
                     f"{seeds_of([m for m in rows[n] if 'mp3_eta_curve' in m])} | "
                     + " | ".join(_pct(list(at(n, e).values()) or None) for e in etas) + " |")
    contrasts = []
    for n, a, b in (("mp3_eta0", "0.9", "0.0"), ("mp3_eta0.75", "0.55", "0.0"), ("mp3_eta0.75", "0.55", "0.9")):
        test = paired_test(at(n, a), at(n, b))
        if test and test.p is not None:
            contrasts.append(f"train {n.removeprefix('mp3_eta')}: eval {a} - eval {b} = {test.mean * 100:+.2f} pt "
                             f"(95% CI [{test.low * 100:+.2f}, {test.high * 100:+.2f}], p = {test.p:.2g}, "
                             f"{len(test.seeds)} seeds)")
    if contrasts:
        lines += ["", "Paired contrasts (the claims' tests; their regime and Holm-adjusted p are in the claims "
                  "table): " + "; ".join(contrasts) + "."]
    return lines


def speech_lines(rows: dict[str, list[dict[str, Any]]], corpus: str) -> list[str]:
    """What the speech rows are (and are not), the null control by its test, and the real recipe."""
    return ["", f"The corpus here is `{corpus}`: keywords synthesized with espeak-ng (voices, speeds, pitches, "
            "noise), split by voice. It is not Speech Commands, so these numbers are not comparable with MP3 "
            "Table 5 (91.9 supervised there) and the Table 5 claim is out of regime here, whatever its sign. The "
            "null-pretraining control (1 step of MP3, then the same fine-tune) against supervised training: "
            f"{null_control(rows)}; \"level\" would need that test to pass. With the real data (Speech Commands v1 "
            "or v2 folders: `python data/speech_commands.py --src <speech_commands folder> --out "
            "shards/speech_commands`, docs/data.md) the recipe is the same study command with `groups=[speech] "
            "spoken_keywords=shards/speech_commands` (MP3 §4.3: 30K updates each, early stopping on validation; "
            "`speech_finetune_epochs` sets the updates)."]


def _mean_sd(values: list[float] | None) -> tuple[float, float] | None:
    if not values:
        return None
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _pct(values: list[float] | None) -> str:
    ms = _mean_sd(values)
    if ms is None:
        return "-"
    return f"{ms[0] * 100:.1f}" + (f" ± {ms[1] * 100:.1f}" if values and len(values) > 1 else "")


def controls_table(cfg: StudyConfig, rows: dict[str, list[dict[str, Any]]], controls: dict[str, Any]) -> list[str]:
    """Every method's linear probe beside the controls on the same train sets and test images: raw pixels (linear,
    kNN), the random-init backbone (per seed), and supervised training from scratch on the same labels; "learned?":
    the learned gate (on the validation split, :func:`claims.gate`), not these test numbers."""
    sets, measured = controls["sets"], controls["controls"]
    names = [n for n in (*(f"{f:g}" for f in cfg.label_fractions), "probe_set") if n in sets]
    heads = [f"{float(n):.0%} of the train labels ({sets[n]} images)" if n != "probe_set"
             else f"all-label probe set ({sets[n]} images)" for n in names]
    lines = ["| features | " + " | ".join(heads) + " | learned? |", "|" + " --- |" * (len(names) + 2)]
    labels = {"pixels_linear": "control: raw pixels, linear probe", "pixels_knn": "control: raw pixels, kNN (k 20)"}
    for variant in controls.get("random_inits", [controls.get("pool", "mean")]):  # per architecture and feature
        suffix = f"@{variant}" if f"random_linear@{variant}" in measured else ""
        labels |= {f"random_linear{suffix}": f"control: random-init `{controls['preset']}` ({variant}), linear "
                                             "probe (per seed)",
                   f"random_knn{suffix}": f"control: random-init ({variant}), kNN (per seed)"}
    for key, label in labels.items():
        lines.append(f"| {label} | " + " | ".join(_pct(measured[key].get(n)) for n in names) + " | - |")
    keys = {n: ("linear_probe" if n == "probe_set" else fraction_key("linear_probe", float(n))) for n in names}
    for run in RUNS:
        if run.name not in rows or run.speech or run.classifier_only or run.pretrain_from:
            continue
        cells = [_pct(list(per_seed(rows, run.name, keys[n]).values()) or None) for n in names]
        if all(c == "-" for c in cells):
            continue
        judged = gate(rows, run.name)
        status = "learned" if judged.passed else (
            "not learned at this budget" if judged.p is not None else "gate not measured")
        features = {f"{r.get('probe_pos_embed')}/{r.get('probe_feature')}" for r in rows[run.name]
                    if r.get("probe_feature")}
        feature = f", {features.pop()}" if len(features) == 1 else ""
        lines.append(f"| {run.label} (linear probe{feature}) | " + " | ".join(cells) + f" | {status} |")
    if "supervised" in rows:
        cells = [_pct(list(per_seed(rows, "supervised", "top1" if n == "probe_set" else fraction_key("top1", float(n)))
                           .values()) or None) for n in names]
        lines.append("| supervised from scratch on the same labels (top-1; probe-set column: all labels) | "
                     + " | ".join(cells) + " | - |")
    return lines


def crossing(points: dict[float, float], level: float) -> str:
    """The first pretraining epoch > 0 whose probe exceeds ``level``, else "not within N epochs"."""
    for epoch, value in points.items():
        if epoch > 0 and value > level:
            return f"{epoch:g}"
    return f"not within {max(points):g}" if points else "-"


def curves_section(curves: dict[str, Any], out: Path, stem: str) -> tuple[list[str], list[str]]:
    """The learning curves: 1% linear probe on validation vs pretraining epochs per method, against the raw-pixel
    and random-init controls; the crossing points; the figure ``<stem>_curves.png``."""
    if not curves:
        return [], []
    labels = {r.name: r.label for r in RUNS}
    first = next(iter(curves.values()))
    pixels = _mean_sd(first["controls"].get("pixels_linear"))
    knn = _mean_sd(first["controls"].get("pixels_knn"))
    epochs = sorted({e for c in curves.values() for e in c["points"]})
    lines = [f"1% linear probe (55 images per class, the label subset of the study) on {first['val_samples']} "
             "validation images, after each number of pretraining epochs (snapshots of one run per method, seed "
             "0; epoch 0 = its random init); controls on the same images: raw pixels "
             f"{_pct(first['controls'].get('pixels_linear'))} (linear), {_pct(first['controls'].get('pixels_knn'))} "
             "(kNN), and per method the random-init backbone on the feature that method probes (linear, one "
             "backbone per seed).", "",
             "| method (feature) | " + " | ".join(f"ep {e:g}" for e in epochs) + " | random init, same feature | "
             "> random init + sd from epoch (one seed: descriptive, not the gate) | > raw pixels from epoch | "
             "pretraining min |",
             "|" + " --- |" * (len(epochs) + 5)]
    for name, c in curves.items():
        random = _mean_sd(c["controls"].get("random_linear"))
        level = random[0] + random[1] if random else float("inf")
        lines.append(f"| {labels[name]} ({c.get('feature') or '-'}) | "
                     + " | ".join(f"{c['points'][e] * 100:.1f}" if e in c["points"] else "-" for e in epochs)
                     + f" | {_pct(c['controls'].get('random_linear'))} | {crossing(c['points'], level)} | "
                     f"{crossing(c['points'], pixels[0]) if pixels else '-'} | {c['minutes']:.1f}"
                     f"{'*' if c.get('resumed') else ''} |")
    if any(c.get("resumed") for c in curves.values()):
        lines += ["", "\\* resumed after a stop: the minutes of its last attempt only."]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for name, c in curves.items():
        ax.plot(list(c["points"]), [v * 100 for v in c["points"].values()], marker="o", label=labels[name])
    for ms, label, style in ((pixels, "raw pixels, linear", "--"), (knn, "raw pixels, kNN", ":")):
        if ms:
            ax.axhline(ms[0] * 100, color="black", linestyle=style, linewidth=1, label=label)
    for name, c in curves.items():  # each method's random init on its own feature (± sd), in its colour
        random = _mean_sd(c["controls"].get("random_linear"))
        line = next(ln for ln in ax.get_lines() if ln.get_label() == labels[name])
        if random:
            ax.axhspan((random[0] - random[1]) * 100, (random[0] + random[1]) * 100, color=line.get_color(),
                       alpha=0.12)
    ax.set_xscale("symlog", linthresh=0.25)
    ax.set(xlabel="pretraining epochs (symlog)", ylabel="1% linear probe, validation top-1 %",
           title="does it learn here? (seed 0; bands: random init per feature, ± sd)")
    ax.legend(fontsize=6, loc="lower right", ncol=2)
    fig.tight_layout()
    fig.savefig(out / f"{stem}_curves.png", dpi=120)
    plt.close(fig)
    return lines, [f"{stem}_curves.png"]


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


MAIN_COLUMNS = [("pretrain ep", "pretrain_epochs", False), ("fine-tune ep", "finetune_epochs", False),
                ("stage min (wall-clock, incl. start-up, evaluation, sharing)", "minutes", False),
                ("fine-tune PE", "finetune_pe", False),
                ("top-1", "top1", True), ("top-1 ORT", "top1_ort", True), ("linear probe", "linear_probe", True),
                ("linear, 1% of the train labels", "linear_probe@0.01", True), ("kNN (best layer)", "knn", True),
                ("consistency@0.15", "consistency", True), ("Diff. Norm@0.15", "diff_norm", False),
                ("mCE", "mce", False), ("position acc.", "position_accuracy", True),
                ("position probe", "position_probe", True)]


def group_rows(group: str) -> list[str]:
    """The rows of one study group, in table order."""
    return [r.name for r in RUNS if r.group == group]


def header_lines(cfg: StudyConfig, hardware: str) -> list[str]:
    """Title, hardware, training precision, the validation protocol and the recipe caveats."""
    protocol = (f"Validation: {cfg.holdout} class-balanced images held out of the train split; every training stage "
                "validates on them (training-time evaluation, early stopping), label subsets and probe sets are "
                "drawn from the other train images, and the test split is read once per final number (an "
                "evaluation of the final or best checkpoint)." if cfg.holdout else
                "Validation: the test split (the v2 protocol: no held-out split).")
    precision = resolve_precision(cfg.precision)
    how = f"precision=auto: {precision.why}" if cfg.precision == "auto" else f"forced by precision={cfg.precision}"
    return ["# Reproduction study (laptop scale)", "", f"Hardware: {hardware}", "",
            f"Training precision: {'float32' if precision.value == 'no' else precision.value} ({how})", "",
            protocol, "",
            *([f"Recipe choices not re-confirmed on the validation split (chosen on the test split in an earlier "
               f"version and carried since; a number that depends on them carries that caveat): "
               f"{'; '.join(cfg.unverified_recipe)}.", ""] if cfg.unverified_recipe else []),
            budget_paragraph(cfg), ""]


def budget_paragraph(cfg: StudyConfig) -> str:
    """The data, backbone, epochs, recipe and evaluation sizes every table is read at."""
    return (f"Fashion-MNIST padded to 32 px, patch 4 (64 positions); backbone `{cfg.preset}` for every image run; "
            f"pretraining {cfg.pretrain_epochs} epoch(s)"
            + (" (" + ", ".join(f"{n}: {e:g}" for n, e in cfg.row_pretrain_epochs.items())
               + (f"; snapshots at {', '.join(f'{b:g}' for b in cfg.gate_budgets)} epoch(s) of the longer ones"
                  if cfg.gate_budgets else "") + ")" if cfg.row_pretrain_epochs else "")
            + f" + fine-tuning {cfg.finetune_epochs} epoch(s) "
            f"(supervised and MJP: {cfg.pretrain_epochs + cfg.finetune_epochs} from scratch); fine-tuning recipe "
            f"`finetune_fashion_mnist.yaml` + {list(cfg.finetune_overrides)}. Accuracies in %, on "
            f"{cfg.test_samples or 'the 10,000'} test images (top-1), "
            f"probes on {cfg.probe_train_samples} train / {cfg.probe_val_samples} test images, "
            f"consistency / eta / position curves on {cfg.curve_samples} test images; mCE over the corruptions "
            "that ran, normalized by the supervised run (= 1.00). `mean ± std` where several seeds ran. "
            "Wall-clock: pretraining + fine-tuning minutes, start-up, evaluation and any stall included, with "
            "the study's processes sharing the machine. Command and config: "
            f"`{cfg.name}.json`.")


def learned_lines(cfg: StudyConfig, rows: dict[str, list[dict[str, Any]]], controls: dict[str, Any] | None,
                  curve_lines: list[str] | None) -> list[str]:
    """Does it learn here? The learning curves, the controls beside every method and the learned gate."""
    lines = []
    if curve_lines:
        lines += ["## Does it learn here? Learning curves against the controls", "", *curve_lines, ""]
    if controls:
        lines += ["## Controls beside every method (same train subsets, same test images)", "",
                  *controls_table(cfg, rows, controls), ""]
    if any(gate_budgets(rows, r.name) for r in RUNS):
        lines += ["## The learned gate (validation split)", "",
                  "A pretrained row's features count as learned where a one-sided Welch t-test over >= "
                  f"{MIN_SEEDS} seeds finds its linear probe (all-label probe set, {cfg.probe_train_samples} train "
                  f"images) on {cfg.gate_val_samples} validation images above the random init of the same "
                  f"architecture and feature on the same seeds, at alpha = {ALPHA}; it fails closed (a row without "
                  "the control, or with fewer seeds, is not learned). The test split plays no part. The same gate "
                  "chooses the budget a claim reads: the smallest pretraining budget at which every row it compares "
                  "passes.", "", *gate_table(rows), ""]
    return lines


def main_lines(cfg: StudyConfig, rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Every method with all labels, and which rows were fine-tuned on every seed."""
    lines = ["## Every method, all labels", "", *table(rows, group_rows("main"), MAIN_COLUMNS, "method")]
    if cfg.full_label_rows:
        lines += ["", f"All-label fine-tuning on every seed for {', '.join(cfg.full_label_rows)} (the rows a "
                  "full-label claim reads); the other rows " + (
                      "on the first seed, their probes on every seed." if cfg.first_seed_finetunes else
                      "are probed only (no claim reads their fine-tunes; a first-seed fine-tune in the table was "
                      "merged from an earlier study.json at this budget).")]
    return lines


def label_lines(cfg: StudyConfig, rows: dict[str, list[dict[str, Any]]], train_images: int | None) -> list[str]:
    """Label efficiency: how the subsets were drawn and trained on, then :func:`label_table`."""
    if not cfg.label_fractions:
        return []
    images = f"{train_images:,} " if train_images else ""  # unknown without the shards' manifest
    return ["", "## Label efficiency: fine-tuning and linear probes on a fraction of the labels", "",
            f"Class-balanced subsets of the {images}training images left after the "
            f"hold-out (the same for every method and seed, `label_subset_seed={cfg.label_subset_seed}`); "
            f"pretraining saw those {images}images without labels. "
            "Fine-tuning: the same recipe for "
            + ", ".join(f"{e:g} epochs over the {f:.0%} subset" for f, e in
                        zip(cfg.label_fractions, cfg.label_finetune_epochs, strict=True))
            + (f" at most, stopped after {cfg.label_patience} validation evaluations without a better top-1 "
               "(the best checkpoint tested)" if cfg.label_patience and cfg.holdout else "")
            + "; supervised: trained from scratch on the subset the same way. Linear probes: on the same "
            "subsets, frozen pretrained backbones. Seed-paired differences to supervised as in the claims."
            + ("" if cfg.label_finetune else " The pretrained rows are probed only here (no fine-tune on the "
               "subsets at this budget)."), "", *label_table(cfg, rows)]


def claim_lines(cfg: StudyConfig, rows: dict[str, list[dict[str, Any]]], settings: dict[str, str]) -> list[str]:
    """What the papers claim and what this study measured (:func:`claims.claims`), and the same rules applied to
    the earlier study ``cfg.compare_with``."""
    lines = ["", "position acc.: MP3 top-1 at the training eta, DropPos mean of its 4 x 4 grid; position probe: a "
             "linear probe of the patch tokens' positions (DropPos Table 7), for every backbone.", "",
             "## What the papers claim, and what this study measured", "",
             "Each claim states the regime its comparison needs; a claim outside it is reported as its measured "
             "effect (95% CI, raw p), \"out of regime at this budget\", never as agreeing or contradicting. The "
             "claims in regime are one family: Holm's step-down correction over their p-values, and a claim is "
             f"decided only where its adjusted p is below {ALPHA}. Where the paper reports its effect on the "
             "measure a claim in regime compares (its numbers are in the setting column), a one-sided paired "
             "t-test asks whether an effect that large is excluded here; those tests are a Holm family of their "
             "own. An excluded size says the effect here is smaller than the paper's, at this budget and scale: "
             "not that the direction is wrong.", "",
             *claims(rows, settings)]
    earlier = read_json(Path(cfg.compare_with)) if cfg.compare_with else None
    if earlier:
        lines += ["", f"### The same rules applied to the earlier study `{cfg.compare_with}`", "",
                  "Its rows have no gate (measured before it), so every claim on pretrained rows is out of regime "
                  "there: the rules, not its numbers, changed.", "",
                  *claims_versus(rows, earlier["results"], "earlier", settings)]
    return lines


def mp3_lines(rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """MP3: fine-tuning PE (Table 3) and masking ratio (Figs. 3, 6), with the eta curves (:func:`eta_table`)."""
    lines = ["", "## MP3: fine-tuning PE (Table 3) and masking ratio (Figs. 3, 6)", "",
             *table(rows, ["mp3", *group_rows("mp3_pe"), "supervised", "mp3_eta0", "mp3_eta0.75"],
                    [("fine-tune PE", "finetune_pe", False), ("top-1", "top1", True),
                     ("linear probe", "linear_probe", True),
                     ("position acc. (train eta)", "position_accuracy", True),
                     ("consistency@0.15", "consistency", True)])]
    eta = eta_table(rows)
    if eta:
        lines += ["", "MP3 position top-1 vs evaluation eta (Fig. 3: the paper's rows are train eta 0 and 0.75):", "",
                  *eta]
    return lines


def droppos_lines(rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """DropPos: gamma (Table 1), sigma (Table 3), tau (Table 4), and the main run's position-accuracy grid."""
    lines = ["", "## DropPos: gamma (Table 1), sigma (Table 3), tau (Table 4)", "",
             *table(rows, ["droppos", *group_rows("droppos")],
                    [("top-1", "top1", True), ("linear probe", "linear_probe", True),
                     ("position acc. (grid mean)", "position_accuracy", True)])]
    if "droppos" in rows and "droppos_grid" in rows["droppos"][0]:
        grid = rows["droppos"][0]["droppos_grid"]
        cells = {tuple(float(p.split("=")[1]) for p in k.split(",")): v for k, v in grid.items() if k != "mean"}
        gammas, gposes = sorted({g for g, _ in cells}), sorted({p for _, p in cells})
        lines += ["", "DropPos position accuracy grid of the main run (rows gamma, columns gamma_pos):", "",
                  "| gamma \\ gamma_pos | " + " | ".join(str(p) for p in gposes) + " |",
                  "|" + " --- |" * (len(gposes) + 1)]
        lines += [f"| {g} | " + " | ".join(f"{cells[(g, p)] * 100:.1f}" for p in gposes) + " |" for g in gammas]
    return lines


def stop_lines(rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """StoP vs I-JEPA: linear probes with 100% and 1% of the labels (StoP Tables 1, 6)."""
    return ["", "## StoP vs I-JEPA (sigma = 0): linear probe with 100% and 1% of the labels (Tables 1, 6)", "",
            *table(rows, ["ijepa", "stop"], [("linear probe, all-label probe set", "linear_probe", True),
                                             ("linear probe, 1% of the train labels", "linear_probe@0.01", True),
                                             ("linear probe, 1% of the probe set", "linear_probe_1pct", True),
                                             ("kNN", "knn", True), ("fine-tuned top-1", "top1", True)])]


def mjp_lines(rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """MJP: training gamma (Table 3), consistency (Fig. 3) and, where it ran, gradient inversion (Table 5)."""
    lines = ["", "## MJP: training gamma (Table 3) and consistency vs evaluation gamma (Fig. 3)", "",
             *table(rows, ["supervised", "mjp_gamma0", "mjp_gamma0.03", "mjp", "mjp_gamma0.27"],
                    [("top-1", "top1", True), ("consistency@0.15", "consistency", True),
                     ("Diff. Norm@0.15", "diff_norm", False)])]
    setup = next((m["privacy_setup"] for n in PRIVACY_RUNS for m in rows.get(n, []) if "privacy_setup" in m), None)
    if setup:
        lines += ["", "## MJP: gradient inversion (Table 5, Fig. 5)", "",
                  f"One test image per class ({setup['images']} images), one image per client update, jigsaw "
                  f"gamma {setup['ratio']} for (b) / (c). Attacks: APRIL's closed form (MJP App. G Eq. 9; needs a "
                  f"learned PE) and gradient matching (cosine distance + TV, Adam, {setup['steps']} steps, known "
                  "labels); `random` scores uniform noise against the same targets. The supervised ViT and the ViT "
                  "without PE see x~ without an unknown PE (they were not trained with one); MJP gets its unknown "
                  "PE on the shuffled positions, as in training. Privacy is better with higher MSE and lower PSNR, "
                  "SSIM and FFT2D (cosine similarity of the |FFT2| spectra).", "", *privacy_table(rows)]
    return lines


def randsac_lines(rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """RandSAC: serialization and segments (Tables 2, 5, 7)."""
    return ["", "## RandSAC: serialization and segments (Tables 2, 5, 7)", "",
            *table(rows, ["randsac_raster", "randsac_patch_random", "randsac_square", "randsac_blob_flat", "randsac"],
                   [("linear probe", "linear_probe", True), ("kNN", "knn", True), ("fine-tuned top-1", "top1", True)])]


def speech_section(rows: dict[str, list[dict[str, Any]]], corpus: str) -> list[str]:
    """Speech: keyword spotting (MP3 Table 5), and what its corpus is (:func:`speech_lines`)."""
    lines = ["", "## Speech: keyword spotting, 12 classes, ~70K-parameter Transformer (MP3 Table 5)", "",
             *table(rows, group_rows("speech"), [("pretrain ep", "pretrain_epochs", False),
                                                 ("fine-tune ep", "finetune_epochs", False),
                                                 ("test top-1", "top1", True), ("linear probe", "linear_probe", True)])]
    if any(n in rows for n in group_rows("speech")):
        lines += speech_lines(rows, corpus)
    return lines


def closing_lines(rows: dict[str, list[dict[str, Any]]], figures: list[str], minutes: dict[str, Any]) -> list[str]:
    """The corruptions that failed, the figures, the wall-clock per part and the rows not run."""
    lines = []
    failed = sorted({f for ms in rows.values() for m in ms for f in m.get("corruptions_failed", [])})
    if failed:
        lines += ["", f"Corruptions that failed in this environment (not in mCE): {', '.join(failed)}."]
    lines += [""] + [f"![{f}]({f})" for f in figures]
    spent = wall_clock(minutes)
    if spent:
        lines += ["", "## Wall-clock per part (minutes of the finished stages)", "", *spent]
    missing = [r.name for r in RUNS if r.name not in rows]
    if missing:
        lines += ["", f"Not run (yet): {', '.join(missing)}."]
    return lines


def markdown(cfg: StudyConfig, rows: dict[str, list[dict[str, Any]]], figures: list[str], hardware: str,
             minutes: dict[str, Any], controls: dict[str, Any] | None = None,
             curve_lines: list[str] | None = None, train_images: int | None = None, speech_corpus: str = "") -> str:
    """The study's ``results/<name>.md``: one function per section, in the order the report reads."""
    settings = {"pre": f"{cfg.pretrain_epochs:g}", "ft": f"{cfg.finetune_epochs:g}",
                "total": f"{cfg.pretrain_epochs + cfg.finetune_epochs:g}", "speech_corpus": speech_corpus}
    lines = [*header_lines(cfg, hardware), *learned_lines(cfg, rows, controls, curve_lines), *main_lines(cfg, rows),
             *label_lines(cfg, rows, train_images), *claim_lines(cfg, rows, settings), *mp3_lines(rows),
             *droppos_lines(rows), *stop_lines(rows), *mjp_lines(rows), *randsac_lines(rows),
             *speech_section(rows, speech_corpus), *closing_lines(rows, figures, minutes)]
    return "\n".join(lines) + "\n"


def commands_so_far(cfg: StudyConfig, argv: list[str]) -> list[str]:
    """The study commands whose rows the report holds: those of an earlier ``study.json`` at this budget, then this
    one (``--report-only`` measures nothing and is not recorded)."""
    earlier = read_json(Path(cfg.results) / f"{cfg.name}.json") or {}
    commands = [] if budget_changes(earlier, cfg) else list(earlier.get("commands", []))
    if "--report-only" not in argv:
        command = "python pipelines/study.py " + " ".join(argv)
        commands = [c for c in commands if c != command] + [command]
    return commands


def train_images(cfg: StudyConfig) -> int | None:
    """The training images left after the hold-out (what pretraining saw), from the train manifest."""
    path = Path(cfg.fashion_mnist) / "train"
    return Manifest.load(path).num_samples - cfg.holdout if (path / "manifest.json").is_file() else None


def speech_corpus(cfg: StudyConfig) -> str:
    """The speech corpus's name (its train manifest's dataset, else the directory's name)."""
    path = Path(cfg.spoken_keywords) / "train"
    return Manifest.load(path).dataset if (path / "manifest.json").is_file() else Path(cfg.spoken_keywords).name


def report(cfg: StudyConfig, argv: list[str]) -> str:
    if cfg.protocol:  # a pre-registered protocol decides the report
        return protocol_report(cfg, argv)
    study = Study(cfg)
    out = Path(cfg.results)
    out.mkdir(parents=True, exist_ok=True)
    rows = collect(study)
    controls, curves = controls_of(study), curves_of(study)
    curve_lines, curve_figure = curves_section(curves, out, cfg.name)
    figures = curve_figure + plots(rows, out, cfg.name) + privacy_figure(study, out, rows)
    hardware = hardware_line()
    earlier_hardware = earlier_study(cfg).get("hardware", "").split("; earlier rows: ")[-1]
    if earlier_hardware and earlier_hardware != hardware:
        hardware += f"; earlier rows: {earlier_hardware}"
    minutes = stage_minutes(study)
    text = markdown(cfg, rows, figures, hardware, minutes, controls, curve_lines, train_images(cfg),
                    speech_corpus(cfg))
    payload = {"harness": HARNESS_VERSION, "commands": commands_so_far(cfg, argv), "config": asdict(cfg),
               "hardware": hardware, "precision": resolve_precision(cfg.precision).record(),
               "python": platform.python_version(), "torch": torch.__version__,
               "runs": {r.name: {"group": r.group, "label": r.label, "config": r.config,
                                 "objective": list(r.objective), "finetune_pe": r.finetune_pe,
                                 "pretrain_from": r.pretrain_from} for r in RUNS},
               "results": rows, "controls": controls, "curves": curves, "wall_clock": minutes,
               # the corpora the controls and curves were measured on (each row records its own)
               "corpora": study_corpora(cfg),
               # every claim with its regime, raw and Holm-adjusted p, and verdict (the table's numbers)
               "claims": [{**asdict(c), "verdict": c.verdict} for c in claim_items(rows, {
                   "speech_corpus": speech_corpus(cfg)})],
               "label_efficiency": [{**asdict(c), "verdict": c.verdict} for c in label_items(
                   rows, tuple(cfg.label_fractions)).values()]}
    write_json_atomic(out / f"{cfg.name}.json", payload)  # two study processes may finish at once
    with atomic_file(out / f"{cfg.name}.md") as tmp:
        tmp.write_text(text)
    return text


# --------------------------------------------------------------------------- a pre-registered protocol's report
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
        holm_over = f"Holm over {len(tested) + len(pending)}: these {len(tested)} and the {len(pending)} pending at " \
            "p = 1, an upper bound on each adjusted p, so a verdict reached now stands" if pending else \
            f"Holm over these {len(tested)}"
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


def protocol_report(cfg: StudyConfig, argv: list[str]) -> str:
    """The report of a pre-registered protocol (``cfg.protocol``): its hash and commit, the rows it refuses (one
    line each, also printed), the position rows against their ceilings, the doubling decisions, the claims family
    by family, what it does not run; ``results/<name>.{json,md}``."""
    protocol = load_protocol(cfg.protocol)
    commit = protocol_commit(protocol.path)
    study, out = Study(cfg), Path(cfg.results)
    out.mkdir(parents=True, exist_ok=True)
    measured = collect(study)
    rows, refused = refusals(measured, protocol.sha256, commit, protocol.path.resolve().parent)
    for line in refused:
        print(f"[study] {line}", flush=True)
    patch = cfg.patch_size or protocol.patch_size
    items = protocol_items(rows, protocol, {"speech_corpus": speech_corpus(cfg), "patch_size": patch})
    decisions = decisions_of(cfg)
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
             "## Not run in this version", "",
             *[f"- {n['claim']}: {n['why']}" for n in protocol.data.get("not_run", [])], ""]
    if any(gate_budgets(rows, r.name) for r in RUNS):
        lines += ["## The learned gate (validation split)", "", *gate_table(rows), ""]
    spent = wall_clock(stage_minutes(study))
    if spent:
        lines += ["## Wall-clock per part (minutes of the finished stages)", "", *spent, ""]
    payload = {"harness": HARNESS_VERSION, "commands": commands_so_far(cfg, argv), "config": asdict(cfg),
               "protocol": {"path": str(protocol.path), "sha256": protocol.sha256,
                            "commit": commit.sha if commit else None, "dirty": commit.dirty if commit else None},
               "hardware": hardware_line(), "results": measured, "refused": refused, "decisions": decisions,
               "claims": [{**asdict(c), "verdict": c.verdict} for c in items], "corpora": study_corpora(cfg),
               "wall_clock": stage_minutes(study)}
    write_json_atomic(out / f"{cfg.name}.json", payload)
    text = "\n".join(lines) + "\n"
    with atomic_file(out / f"{cfg.name}.md") as tmp:
        tmp.write_text(text)
    return text
