"""The papers' claims against the study's numbers: seed-paired differences decided by a two-sided paired t-test
over seeds at alpha = 0.05 (on-par claims by an equivalence test, TOST, with the margin stated), reported with the
95% CI and p (agrees / **contradicts** / undecided / not run), plus the small statistics helpers the tables
share and :func:`random_key` (the random-init control a row is read against; controls.py's report uses it too)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from patchplace.research.reproduction.plan import RUNS, fraction_key


def stat(metrics: list[dict[str, Any]], key: str, pct: bool = True) -> str:
    values = [m[key] for m in metrics if m.get(key) is not None]
    if not values:
        return "-"
    scale, digits = (100, 1) if pct else (1, 2)
    mean = statistics.mean(values) * scale
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(values) * scale:.{digits}f}"


def mean_of(rows: dict[str, list[dict[str, Any]]], name: str, key: str) -> float | None:
    values = [m[key] for m in rows.get(name, []) if m.get(key) is not None]
    return statistics.mean(values) if values else None


def random_key(controls: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The random-init control a method's rows are read against: the one of their architecture and feature
    (``probe_pos_embed`` / ``probe_feature``, recorded by the probes), else of their feature, else the default."""
    pairs = {(r.get("probe_pos_embed"), r.get("probe_feature")) for r in rows}
    pos_embed, feature = pairs.pop() if len(pairs) == 1 else (None, None)
    for key in (f"random_linear@{pos_embed}/{feature}", f"random_linear@{feature}"):
        if feature and key in controls:
            return key
    return "random_linear"


def seeds_of(metrics: list[dict[str, Any]]) -> str:
    return ",".join(str(m["seed"]) for m in metrics)


Value = Callable[[dict[str, Any]], float | None]


def per_seed(rows: dict[str, list[dict[str, Any]]], name: str, value: Value | str) -> dict[int, float]:
    """{seed: value} of one run; ``value`` is a metric key or a function of a seed's metrics."""
    get = (lambda m: m.get(value)) if isinstance(value, str) else value
    return {m["seed"]: v for m in rows.get(name, []) if (v := get(m)) is not None}


PRIVACY_RUNS = [r.name for r in RUNS if r.privacy]
PRIVACY_METRICS = (("MSE", "mse", 4), ("PSNR dB", "psnr", 2), ("SSIM", "ssim", 3), ("FFT2D", "fft2d", 3))


def privacy_metric(attack: str, setting: str, key: str) -> Value:
    """A seed's privacy ``key`` (mse / psnr / ssim / fft2d) for one attack and Table 5 setting, or None."""
    return lambda m: m.get("privacy", {}).get(attack, {}).get(setting, {}).get(key)


ALPHA = 0.05  # a claim is decided by a paired test over seeds at this level, never by a rule of thumb


@dataclass
class PairedTest:
    """A two-sided paired t-test of ours - other over the seeds both have, with the 95% confidence interval of the
    mean difference (Student's t, n - 1 degrees of freedom)."""

    seeds: list[int]
    mean: float
    low: float  # 95% CI
    high: float
    p: float | None  # None with one seed (no test)

    def interval(self, level: float) -> tuple[float, float]:
        """The ``level`` confidence interval of the mean difference (the TOST at alpha uses 1 - 2 alpha)."""
        if len(self.seeds) < 2:
            return -math.inf, math.inf
        half = (self.high - self.mean) / _t_quantile(0.975, len(self.seeds) - 1) * _t_quantile(
            0.5 + level / 2, len(self.seeds) - 1)
        return self.mean - half, self.mean + half


def _t_quantile(q: float, df: int) -> float:
    from scipy.stats import t

    return float(t.ppf(q, df))


def paired_test(ours: dict[int, float], other: dict[int, float]) -> PairedTest | None:
    """The paired t-test of ``ours`` - ``other`` on their shared seeds (None without a shared seed)."""
    from scipy.stats import t

    seeds = sorted(ours.keys() & other.keys())
    if not seeds:
        return None
    deltas = [ours[s] - other[s] for s in seeds]
    mean = statistics.mean(deltas)
    if len(deltas) < 2:
        return PairedTest(seeds, mean, -math.inf, math.inf, None)
    se = statistics.stdev(deltas) / math.sqrt(len(deltas))
    if se == 0:  # every seed the same difference: decided unless it is 0
        return PairedTest(seeds, mean, mean, mean, 0.0 if mean else 1.0)
    half = _t_quantile(0.975, len(deltas) - 1) * se
    p = float(2 * t.sf(abs(mean / se), len(deltas) - 1))
    return PairedTest(seeds, mean, mean - half, mean + half, p)


def _test_text(test: PairedTest, scale: float, unit: str) -> str:
    n = len(test.seeds)
    if test.p is None:
        return f"{test.mean * scale:+.1f} {unit}, 1 seed: no test"
    return (f"{test.mean * scale:+.1f} {unit}, 95% CI [{test.low * scale:+.1f}, {test.high * scale:+.1f}], "
            f"p = {test.p:.2g}, {n} seeds")


def verdict(ours: dict[int, float], other: dict[int, float], paper_says_higher: bool, scale: float = 100,
            unit: str = "pt") -> str:
    """Our seed-paired difference against the paper's direction, decided by a two-sided paired t-test at
    :data:`ALPHA` (agrees / **contradicts**), else "undecided" with its CI, p and seed count."""
    if not ours or not other:
        return "not run"
    test = paired_test(ours, other)
    if test is None:
        return "undecided (no shared seed: unpaired)"
    text = _test_text(test, scale, unit)
    if test.p is None or test.p >= ALPHA:
        return f"undecided ({text})"
    return f"{'agrees' if (test.mean > 0) == paper_says_higher else '**contradicts**'} ({text})"


def on_par(ours: dict[int, float], other: dict[int, float], margin: float = 0.01, scale: float = 100,
           unit: str = "pt") -> str:
    """A claim that two numbers match, decided by an equivalence test (TOST at :data:`ALPHA`: the 90% CI of the
    paired difference inside +-``margin``, stated in the verdict): agrees; **contradicts** when the 95% CI lies
    wholly outside +-``margin``; else undecided."""
    if not ours or not other:
        return "not run"
    test = paired_test(ours, other)
    if test is None:
        return "undecided (no shared seed: unpaired)"
    low, high = test.interval(1 - 2 * ALPHA)
    text = f"{_test_text(test, scale, unit)}; margin +-{margin * scale:g} {unit}"
    if -margin < low and high < margin:
        return f"agrees (equivalent: 90% CI [{low * scale:+.1f}, {high * scale:+.1f}] {unit}; {text})"
    if test.p is not None and (test.low > margin or test.high < -margin):
        return f"**contradicts** ({text})"
    return f"undecided ({text})"


# Rows trained with labels (no pretrained features to control): always "learned".
SUPERVISED_ROWS = {r.name for r in RUNS if r.classifier_only}


def learned_status(rows: dict[str, list[dict[str, Any]]], name: str, controls: dict[str, Any] | None,
                   fraction: float | None = None) -> str | None:
    """None when ``name``'s pretrained features count as learned where a number is read: its linear probe on the
    ``fraction`` label subset (None: the all-label probe set) beats the random-init control's on the same images,
    of the same architecture and feature (the row's ``probe_pos_embed`` / ``probe_feature``), by more than the seed
    spread (the larger std over seeds); else "not learned at this budget (...)". A control without that column is
    read on the probe set. Rows trained with labels, speech rows (no image control) and a study without controls
    are not gated."""
    run = next((r for r in RUNS if r.name == name), None)
    if controls is None or run is None or run.speech or name in SUPERVISED_ROWS:
        return None
    source = run.pretrain_from or name
    measured = controls.get("controls", {})  # the random init of the row's architecture and feature, if measured
    control = measured.get(random_key(measured, rows.get(source, [])), {})
    column, metric, where = "probe_set", "linear_probe", ""
    if fraction is not None and control.get(f"{fraction:g}"):
        column, metric, where = f"{fraction:g}", fraction_key("linear_probe", fraction), f" at {fraction:.0%}"
    values = list(per_seed(rows, source, metric).values())
    if not control.get(column) or not values:
        return None
    mean, sd = statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0
    c_mean = statistics.mean(control[column])
    c_sd = statistics.stdev(control[column]) if len(control[column]) > 1 else 0.0
    spread = max(sd, c_sd)
    if mean - c_mean > spread:
        return None
    return (f"not learned at this budget ({source}{where}: probe {mean * 100:.1f} vs random init "
            f"{c_mean * 100:.1f}, spread {spread * 100:.1f})")


# claims read on a label subset are gated on that subset's probe (the others on the all-label probe set)
GATE_FRACTION = {"StoP Table 6": 0.01}


def claims(rows: dict[str, list[dict[str, Any]]], controls: dict[str, Any] | None = None,
           settings: dict[str, str] | None = None) -> list[str]:
    """Each paper's claim, its setting in the paper vs here, and what this study measured, paired by seed (see
    :func:`verdict`), after a line counting the decided ones. Claims on pretrained rows whose features are not
    learned (:func:`learned_status`) are not read."""
    items = claim_items(rows, controls)
    settings = settings or {}
    lines = [decided_line([v for _, _, v in items]), "",
             "| claim (paper) | paper's setting -> this study's | this study |", "| --- | --- | --- |"]
    return lines + [f"| {c} | {w.format(**settings) if settings else w} | {v} |" for c, w, v in items]


def claims_versus(rows: dict[str, list[dict[str, Any]]], earlier: dict[str, list[dict[str, Any]]],
                  earlier_name: str, controls: dict[str, Any] | None = None) -> list[str]:
    """The claims table of an earlier study's rows (judged by the same test, without its controls) beside this
    one's."""
    now, before = claim_items(rows, controls), {c: v for c, _, v in claim_items(earlier)}
    lines = [f"| claim (paper) | {earlier_name} | this study |", "| --- | --- | --- |"]
    lines += [f"| {c} | {before.get(c, 'not run')} | {v} |" for c, _, v in now]
    return [*lines, "", f"{earlier_name}: {decided_line(list(before.values()))}",
            f"This study: {decided_line([v for _, _, v in now])}"]


def claim_items(rows: dict[str, list[dict[str, Any]]],
                controls: dict[str, Any] | None = None) -> list[tuple[str, str, str]]:
    """(claim, paper's setting -> this study's, verdict) per paper claim. The setting text has ``{pre}``,
    ``{ft}``, ``{total}``, ``{seeds}`` fields the report fills in."""
    def m(name: str, key: Value | str) -> dict[int, float]:
        return per_seed(rows, name, key)

    def comparable(a: str, b: str) -> tuple[dict[int, float], dict[int, float]]:
        """Fine-tuned top-1 of both runs, else their linear probes."""
        for key in ("top1", "linear_probe"):
            if m(a, key) and m(b, key):
                return m(a, key), m(b, key)
        return {}, {}

    def one_pct(a: str, b: str) -> tuple[dict[int, float], dict[int, float]]:
        """Linear probes on 1% of the whole train split's labels (label efficiency), else on 1% of the probe's."""
        for key in ("linear_probe@0.01", "linear_probe_1pct"):
            if m(a, key) and m(b, key):
                return m(a, key), m(b, key)
        return {}, {}

    def eta_curve(eta: str) -> Value:
        return lambda r: r.get("mp3_eta_curve", {}).get(eta, {}).get("top1")

    def psnr(attack: str, setting: str) -> Value:
        return privacy_metric(attack, setting, "psnr")

    def psnr_verdict(ours: dict[int, float], other: dict[int, float], paper_says_higher: bool) -> str:
        return verdict(ours, other, paper_says_higher, scale=1, unit="dB PSNR")

    here = "Fashion-MNIST 32 px, `vit_cpu_narrow` (1.2M), {pre} PT"
    items = [
        ("MP3 Table 4 / Fig. 5: MP3 pretraining + fine-tuning beats supervised training of the same ViT at the "
         "same total epochs",
         "ImageNet-1K ViT-B, eta 0.75: 100 PT + 150 FT epochs 83.0 vs 300 supervised 81.8 (Fig. 5: 100 + 60 "
         "already above) -> " + here + " + {ft} FT vs {total} supervised epochs, eta 0.5",
         ("mp3", "supervised"), verdict(m("mp3", "top1"), m("supervised", "top1"), True)),
        ("MP3 Table 3: with MP3 pretraining, 2D relative PE is on par with absolute (84.2 vs 84.0)",
         "CIFAR-100 ViT-S, 2K PT epochs -> " + here + " + {ft} FT; margin 1 pt",
         ("mp3_ft_relbias2d", "mp3"), on_par(m("mp3_ft_relbias2d", "top1"), m("mp3", "top1"))),
        ("MP3 Table 3: MP3 without any PE stays far above supervised without PE (82.6 vs 64.6)",
         "CIFAR-100 ViT-S, 2K PT epochs vs 400 supervised -> " + here + " + {ft} FT vs {total} supervised",
         ("mp3_ft_none", "supervised_nope"), verdict(m("mp3_ft_none", "top1"), m("supervised_nope", "top1"), True)),
        ("MP3 Fig. 3: position accuracy falls as the evaluation eta grows (eval 0.9 vs 0, train eta 0.5)",
         "ImageNet-1K ViT-B -> " + here + ", the pretraining's own head", ("mp3",),
         verdict(m("mp3", eta_curve("0.9")), m("mp3", eta_curve("0.0")), False)),
        ("MP3 Fig. 3: a model trained with eta 0.75 predicts positions better at eval eta 0.75 than one trained "
         "with eta 0", "ImageNet-1K ViT-B -> " + here, ("mp3_eta0.75", "mp3_eta0"),
         verdict(m("mp3_eta0.75", eta_curve("0.75")), m("mp3_eta0", eta_curve("0.75")), True)),
        ("MP3 Fig. 6: an intermediate eta (0.5) fine-tunes better than eta 0 (here: fine-tuned top-1, or the linear "
         "probe when the eta runs were probed only)", "CIFAR-100 ViT-S, 200 PT epochs, fine-tuned -> " + here,
         ("mp3", "mp3_eta0"), verdict(*comparable("mp3", "mp3_eta0"), True)),
        ("DropPos Table 1: gamma 0.75 fine-tunes better than gamma 0.5 (here: fine-tuned top-1, or the linear probe "
         "when the ablation was probed only)", "ImageNet-1K ViT-B, 200 PT epochs, fine-tuned -> " + here,
         ("droppos", "droppos_gamma0.5"), verdict(*comparable("droppos", "droppos_gamma0.5"), True)),
        ("DropPos Table 3: sigma = 0 predicts positions better but fine-tunes worse than sigma 1 -> 0 (position)",
         "ImageNet-1K ViT-B, 200 PT epochs -> " + here + ", mean of the 4 x 4 position grid",
         ("droppos_sigma0", "droppos"),
         verdict(m("droppos_sigma0", "position_accuracy"), m("droppos", "position_accuracy"), True)),
        ("DropPos Table 3: ... (fine-tune, or linear probe)", "as above, fine-tuned -> " + here + ", linear probe",
         ("droppos_sigma0", "droppos"), verdict(*comparable("droppos_sigma0", "droppos"), False)),
        ("DropPos Table 4: tau = inf fine-tunes worse than tau 0.1 (fine-tune, or linear probe)",
         "ImageNet-1K ViT-B, 200 PT epochs, fine-tuned -> " + here + ", linear probe",
         ("droppos_tau_inf", "droppos"), verdict(*comparable("droppos_tau_inf", "droppos"), False)),
        ("StoP Table 1: StoP beats I-JEPA in linear probing (100% of the labels)",
         "ImageNet-1K ViT-B/L/H, 300-600 PT epochs -> " + here + ", probe on 5,000 train images",
         ("stop", "ijepa"), verdict(m("stop", "linear_probe"), m("ijepa", "linear_probe"), True)),
        ("StoP Table 6: ... and with 1% of the labels (a class-balanced 1% of the train split)",
         "ImageNet-1K 1% (~13 images per class) -> " + here + ", 1% = 55 images per class",
         ("stop", "ijepa"), verdict(*one_pct("stop", "ijepa"), True)),
        ("MJP Table 1: MJP is more consistent under a gamma 0.15 jigsaw than the supervised ViT",
         "ImageNet-1K DeiT-S, 300 epochs -> Fashion-MNIST, {total} epochs from scratch, both",
         ("mjp", "supervised"), verdict(m("mjp", "consistency"), m("supervised", "consistency"), True)),
        ("MJP Table 3: larger training gamma -> higher consistency (0.27 vs 0.03)",
         "ImageNet-1K DeiT-S -> Fashion-MNIST, {total} epochs", ("mjp_gamma0.27", "mjp_gamma0.03"),
         verdict(m("mjp_gamma0.27", "consistency"), m("mjp_gamma0.03", "consistency"), True)),
        ("MJP Table 3: top-1 stays flat across training gamma (0.27 vs 0.03, within 1 pt)",
         "as above; margin 1 pt", ("mjp_gamma0.27", "mjp_gamma0.03"),
         on_par(m("mjp_gamma0.27", "top1"), m("mjp_gamma0.03", "top1"))),
        ("MJP Table 5: APRIL recovers less from MJP's update on x~ (b) than from the supervised ViT's on x (a)",
         "ImageNet ViT-B updates -> one-image updates of the Fashion-MNIST classifiers", ("mjp_gamma0.27",),
         psnr_verdict(m("mjp_gamma0.27", psnr("analytic", "b")),
                      m("supervised", psnr("analytic", "a")), False)),
        ("MJP Table 5: ... and MJP's reconstruction is further still from the original x (c vs b)", "as above",
         ("mjp_gamma0.27",), psnr_verdict(m("mjp_gamma0.27", psnr("analytic", "c")),
                                          m("mjp_gamma0.27", psnr("analytic", "b")), False)),
        ("MJP Table 5: a ViT without PE leaks more than MJP (setting a; gradient matching, the attack that applies "
         "to both)", "as above", ("supervised_nope", "mjp_gamma0.27"),
         psnr_verdict(m("supervised_nope", psnr("gradient_matching", "a")),
                      m("mjp_gamma0.27", psnr("gradient_matching", "a")), True)),
        ("RandSAC Table 2: random serialization beats raster order (linear probe)",
         "CIFAR-10 ViT, 800 PT epochs -> " + here, ("randsac_patch_random", "randsac_raster"),
         verdict(m("randsac_patch_random", "linear_probe"), m("randsac_raster", "linear_probe"), True)),
        ("RandSAC Table 5: segments (blob) beat patch-random (linear probe)", "CIFAR-10 ViT, 800 PT epochs -> " + here,
         ("randsac_blob_flat", "randsac_patch_random"),
         verdict(m("randsac_blob_flat", "linear_probe"), m("randsac_patch_random", "linear_probe"), True)),
        ("RandSAC Table 7: hierarchical blobs (11 -> 5) beat flat blobs (linear probe)",
         "CIFAR-10 ViT, 1600 PT epochs, normalized pixels -> " + here, ("randsac", "randsac_blob_flat"),
         verdict(m("randsac", "linear_probe"), m("randsac_blob_flat", "linear_probe"), True)),
        ("MP3 Table 5: MP3 pretraining improves the keyword-spotting Transformer",
         "Speech Commands v1, 12 classes, 30K updates each (FT and supervised), early stopping on validation "
         "-> this corpus, as many fine-tuning as supervised updates, early stopping on validation",
         ("speech_mp3",), verdict(m("speech_mp3", "top1"), m("speech_supervised", "top1"), True)),
        ("(control) the null pretraining (1 step) + the same fine-tune is on par with supervised training: the "
         "fine-tuning path itself costs nothing", "not in the paper; margin 1 pt", ("speech_null",),
         on_par(m("speech_null", "top1"), m("speech_supervised", "top1"))),
    ]
    gated = []
    for claim, setting, names, judged in items:
        fraction = next((f for key, f in GATE_FRACTION.items() if claim.startswith(key)), None)
        status = next((st for n in names if (st := learned_status(rows, n, controls, fraction))), None)
        gated.append((claim, setting, status if status and judged != "not run" else judged))
    return gated


def decided_line(verdicts: list[str]) -> str:
    """How many verdicts a paired test at alpha 0.05 decides (agree / contradict) and how many it does not."""
    count = {w: sum(v.startswith(p) for v in verdicts) for w, p in
             (("agree", "agrees"), ("contradict", "**contradicts**"), ("undecided", "undecided"),
              ("not run", "not run"), ("not learned", "not learned"))}
    return (f"Decided {count['agree'] + count['contradict']} of {len(verdicts)} (two-sided paired t-test over seeds "
            f"at alpha = {ALPHA}; on-par claims by TOST): {count['agree']} agree, {count['contradict']} contradict; "
            f"undecided: {count['undecided']}, not read (features not learned at this budget): "
            f"{count['not learned']}, not run at this budget: {count['not run']}.")
