"""The papers' claims against the study's numbers: seed-paired differences decided by a two-sided paired t-test
over seeds at alpha = 0.05 (on-par claims by an equivalence test, TOST, with the margin stated), reported with the
95% CI and p (agrees / **contradicts** / undecided / not run), plus the small statistics helpers the tables
share."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from study_plan import RUNS


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


def claims(rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Each paper's claim beside what this study measured, paired by seed (see :func:`verdict`), after a line
    counting the decided ones."""
    items = claim_items(rows)
    lines = [decided_line([v for _, v in items]), "", "| claim (paper) | this study |", "| --- | --- |"]
    return lines + [f"| {c} | {v} |" for c, v in items]


def claims_versus(rows: dict[str, list[dict[str, Any]]], earlier: dict[str, list[dict[str, Any]]],
                  earlier_name: str) -> list[str]:
    """The claims table of an earlier study's rows (judged by the same rules) beside this one's."""
    now, before = claim_items(rows), dict(claim_items(earlier))
    lines = [f"| claim (paper) | {earlier_name} | this study |", "| --- | --- | --- |"]
    lines += [f"| {c} | {before[c]} | {v} |" for c, v in now]
    return [*lines, "", f"{earlier_name}: {decided_line(list(before.values()))}",
            f"This study: {decided_line([v for _, v in now])}"]


def claim_items(rows: dict[str, list[dict[str, Any]]]) -> list[tuple[str, str]]:
    """(claim, verdict) per paper claim."""
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

    items = [
        ("MP3 Table 3: MP3 pretraining + fine-tuning beats supervised training of the same ViT",
         verdict(m("mp3", "top1"), m("supervised", "top1"), True)),
        ("MP3 Table 3: with MP3 pretraining, 2D relative PE is on par with absolute (84.2 vs 84.0)",
         on_par(m("mp3_ft_relbias2d", "top1"), m("mp3", "top1"))),
        ("MP3 Table 3: MP3 without any PE stays far above supervised without PE (82.6 vs 64.6)",
         verdict(m("mp3_ft_none", "top1"), m("supervised_nope", "top1"), True)),
        ("MP3 Fig. 3: position accuracy falls as the evaluation eta grows (eval 0.9 vs 0, train eta 0.5)",
         verdict(m("mp3", eta_curve("0.9")), m("mp3", eta_curve("0.0")), False)),
        ("MP3 Fig. 3: a model trained with eta 0.75 predicts positions better at eval eta 0.75 than one trained "
         "with eta 0", verdict(m("mp3_eta0.75", eta_curve("0.75")), m("mp3_eta0", eta_curve("0.75")), True)),
        ("MP3 Fig. 6: an intermediate eta (0.5) fine-tunes better than eta 0 (here: fine-tuned top-1, or the linear "
         "probe when the eta runs were probed only)", verdict(*comparable("mp3", "mp3_eta0"), True)),
        ("DropPos Table 1: gamma 0.75 fine-tunes better than gamma 0.5 (here: fine-tuned top-1, or the linear probe "
         "when the ablation was probed only)", verdict(*comparable("droppos", "droppos_gamma0.5"), True)),
        ("DropPos Table 3: sigma = 0 predicts positions better but fine-tunes worse than sigma 1 -> 0 (position)",
         verdict(m("droppos_sigma0", "position_accuracy"), m("droppos", "position_accuracy"), True)),
        ("DropPos Table 3: ... (fine-tune, or linear probe)",
         verdict(*comparable("droppos_sigma0", "droppos"), False)),
        ("DropPos Table 4: tau = inf fine-tunes worse than tau 0.1 (fine-tune, or linear probe)",
         verdict(*comparable("droppos_tau_inf", "droppos"), False)),
        ("StoP Table 1: StoP beats I-JEPA in linear probing (100% of the labels)",
         verdict(m("stop", "linear_probe"), m("ijepa", "linear_probe"), True)),
        ("StoP Table 6: ... and with 1% of the labels (a class-balanced 1% of the train split)",
         verdict(*one_pct("stop", "ijepa"), True)),
        ("MJP Table 1: MJP is more consistent under a gamma 0.15 jigsaw than the supervised ViT",
         verdict(m("mjp", "consistency"), m("supervised", "consistency"), True)),
        ("MJP Table 3: larger training gamma -> higher consistency (0.27 vs 0.03)",
         verdict(m("mjp_gamma0.27", "consistency"), m("mjp_gamma0.03", "consistency"), True)),
        ("MJP Table 3: top-1 stays flat across training gamma (0.27 vs 0.03, within 1 pt)",
         on_par(m("mjp_gamma0.27", "top1"), m("mjp_gamma0.03", "top1"))),
        ("MJP Table 5: APRIL recovers less from MJP's update on x~ (b) than from the supervised ViT's on x (a)",
         psnr_verdict(m("mjp_gamma0.27", psnr("analytic", "b")),
                      m("supervised", psnr("analytic", "a")), False)),
        ("MJP Table 5: ... and MJP's reconstruction is further still from the original x (c vs b)",
         psnr_verdict(m("mjp_gamma0.27", psnr("analytic", "c")),
                      m("mjp_gamma0.27", psnr("analytic", "b")), False)),
        ("MJP Table 5: a ViT without PE leaks more than MJP (setting a; gradient matching, the attack that applies "
         "to both)", psnr_verdict(m("supervised_nope", psnr("gradient_matching", "a")),
                                  m("mjp_gamma0.27", psnr("gradient_matching", "a")), True)),
        ("RandSAC Table 2: random serialization beats raster order (linear probe)",
         verdict(m("randsac_patch_random", "linear_probe"), m("randsac_raster", "linear_probe"), True)),
        ("RandSAC Table 5: segments (blob) beat patch-random (linear probe)",
         verdict(m("randsac_blob_flat", "linear_probe"), m("randsac_patch_random", "linear_probe"), True)),
        ("RandSAC Table 7: hierarchical blobs (11 -> 5) beat flat blobs (linear probe)",
         verdict(m("randsac", "linear_probe"), m("randsac_blob_flat", "linear_probe"), True)),
        ("MP3 Table 5: MP3 pretraining improves the keyword-spotting Transformer",
         verdict(m("speech_mp3", "top1"), m("speech_supervised", "top1"), True)),
    ]
    return items


def decided_line(verdicts: list[str]) -> str:
    """How many verdicts a paired test at alpha 0.05 decides (agree / contradict) and how many it does not."""
    count = {w: sum(v.startswith(p) for v in verdicts) for w, p in
             (("agree", "agrees"), ("contradict", "**contradicts**"), ("undecided", "undecided"),
              ("not run", "not run"))}
    return (f"Decided {count['agree'] + count['contradict']} of {len(verdicts)} (two-sided paired t-test over seeds "
            f"at alpha = {ALPHA}; on-par claims by TOST): {count['agree']} agree, {count['contradict']} contradict; "
            f"undecided: {count['undecided']}, not run at this budget: {count['not run']}.")
