"""The statistics the study decides with: seed-paired t-tests with their confidence intervals, Holm's step-down
adjustment, the one-sided Welch test of the learned gate, the one-sided test of "an effect as large as the
paper's", the power of a paired test; and the small helpers that read a row's numbers per seed."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ALPHA = 0.05  # a claim is decided by a paired test over seeds at this level, never by a rule of thumb
MIN_SEEDS = 3  # the gate and every claim in regime need this many seeds
POWER = 0.8  # the power at which the report states the smallest effect a test detects

Value = Callable[[dict[str, Any]], float | None]


def per_seed(rows: dict[str, list[dict[str, Any]]], name: str, value: Value | str) -> dict[int, float]:
    """{seed: value} of one run; ``value`` is a metric key or a function of a seed's metrics."""
    get = (lambda m: m.get(value)) if isinstance(value, str) else value
    return {m["seed"]: v for m in rows.get(name, []) if (v := get(m)) is not None}


def seeds_of(metrics: list[dict[str, Any]]) -> str:
    return ",".join(str(m["seed"]) for m in metrics)


def random_key(controls: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The random-init control a method's rows are read against: the one of their architecture and feature
    (``probe_pos_embed`` / ``probe_feature``, recorded by the probes), else of their feature, else the default."""
    pairs = {(r.get("probe_pos_embed"), r.get("probe_feature")) for r in rows}
    pos_embed, feature = pairs.pop() if len(pairs) == 1 else (None, None)
    for key in (f"random_linear@{pos_embed}/{feature}", f"random_linear@{feature}"):
        if feature and key in controls:
            return key
    return "random_linear"


@dataclass
class PairedTest:
    """A two-sided paired t-test of ours - other over the seeds both have, with the 95% confidence interval of the
    mean difference (Student's t, n - 1 degrees of freedom)."""

    seeds: list[int]
    mean: float
    low: float  # 95% CI
    high: float
    p: float | None  # None with one seed (no test)

    @property
    def se(self) -> float:
        """The standard error of the mean difference (from the 95% CI; needs >= 2 seeds)."""
        return (self.high - self.mean) / _t_quantile(0.975, len(self.seeds) - 1)

    def interval(self, level: float) -> tuple[float, float]:
        """The ``level`` confidence interval of the mean difference (a TOST at alpha uses 1 - 2 alpha: the bf16
        equivalence benchmark's)."""
        if len(self.seeds) < 2:
            return -math.inf, math.inf
        half = self.se * _t_quantile(0.5 + level / 2, len(self.seeds) - 1)
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


def effect_text(test: PairedTest, scale: float = 100, unit: str = "pt") -> str:
    """The measured effect: mean paired difference, its 95% CI and the seed count."""
    n = len(test.seeds)
    if test.p is None:
        return f"{test.mean * scale:+.1f} {unit}, 1 seed: no test"
    return f"{test.mean * scale:+.1f} {unit}, 95% CI [{test.low * scale:+.1f}, {test.high * scale:+.1f}], {n} seeds"


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjustment of a family of p-values (same order): the k-th smallest is multiplied by
    (m - k + 1), made monotone, capped at 1. Controls the family-wise error rate at alpha."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def welch_greater(ours: list[float], control: list[float]) -> float | None:
    """One-sided Welch t-test p that ``ours`` is above ``control`` (unequal variances), or None with fewer than
    :data:`MIN_SEEDS` values on either side (the gate fails closed)."""
    from scipy.stats import ttest_ind

    if min(len(ours), len(control)) < MIN_SEEDS:
        return None
    if len(set(ours)) == 1 and len(set(control)) == 1:  # no spread on either side: decided by the means alone
        return 0.0 if ours[0] > control[0] else 1.0
    return float(ttest_ind(ours, control, equal_var=False, alternative="greater").pvalue)


def below_paper_p(test: PairedTest, paper_says_higher: bool, paper_effect: float) -> float | None:
    """One-sided paired t-test p of H0 "the mean difference, signed in the paper's direction, is at least the
    paper's effect": small where the effect here is excluded from reaching the paper's size."""
    from scipy.stats import t

    if test.p is None:
        return None
    signed = test.mean if paper_says_higher else -test.mean
    if test.se == 0:
        return 0.0 if signed < paper_effect else 1.0
    return float(t.cdf((signed - paper_effect) / test.se, len(test.seeds) - 1))


def power(test: PairedTest, effect: float) -> float:
    """The power of this two-sided paired t-test at :data:`ALPHA` to detect a true difference ``effect`` (the
    noncentral t at the measured standard error and the same seeds)."""
    from scipy.stats import nct, t

    df = len(test.seeds) - 1
    critical, shift = float(t.ppf(1 - ALPHA / 2, df)), abs(effect) / test.se
    lower = float(nct.cdf(-critical, df, shift))  # the wrong-sign tail: ~0, and NaN in scipy far out
    return float(nct.sf(critical, df, shift)) + (0.0 if math.isnan(lower) else lower)


def detectable(test: PairedTest, level: float = POWER) -> float:
    """The smallest true difference this paired test detects with power ``level`` (same seeds, same spread)."""
    from scipy.optimize import brentq

    return float(brentq(lambda d: power(test, d) - level, 1e-9 * test.se, 10 * test.se))
