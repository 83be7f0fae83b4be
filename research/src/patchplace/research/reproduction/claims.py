"""The papers' claims against the study's numbers.

The claims are data: :data:`PAPER_CLAIMS`, one frozen :class:`ClaimSpec` per claim (its paper and table, the rows
and measure it compares, its regime and how that is checked, its test, the paper's effect), built into
:class:`Claim` items in one loop (:func:`claim_items`). Each claim states the regime its comparison needs
(:class:`Claim`: e.g. the rows' features learned by the gate, the pretext task learned above a stated level,
fine-tuning as long as the paper's figure needs); a claim outside it reads "out of regime at this budget" with its
measured effect, CI and raw p, never a verdict. The claims in regime form one family: each is tested by a two-sided
paired t-test over seeds (on-par claims by TOST with the margin stated; MP3 Fig. 3's peak by an intersection-union
test), their p-values Holm-adjusted (:func:`holm`), and a claim is decided (agrees / **contradicts**) only where its
adjusted p is below alpha = 0.05.

The learned gate (:func:`gate`): a pretrained row's frozen features count as learned where a one-sided Welch
t-test over >= 3 seeds finds their linear probe on the validation split above the random init of the same
architecture and feature (same seeds, same images) at alpha 0.05; it fails closed (a missing control or fewer
seeds is "not learned"). Also the small statistics helpers the tables share and :func:`random_key` (the random-init
control a test-split row is shown beside; controls.py's report uses it too)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from patchplace.research.reproduction.plan import RUNS, fraction_key
from patchplace.research.reproduction.protocol import Protocol, logit, pairing_problem, paper_log_odds


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

    @property
    def se(self) -> float:
        """The standard error of the mean difference (from the 95% CI; needs >= 2 seeds)."""
        return (self.high - self.mean) / _t_quantile(0.975, len(self.seeds) - 1)

    def interval(self, level: float) -> tuple[float, float]:
        """The ``level`` confidence interval of the mean difference (the TOST at alpha uses 1 - 2 alpha)."""
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


def _test_text(test: PairedTest, scale: float, unit: str) -> str:
    n = len(test.seeds)
    if test.p is None:
        return f"{test.mean * scale:+.1f} {unit}, 1 seed: no test"
    return (f"{test.mean * scale:+.1f} {unit}, 95% CI [{test.low * scale:+.1f}, {test.high * scale:+.1f}], "
            f"p = {test.p:.2g}, {n} seeds")


def effect_text(test: PairedTest, scale: float = 100, unit: str = "pt") -> str:
    """The measured effect: mean paired difference, its 95% CI and the seed count."""
    n = len(test.seeds)
    if test.p is None:
        return f"{test.mean * scale:+.1f} {unit}, 1 seed: no test"
    return f"{test.mean * scale:+.1f} {unit}, 95% CI [{test.low * scale:+.1f}, {test.high * scale:+.1f}], {n} seeds"


def tost(ours: dict[int, float], other: dict[int, float], margin: float) -> tuple[PairedTest | None, float | None]:
    """Two one-sided paired t-tests of ``ours`` - ``other`` against +-``margin`` (TOST): (the paired test, the TOST
    p = the larger one-sided p), or a None p with fewer than two shared seeds."""
    from scipy.stats import t

    test = paired_test(ours, other)
    if test is None or test.p is None:
        return test, None
    n, se = len(test.seeds), test.se
    if se == 0:
        return test, 0.0 if abs(test.mean) < margin else 1.0
    lower = float(t.sf((test.mean + margin) / se, n - 1))  # H0: diff <= -margin
    upper = float(t.cdf((test.mean - margin) / se, n - 1))  # H0: diff >= +margin
    return test, max(lower, upper)


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


# ------------------------------------------------------------------------------------------------ the learned gate
MIN_SEEDS = 3  # the gate and every claim in regime need this many seeds


def welch_greater(ours: list[float], control: list[float]) -> float | None:
    """One-sided Welch t-test p that ``ours`` is above ``control`` (unequal variances), or None with fewer than
    :data:`MIN_SEEDS` values on either side (the gate fails closed)."""
    from scipy.stats import ttest_ind

    if min(len(ours), len(control)) < MIN_SEEDS:
        return None
    if len(set(ours)) == 1 and len(set(control)) == 1:  # no spread on either side: decided by the means alone
        return 0.0 if ours[0] > control[0] else 1.0
    return float(ttest_ind(ours, control, equal_var=False, alternative="greater").pvalue)


@dataclass
class Gate:
    """The learned gate of one row at one budget (pretraining epochs)."""

    passed: bool
    text: str
    p: float | None = None


def _budget_key(m: dict[str, Any]) -> str | None:
    epochs = m.get("pretrain_epochs")
    return f"{epochs:g}" if isinstance(epochs, int | float) else None


def gate(rows: dict[str, list[dict[str, Any]]], name: str, budget: str | None = None) -> Gate:
    """Whether ``name``'s pretrained features are learned at ``budget`` (default: its own pretraining epochs): a
    one-sided Welch t-test (``scipy.stats.ttest_ind(equal_var=False, alternative="greater")``) of its linear probe
    on the validation split against the random init of the same architecture and feature on the same seeds, over
    >= :data:`MIN_SEEDS` seeds, at :data:`ALPHA`. Fails closed: a row without the gate's numbers (e.g. merged from
    a study before the gate) or with fewer seeds is not learned."""
    measured = [m for m in rows.get(name, []) if m.get("gate")]
    probes, randoms = [], []
    for m in measured:
        key = budget or _budget_key(m)
        if key in m["gate"]["probe"]:
            probes.append(m["gate"]["probe"][key])
            randoms.append(m["gate"]["random"])
    epochs = budget or next((k for m in rows.get(name, []) if (k := _budget_key(m))), "?")
    where = f"{name} at {epochs} PT epochs"
    if len(probes) < MIN_SEEDS:
        return Gate(False, f"gate not measured: {where} has {len(probes)} seed(s) with a validation probe and its "
                           f"random-init control, {MIN_SEEDS} needed")
    p = welch_greater(probes, randoms)
    text = (f"{where}: validation probe {statistics.mean(probes) * 100:.1f} vs random init "
            f"{statistics.mean(randoms) * 100:.1f}, one-sided Welch p = {p:.2g}, {len(probes)} seeds")
    return Gate(p < ALPHA, text, p)


def gate_budgets(rows: dict[str, list[dict[str, Any]]], name: str) -> list[str]:
    """The budgets (pretraining epochs, ascending) at which ``name``'s gate was measured on every seed."""
    sets = [set(m["gate"]["probe"]) for m in rows.get(name, []) if m.get("gate")]
    return sorted(set.intersection(*sets), key=float) if sets else []


def chosen_budget(rows: dict[str, list[dict[str, Any]]], names: tuple[str, ...]) -> tuple[str | None, list[Gate]]:
    """The budget a claim comparing ``names`` reads: the smallest one at which every row passes the gate (the
    same gate chooses it); else the largest measured, with its failing gates."""
    common = [b for b in gate_budgets(rows, names[0]) if all(b in gate_budgets(rows, n) for n in names[1:])]
    for budget in common:
        gates = [gate(rows, n, budget) for n in names]
        if all(g.passed for g in gates):
            return budget, gates
    budget = common[-1] if common else None
    return budget, [gate(rows, n, budget) for n in names]


def at_budget(rows: dict[str, list[dict[str, Any]]], name: str, key: str, budget: str | None) -> dict[int, float]:
    """{seed: value} of ``key`` at ``budget`` pretraining epochs: the row's own numbers where that is its final
    budget, else those of its ladder snapshot (``budgets``)."""
    out = {}
    for m in rows.get(name, []):
        source = m if budget is None or _budget_key(m) == budget else m.get("budgets", {}).get(budget, {})
        if source.get(key) is not None:
            out[m["seed"]] = source[key]
    return out


# ------------------------------------------------------------------------------------------------------ the claims
# The regimes' stated levels (set from the papers, before the v4 numbers): a position-prediction claim reads a
# pretext task learned to at least half of what the paper's curves start from (MP3 Fig. 3: near 100% at eval eta 0
# for train eta 0; DropPos Table 3: 87.8% at sigma 1 -> 0); MP3 Table 4 / Fig. 5 compare fine-tunes of >= 60 epochs
# (100 + 60 is the shortest schedule Fig. 5 shows above supervised: the PE is learned in fine-tuning).
PRETEXT_LEVEL = 0.5
FINETUNE_EPOCHS_NEEDED = 60.0
CHANCE = 0.1  # a 10-class classifier


@dataclass
class Claim:
    """One paper claim as this study tests it: the numbers, the regime it needs and whether it holds."""

    claim: str
    setting: str  # paper's setting -> this study's (``{pre}``, ``{ft}``, ``{total}`` filled in by the report)
    regime: str  # what the comparison needs to be meaningful, stated beforehand
    in_regime: bool | None  # None: not run
    why: str = ""  # how the regime check came out
    effect: str = ""  # the measured effect (mean, 95% CI, seeds)
    p: float | None = None  # raw p of the claim's test
    agrees: bool | None = None  # the measured direction matches the paper's (None: on-par, or no test)
    seeds: int = 0
    test: str = "paired t"  # paired t | TOST | intersection-union
    adjusted: float | None = None  # Holm-adjusted p within the family of claims in regime
    budget: str | None = None  # the pretraining epochs the claim was read at
    # the paper's own effect on the measure this claim compares, in the paper's direction (None: the paper gives
    # none on this measure, e.g. where a probe stands in for its fine-tune); with it, a one-sided paired t-test of
    # "the effect here is at least the paper's", Holm-adjusted within the claims in regime that carry one
    paper_effect: float | None = None
    scale: float = 100
    unit: str = "pt"
    excluded_p: float | None = None
    excluded_adjusted: float | None = None
    family: str = ""  # a protocol's Holm family (one per question); "": the one family of the claims in regime
    refused: str = ""  # why its rows are not paired (rows from two machine models): no effect, no verdict
    paper_scale: str = "difference"  # difference (scale x unit) | log_odds: the scale of paper_effect
    pending: str = ""  # a protocol's claim whose rows have not all their planned seeds yet ("1 of 5 seeds")

    @property
    def tested(self) -> bool:
        return bool(self.in_regime) and self.p is not None and not self.pending

    @property
    def verdict(self) -> str:
        raw = f"raw p = {self.p:.2g}" if self.p is not None else "no test"
        if self.in_regime is None:
            return "not run"
        if self.refused:
            return f"not paired: {self.refused}"
        if self.pending:  # no test and no regime verdict before every planned seed has run (no optional stopping)
            return f"pending ({self.pending}); so far: {self.why or 'in regime'}; measured {self.effect}"
        if not self.in_regime:  # (a one-seed effect says "no test" itself)
            return f"out of regime at this budget ({self.why}); measured {self.effect}" + (
                f", {raw}" if self.p is not None else "")
        if self.p is None:
            return f"undecided ({self.effect}; {self.why or 'fewer than 2 shared seeds'})"
        text = f"{self.effect}, {raw}, Holm-adjusted p = {self.adjusted:.2g}{self.excluded_text}"
        if self.adjusted is not None and self.adjusted < ALPHA:
            if self.agrees is None:
                return f"agrees ({text})"
            return f"{'agrees' if self.agrees else '**contradicts**'} ({text})"
        return f"undecided ({text})"

    @property
    def paper_excluded(self) -> bool:
        """Whether an effect as large as the paper's is excluded here (its Holm-adjusted one-sided p < alpha)."""
        return self.excluded_adjusted is not None and self.excluded_adjusted < ALPHA

    @property
    def excluded_text(self) -> str:
        if self.excluded_adjusted is None:  # not in the family (decide() sets it)
            return ""
        size = (f"log-odds {self.paper_effect:+.2f}" if self.paper_scale == "log_odds" else
                f"{self.paper_effect * self.scale:+.1f} {self.unit}")
        return (f"; the paper's effect ({size}) {'excluded' if self.paper_excluded else 'not excluded'} here: "
                f"one-sided p = {self.excluded_p:.2g}, Holm-adjusted p = {self.excluded_adjusted:.2g}")


def decide(items: list[Claim]) -> list[Claim]:
    """Holm over the claims in regime with a test (the family this study run tests); the others keep no adjusted
    p. The tests of "an effect as large as the paper's" are a second family, Holm-adjusted on their own."""
    family = [c for c in items if c.tested]
    for c, adjusted in zip(family, holm([c.p for c in family]), strict=True):
        c.adjusted = adjusted
    sizes = [c for c in family if c.excluded_p is not None]
    for c, adjusted in zip(sizes, holm([c.excluded_p for c in sizes]), strict=True):
        c.excluded_adjusted = adjusted
    return items


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


def _not_run(claim: str, setting: str, regime: str) -> Claim:
    return Claim(claim, setting, regime, None)


def direction_claim(claim: str, setting: str, regime: str, ours: dict[int, float], other: dict[int, float],
                    paper_says_higher: bool, regime_ok: tuple[bool, str], scale: float = 100,
                    unit: str = "pt", budget: str | None = None, paper_effect: float | None = None) -> Claim:
    """A claim that ``ours`` is above (``paper_says_higher``) or below ``other``: two-sided paired t-test; with
    ``paper_effect`` (the paper's difference on this measure, > 0 in its direction) also the one-sided test of
    whether an effect that large is excluded here (:func:`below_paper_p`)."""
    if not ours or not other:
        return _not_run(claim, setting, regime)
    test = paired_test(ours, other)
    if test is None:
        return Claim(claim, setting, regime, regime_ok[0], regime_ok[1] or "no shared seed: unpaired",
                     "unpaired", budget=budget)
    ok, why = regime_ok
    if ok and len(test.seeds) < MIN_SEEDS:
        ok, why = False, f"{len(test.seeds)} shared seed(s), {MIN_SEEDS} needed"
    return Claim(claim, setting, regime, ok, why, effect_text(test, scale, unit), test.p,
                 (test.mean > 0) == paper_says_higher if test.p is not None else None, len(test.seeds),
                 budget=budget, paper_effect=paper_effect, scale=scale, unit=unit,
                 excluded_p=below_paper_p(test, paper_says_higher, paper_effect) if paper_effect else None)


def on_par_claim(claim: str, setting: str, regime: str, ours: dict[int, float], other: dict[int, float],
                 regime_ok: tuple[bool, str], margin: float = 0.01) -> Claim:
    """A claim that two numbers match within +-``margin``: TOST (its p = the larger one-sided p)."""
    if not ours or not other:
        return _not_run(claim, setting, regime)
    test, p = tost(ours, other, margin)
    if test is None:
        return Claim(claim, setting, regime, regime_ok[0], "no shared seed: unpaired", "unpaired")
    ok, why = regime_ok
    if ok and len(test.seeds) < MIN_SEEDS:
        ok, why = False, f"{len(test.seeds)} shared seed(s), {MIN_SEEDS} needed"
    return Claim(claim, setting, regime, ok, why, f"{effect_text(test)}; TOST margin +-{margin * 100:g} pt", p, None,
                 len(test.seeds), "TOST")


def peak_claim(claim: str, setting: str, regime: str, peak: dict[int, float], ends: list[dict[int, float]],
               regime_ok: tuple[bool, str]) -> Claim:
    """A claim that ``peak`` is above each of ``ends`` (a maximum at an intermediate point): an intersection-union
    test — the paper's shape holds where every contrast is positive, with p the largest of their two-sided paired
    p; a contrast significantly negative contradicts it (p: the smallest of the negative contrasts')."""
    if not peak or not all(ends):
        return _not_run(claim, setting, regime)
    tests = [paired_test(peak, end) for end in ends]
    if any(t is None or t.p is None for t in tests):
        return Claim(claim, setting, regime, regime_ok[0], "fewer than 2 shared seeds", "no test")
    effect = "; ".join(effect_text(t) for t in tests)
    negative = [t.p for t in tests if t.mean <= 0]
    p, agrees = (min(negative), False) if negative else (max(t.p for t in tests), True)
    ok, why = regime_ok
    n = min(len(t.seeds) for t in tests)
    if ok and n < MIN_SEEDS:
        ok, why = False, f"{n} shared seed(s), {MIN_SEEDS} needed"
    return Claim(claim, setting, regime, ok, why, effect, p, agrees, n, "intersection-union")


def gated(rows: dict[str, list[dict[str, Any]]], *names: str, budget: str | None = None) -> tuple[bool, str]:
    """The regime "features learned": every row passes the gate (at ``budget``, else its own epochs)."""
    gates = [gate(rows, n, budget) for n in names]
    failed = [g.text for g in gates if not g.passed]
    return (False, "not learned: " + "; ".join(failed)) if failed else (True, "learned: " + "; ".join(
        g.text for g in gates))


def pretext(values: dict[int, float], what: str) -> tuple[bool, str]:
    """The regime "pretext task learned to :data:`PRETEXT_LEVEL`": the mean over seeds reaches it. ``values``:
    measured on the validation split (a row without them fails closed: no regime check reads the test split)."""
    if not values:
        return False, f"{what} not measured on validation"
    mean = statistics.mean(values.values())
    return (mean >= PRETEXT_LEVEL,
            f"{what} {mean * 100:.1f}% {'>=' if mean >= PRETEXT_LEVEL else '<'} the stated "
            f"{PRETEXT_LEVEL * 100:.0f}%")


def both(*checks: tuple[bool, str]) -> tuple[bool, str]:
    failed = [why for ok, why in checks if not ok]
    return (False, "; ".join(failed)) if failed else (True, "; ".join(why for _, why in checks))


def finetuned_long_enough(rows: dict[str, list[dict[str, Any]]], name: str) -> tuple[bool, str]:
    epochs = {m.get("finetune_epochs") for m in rows.get(name, [])} - {None}
    longest = max((e for e in epochs if isinstance(e, int | float)), default=0.0)
    return (longest >= FINETUNE_EPOCHS_NEEDED, f"{longest:g} fine-tuning epochs, the paper's comparison needs >= "
            f"{FINETUNE_EPOCHS_NEEDED:g} (MP3 Fig. 5)")


def classifiers_learned(rows: dict[str, list[dict[str, Any]]], *names: str) -> tuple[bool, str]:
    """The regime of a comparison of classifiers trained with labels for equal epochs: each above chance (one-sided
    one-sample t-test of its validation top-1 at alpha 0.05 over >= 3 seeds; a row without one fails closed: the
    test split decides no regime)."""
    from scipy.stats import ttest_1samp

    for name in names:
        values = list(per_seed(rows, name, "validation_top1").values())
        if len(values) < MIN_SEEDS:
            return False, f"{name}: {len(values)} seed(s) with a validation top-1, {MIN_SEEDS} needed"
        if len(set(values)) > 1 and ttest_1samp(values, CHANCE, alternative="greater").pvalue >= ALPHA:
            return False, f"{name}: validation top-1 not above chance"
    return True, "classifiers above chance, equal epochs"


def finetuned(what: str, paper_effect: float | None) -> float | None:
    """The paper's fine-tuning effect where this claim compares fine-tunes; None where a probe stands in (the
    paper gives no probe effect to compare with)."""
    return paper_effect if what.startswith("fine-tuned") else None


def finetune_or_probe(rows: dict[str, list[dict[str, Any]]], a: str, b: str,
                      budget: str | None = None) -> tuple[dict[int, float], dict[int, float], str]:
    """The one proxy rule: fine-tuned top-1 of both rows where both were fine-tuned, else their linear probes (a
    frozen probe stands in for a fine-tune, in both directions, in every claim and in label efficiency)."""
    for key, what in (("top1", "fine-tuned top-1"), ("linear_probe", "linear probe as the fine-tune's proxy")):
        ours, other = at_budget(rows, a, key, budget), at_budget(rows, b, key, budget)
        if ours and other:
            return ours, other, what
    return {}, {}, ""


# The claims of the five papers as data (:class:`ClaimSpec`), built into :class:`Claim` items in one loop
# (:func:`claim_items`). Settings hold ``{here}`` (this study's backbone and budget), ``{budget}`` (the chosen
# budget) and ``{corpus}`` (the speech corpus), filled per study; ``{pre}``, ``{ft}``, ``{total}`` by the report.
HERE = "Fashion-MNIST 32 px, `vit_cpu_narrow` (1.2M), {pre} PT"
LEARNED = "the rows' features learned (the gate, on validation)"
LONG_FINETUNE = f"fine-tuning >= {FINETUNE_EPOCHS_NEEDED:g} epochs"
CLASSIFIERS = "both classifiers trained for equal epochs and above chance"
PROXY = "proxy"  # the measure of :func:`finetune_or_probe`: fine-tuned top-1 of both rows, else their probes


@dataclass(frozen=True)
class ClaimSpec:
    """One paper claim as this study tests it, as data: which rows it compares on which measure, the regime the
    comparison needs and how it is checked, the test, and the paper's own effect on that measure."""

    paper: str  # MP3 | DropPos | StoP | MJP | RandSAC
    table: str  # where the paper shows it
    says: str  # the claim; a PROXY measure appends the measure that stood in
    setting: str  # paper's setting -> this study's
    rows: tuple[str, ...]  # (ours, other); a peak test: (the peak, *the ends)
    measure: str | tuple[str, ...]  # one for every row, or one per row: metric key | mp3_eta@<eta> | psnr@<a>/<s>
    regime: str  # what the comparison needs, stated beforehand
    checks: tuple[tuple[str, ...], ...]  # how the regime is checked: (kind, *args) of :func:`regime_check`
    test: str = "direction"  # direction (two-sided paired t) | on_par (TOST, margin 1 pt) | peak (intersection-union)
    higher: bool = True  # the paper's direction: ours above the other
    paper_effect: float | None = None  # the paper's effect on this measure (PROXY: on its fine-tune only)
    scale: float = 100
    unit: str = "pt"
    budget: bool = False  # read at the smallest budget at which every row passes the gate (:func:`chosen_budget`)

    @property
    def name(self) -> str:
        return f"{self.paper} {self.table}: {self.says}"


PAPER_CLAIMS = (
    ClaimSpec("MP3", "Table 4 / Fig. 5", "MP3 pretraining + fine-tuning beats supervised training of the same ViT at "
              "the same total epochs",
              "ImageNet-1K ViT-B, eta 0.75: 100 PT + 150 FT epochs 83.0 vs 300 supervised 81.8 (Fig. 5: 100 + 60 "
              "already above) -> {here} + {ft} FT vs {total} supervised epochs, eta 0.5",
              ("mp3", "supervised"), "top1",
              f"{LONG_FINETUNE} (MP3 learns its PE in fine-tuning) and {LEARNED}",
              (("finetuned", "mp3"), ("gated", "mp3")), paper_effect=0.012),
    ClaimSpec("MP3", "Table 3", "with MP3 pretraining, 2D relative PE is on par with absolute (84.2 vs 84.0)",
              "CIFAR-100 ViT-S, 2K PT epochs -> {here} + {ft} FT; margin 1 pt",
              ("mp3_ft_relbias2d", "mp3"), "top1", f"{LONG_FINETUNE} and {LEARNED}",
              (("finetuned", "mp3_ft_relbias2d"), ("gated", "mp3")), test="on_par"),
    ClaimSpec("MP3", "Table 3", "MP3 without any PE stays far above supervised without PE (82.6 vs 64.6)",
              "CIFAR-100 ViT-S, 2K PT epochs vs 400 supervised -> {here} + {ft} FT vs {total} supervised",
              ("mp3_ft_none", "supervised_nope"), "top1", f"{LONG_FINETUNE} and {LEARNED}",
              (("finetuned", "mp3_ft_none"), ("gated", "mp3")), paper_effect=0.18),
    ClaimSpec("MP3", "Fig. 3 (train eta 0)", "position accuracy falls as the evaluation eta grows (eval 0.9 vs eval 0)",
              "ImageNet-1K ViT-B, 100 PT epochs -> {here}, the pretraining's own head",
              ("mp3_eta0", "mp3_eta0"), ("mp3_eta@0.9", "mp3_eta@0.0"),
              f"the position task learned: top-1 at eval eta 0 >= {PRETEXT_LEVEL:.0%} (the paper's curve starts near "
              "100%)", (("pretext", "mp3_eta0", "mp3_eta@0.0", "position top-1 at eval eta 0"),), higher=False),
    ClaimSpec("MP3", "Fig. 3 (train eta 0.75)", "position accuracy peaks at an intermediate evaluation eta (eval 0.55 "
              "above both eval 0 and eval 0.9)",
              "ImageNet-1K ViT-B, 100 PT epochs, maximum around eval 0.55 -> {here}, the pretraining's own head",
              ("mp3_eta0.75",) * 3, ("mp3_eta@0.55", "mp3_eta@0.0", "mp3_eta@0.9"),
              f"the position task learned: top-1 at eval eta 0.55 >= {PRETEXT_LEVEL:.0%}",
              (("pretext", "mp3_eta0.75", "mp3_eta@0.55", "position top-1 at eval eta 0.55"),), test="peak"),
    ClaimSpec("MP3", "Fig. 6", "an intermediate eta (0.5) fine-tunes better than eta 0",
              "CIFAR-100 ViT-S, 200 PT epochs, fine-tuned -> {here}", ("mp3", "mp3_eta0"), PROXY, LEARNED,
              (("gated", "mp3", "mp3_eta0"),)),
    ClaimSpec("DropPos", "Table 1", "gamma 0.75 fine-tunes better than gamma 0.5",
              "ImageNet-1K ViT-B, 200 PT epochs, fine-tuned 82.96 vs 82.78 -> {here}", ("droppos", "droppos_gamma0.5"),
              PROXY, LEARNED, (("gated", "droppos", "droppos_gamma0.5"),), paper_effect=0.0018),
    ClaimSpec("DropPos", "Table 3", "sigma = 0 predicts positions better than sigma 1 -> 0 (position accuracy)",
              "ImageNet-1K ViT-B, 200 PT epochs, 88.81 vs 87.83 (position accuracy) -> {here}, mean of the 4 x 4 "
              "position grid", ("droppos_sigma0", "droppos"), "position_accuracy",
              f"the position task learned: grid mean >= {PRETEXT_LEVEL:.0%} (the paper's 87.83% at sigma 1 -> 0)",
              (("pretext", "droppos", "position_grid", "DropPos position accuracy"),), paper_effect=0.0098),
    ClaimSpec("DropPos", "Table 3", "... but sigma = 0 fine-tunes worse",
              "as above, fine-tuned 82.85 vs 82.96 -> {here}", ("droppos_sigma0", "droppos"), PROXY, LEARNED,
              (("gated", "droppos_sigma0", "droppos"),), higher=False, paper_effect=0.0011),
    ClaimSpec("DropPos", "Table 4", "tau = inf fine-tunes worse than tau 0.1",
              "ImageNet-1K ViT-B, 200 PT epochs, fine-tuned 82.84 vs 82.96 -> {here}", ("droppos_tau_inf", "droppos"),
              PROXY, LEARNED, (("gated", "droppos_tau_inf", "droppos"),), higher=False, paper_effect=0.0012),
    ClaimSpec("StoP", "Table 1", "StoP beats I-JEPA in linear probing (100% of the labels)",
              "ImageNet-1K ViT-B/L/H, 300-600 PT epochs (ViT-B: 72.6 vs 70.9) -> Fashion-MNIST 32 px, "
              "`vit_cpu_narrow`, {budget} PT epochs (the smallest budget at which both pass the gate), probe on 5,000 "
              "train images", ("stop", "ijepa"), "linear_probe", LEARNED + " at the same budget",
              (("gated", "stop", "ijepa"),), paper_effect=0.017, budget=True),
    ClaimSpec("StoP", "Table 6", "... and with 1% of the labels (a class-balanced 1% of the train split)",
              "ImageNet-1K 1% (~13 images per class; Table 6: 57.8 vs 54.3) -> as above, {budget} PT epochs, 1% = 55 "
              "images per class", ("stop", "ijepa"), "linear_probe@0.01", LEARNED + " at the same budget",
              (("gated", "stop", "ijepa"),), paper_effect=0.035, budget=True),
    ClaimSpec("MJP", "Table 1", "MJP is more consistent under a gamma 0.15 jigsaw than the supervised ViT",
              "ImageNet-1K DeiT-S, 300 epochs, 82.9 vs 64.3 -> Fashion-MNIST, {total} epochs from scratch, both",
              ("mjp", "supervised"), "consistency", CLASSIFIERS, (("classifiers", "mjp", "supervised"),),
              paper_effect=0.186),
    ClaimSpec("MJP", "Table 3", "larger training gamma -> higher consistency (0.27 vs 0.03)",
              "ImageNet-1K DeiT-S -> Fashion-MNIST, {total} epochs", ("mjp_gamma0.27", "mjp_gamma0.03"), "consistency",
              CLASSIFIERS, (("classifiers", "mjp_gamma0.27", "mjp_gamma0.03"),)),
    ClaimSpec("MJP", "Table 3", "top-1 stays flat across training gamma (0.27 vs 0.03, within 1 pt)",
              "as above; margin 1 pt", ("mjp_gamma0.27", "mjp_gamma0.03"), "top1", CLASSIFIERS,
              (("classifiers", "mjp_gamma0.27", "mjp_gamma0.03"),), test="on_par"),
    ClaimSpec("MJP", "Table 5", "APRIL recovers less from MJP's update on x~ (b) than from the supervised ViT's on x "
              "(a)", "ImageNet ViT-B updates -> one-image updates of the Fashion-MNIST classifiers",
              ("mjp_gamma0.27", "supervised"), ("psnr@analytic/b", "psnr@analytic/a"),
              "the same images and attack budget for every model", (("same_attack",),), higher=False, scale=1,
              unit="dB PSNR"),
    ClaimSpec("MJP", "Table 5", "... and MJP's reconstruction is further still from the original x (c vs b)",
              "ImageNet ViT-B updates -> one-image updates of the Fashion-MNIST classifiers",
              ("mjp_gamma0.27", "mjp_gamma0.27"), ("psnr@analytic/c", "psnr@analytic/b"),
              "the same images and attack budget for every model", (("same_attack",),), higher=False, scale=1,
              unit="dB PSNR"),
    ClaimSpec("MJP", "Table 5", "a ViT without PE leaks more than MJP (setting a; gradient matching, the attack that "
              "applies to both)", "ImageNet ViT-B updates -> one-image updates of the Fashion-MNIST classifiers",
              ("supervised_nope", "mjp_gamma0.27"), "psnr@gradient_matching/a",
              "the same images and attack budget for every model", (("same_attack",),), scale=1, unit="dB PSNR"),
    ClaimSpec("RandSAC", "Table 2", "random serialization beats raster order (linear probe)",
              "CIFAR-10 ViT, 800 PT epochs, 75.53 vs 55.53 -> {here}", ("randsac_patch_random", "randsac_raster"),
              "linear_probe", LEARNED, (("gated", "randsac_patch_random", "randsac_raster"),), paper_effect=0.20),
    ClaimSpec("RandSAC", "Table 5", "segments (blob) beat patch-random (linear probe)",
              "CIFAR-10 ViT, 800 PT epochs, 82.52 vs 75.53 -> {here}", ("randsac_blob_flat", "randsac_patch_random"),
              "linear_probe", LEARNED, (("gated", "randsac_blob_flat", "randsac_patch_random"),), paper_effect=0.0699),
    ClaimSpec("RandSAC", "Table 7", "hierarchical blobs (11 -> 5) beat flat blobs (linear probe)",
              "CIFAR-10 ViT, 1600 PT epochs, normalized pixels, 83.20 vs 82.02 -> {here}",
              ("randsac", "randsac_blob_flat"), "linear_probe", LEARNED, (("gated", "randsac", "randsac_blob_flat"),),
              paper_effect=0.0118),
    ClaimSpec("MP3", "Table 5", "MP3 pretraining improves the keyword-spotting Transformer",
              "Speech Commands v1, 12 classes, 30K updates each (FT and supervised), early stopping on validation, "
              "94.2 vs 91.9 -> {corpus}, as many fine-tuning as supervised updates, early stopping on validation",
              ("speech_mp3", "speech_supervised"), "top1",
              "real Speech Commands (Table 5's data): a synthetic corpus is not comparable", (("corpus",),),
              paper_effect=0.023),
)


def claim_measure(name: str) -> Value:
    """A :class:`ClaimSpec` measure of one seed's metrics on the test split: ``psnr@<attack>/<setting>`` (MJP Table
    5's PSNR), else :func:`measure`'s (``mp3_eta@<eta>``, a metric key)."""
    if name.startswith("psnr@"):
        attack, setting = name.removeprefix("psnr@").split("/")
        return privacy_metric(attack, setting, "psnr")
    return measure(name)


def regime_check(rows: dict[str, list[dict[str, Any]]], check: tuple[str, ...], budget: str | None,
                 corpus: str) -> tuple[bool, str]:
    """One regime check of a :class:`ClaimSpec`: ``gated`` rows (at ``budget``), ``finetuned`` long enough, the
    ``pretext`` task learned (row, measure, what; on validation), ``classifiers`` learned, the ``same_attack``, or a
    real speech ``corpus``."""
    kind, *args = check
    if kind == "gated":
        return gated(rows, *args, budget=budget)
    if kind == "finetuned":
        return finetuned_long_enough(rows, args[0])
    if kind == "pretext":
        row, name, what = args
        return pretext(per_seed(rows, row, measure(name, "validation")), what)
    if kind == "classifiers":
        return classifiers_learned(rows, *args)
    if kind == "same_attack":
        return True, "same attack"
    if kind == "corpus":
        real = "speech_commands" in corpus.lower()
        return real, f"{corpus or 'the corpus'} is " + ("Speech Commands" if real else
                                                       "synthetic (espeak-ng), not Table 5's data")
    raise ValueError(f"unknown regime check {kind!r}")


def spec_values(rows: dict[str, list[dict[str, Any]]], spec: ClaimSpec,
                budget: str | None) -> tuple[list[dict[int, float]], str]:
    """{seed: value} of each of the spec's rows on its measure (at ``budget``), and what a PROXY measure read."""
    if spec.measure == PROXY:
        ours, other, what = finetune_or_probe(rows, *spec.rows)
        return [ours, other], what
    measures = (spec.measure,) * len(spec.rows) if isinstance(spec.measure, str) else spec.measure
    return [at_budget(rows, row, key, budget) if spec.budget else per_seed(rows, row, claim_measure(key))
            for row, key in zip(spec.rows, measures, strict=True)], ""


def paper_claim(rows: dict[str, list[dict[str, Any]]], spec: ClaimSpec, corpus: str) -> Claim:
    """One :class:`ClaimSpec` measured: its values, its regime checked, its test."""
    budget = chosen_budget(rows, spec.rows)[0] if spec.budget else None
    values, what = spec_values(rows, spec, budget)
    name = spec.name + (f" ({what or 'fine-tune or probe'})" if spec.measure == PROXY else "")
    setting = (spec.setting.replace("{here}", HERE).replace("{budget}", budget or "?")
               .replace("{corpus}", corpus or "this corpus"))
    regime_ok = both(*(regime_check(rows, check, budget, corpus) for check in spec.checks))
    if spec.test == "peak":
        return peak_claim(name, setting, spec.regime, values[0], values[1:], regime_ok)
    if spec.test == "on_par":
        return on_par_claim(name, setting, spec.regime, values[0], values[1], regime_ok)
    effect = finetuned(what, spec.paper_effect) if spec.measure == PROXY else spec.paper_effect
    return direction_claim(name, setting, spec.regime, values[0], values[1], spec.higher, regime_ok, spec.scale,
                           spec.unit, budget, effect)


def claim_items(rows: dict[str, list[dict[str, Any]]], settings: dict[str, str] | None = None) -> list[Claim]:
    """Every paper claim the study can test (:data:`PAPER_CLAIMS`), with its regime checked and decided
    (:func:`decide`). ``settings``: ``speech_corpus`` (the corpus the speech rows trained on)."""
    corpus = (settings or {}).get("speech_corpus", "")
    return decide([paper_claim(rows, spec, corpus) for spec in PAPER_CLAIMS])


def null_control(rows: dict[str, list[dict[str, Any]]], margin: float = 0.01) -> str:
    """The speech null-pretraining control (1 step + the same fine-tune vs supervised), reported by its TOST: not a
    paper claim, outside the family."""
    test, p = tost(per_seed(rows, "speech_null", "top1"), per_seed(rows, "speech_supervised", "top1"), margin)
    if test is None:
        return "not run"
    if p is None:
        return f"no test ({effect_text(test)})"
    shown = "equivalent" if p < ALPHA else "not shown equivalent"
    return f"{shown} within +-{margin * 100:g} pt (TOST p = {p:.2g}; {effect_text(test)})"


def decided_line(items: list[Claim]) -> str:
    """How many claims the study run tests (in regime), how many Holm keeps decided, and the rest."""
    tested = [c for c in items if c.tested]
    decided = [c for c in tested if c.adjusted is not None and c.adjusted < ALPHA]
    agree = sum(1 for c in decided if c.agrees is not False)
    out = sum(1 for c in items if c.in_regime is False)
    raw = sum(1 for c in tested if c.p < ALPHA)
    sizes = [c for c in tested if c.excluded_p is not None]
    return (f"{len(tested)} of {len(items)} claims in regime and tested (two-sided paired t-tests over seeds, TOST "
            f"for on-par claims, Holm over these {len(tested)} at alpha = {ALPHA}): decided {len(decided)} "
            f"({agree} agree, {len(decided) - agree} contradict; {raw} below alpha before the correction); "
            f"the paper's own effect size excluded here in {sum(c.paper_excluded for c in sizes)} of the "
            f"{len(sizes)} tested against it (one-sided paired t-tests, their own Holm family); "
            f"out of regime at this budget: {out}; not run: {sum(1 for c in items if c.in_regime is None)}.")


def claims(rows: dict[str, list[dict[str, Any]]], settings: dict[str, str] | None = None) -> list[str]:
    """The claims table: each claim, its setting (paper -> here), the regime it needs, the test, raw and adjusted
    p and the verdict, after the line counting them."""
    items = claim_items(rows, settings)
    fill = {k: v for k, v in (settings or {}).items() if k in ("pre", "ft", "total")}
    lines = [decided_line(items), "",
             "| claim (paper) | paper's setting -> this study's | regime it needs | in regime? | seeds | raw p | "
             "Holm p | this study |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in items:
        status = "-" if c.in_regime is None else ("yes" if c.in_regime else "no")
        lines.append(f"| {c.claim} | {c.setting.format(**fill) if fill else c.setting} | {c.regime} | {status} | "
                     f"{c.seeds or '-'} | {f'{c.p:.2g}' if c.p is not None else '-'} | "
                     f"{f'{c.adjusted:.2g}' if c.adjusted is not None else '-'} | {c.verdict} |")
    return lines


def claims_versus(rows: dict[str, list[dict[str, Any]]], earlier: dict[str, list[dict[str, Any]]],
                  earlier_name: str, settings: dict[str, str] | None = None) -> list[str]:
    """The claims of an earlier study's rows judged by these rules (regimes, the gate, Holm) beside this one's."""
    now, before = claim_items(rows, settings), {c.claim: c for c in claim_items(earlier, settings)}
    lines = [f"| claim (paper) | {earlier_name} | this study |", "| --- | --- | --- |"]
    lines += [f"| {c.claim} | {before[c.claim].verdict if c.claim in before else 'not run'} | {c.verdict} |"
              for c in now]
    return [*lines, "", f"{earlier_name}: {decided_line(list(before.values()))}",
            f"This study: {decided_line(now)}"]


# ---------------------------------------------------------------------------- label efficiency (a study question)
def label_items(rows: dict[str, list[dict[str, Any]]], fractions: tuple[float, ...],
                one_sided: bool = False) -> dict[tuple[str, float], Claim]:
    """Does pretraining beat supervised training from scratch on the same labels? Not a claim of the five papers: a
    question of this study, its own Holm family over (method, fraction). Each pretrained row's fine-tuned top-1 on
    the subset, else its frozen linear probe on it (:func:`finetune_or_probe`'s rule: the proxy in both
    directions), against the supervised ViT trained from scratch on the subset, seed-paired. In regime where the
    row's features pass the gate and the supervised baseline converged (stopped early on validation on every
    seed; one that ran to its epoch cap is a lower bound). ``one_sided`` (a protocol's ``label_efficiency.proxy:
    one_sided``): a probe bounds a fine-tune from below, so a proxy comparison is the one-sided test of "above"
    (:func:`one_sided_above`), never read as "below"."""
    out: dict[tuple[str, float], Claim] = {}
    for run in RUNS:
        if not run.label_efficiency or run.classifier_only or run.name not in rows:
            continue
        for f in fractions:
            top1, probe = fraction_key("top1", f), fraction_key("linear_probe", f)
            fine_tuned = per_seed(rows, run.name, top1)
            ours, what = (fine_tuned, "fine-tuned") if fine_tuned else (per_seed(rows, run.name, probe),
                                                                       "linear probe as the proxy")
            stops = [m.get(fraction_key("stopped", f)) for m in rows.get("supervised", [])]
            converged = (bool(stops) and all(s == "early" for s in stops),
                         "supervised " + (f"stopped early on all {len(stops)} seeds" if stops and all(
                             s == "early" for s in stops) else "ran to its epoch cap: not converged"))
            regime = both(gated(rows, run.name), converged)
            name = f"{run.label}, {f:.0%} of the labels ({what})"
            out[(run.name, f)] = one_sided_above(ours, per_seed(rows, "supervised", top1), name, regime) \
                if one_sided and what != "fine-tuned" else direction_claim(
                    name, "", "features learned and the baseline converged", ours, per_seed(rows, "supervised", top1),
                    True, regime)
    decide(list(out.values()))
    return out


# ------------------------------------------------------------------- the claims of a pre-registered protocol
def measure(name: str, split: str = "test") -> Value:
    """A protocol measure of one seed's metrics, on ``split`` (test: the claim's test; validation: its regime):
    ``mp3_eta@<eta>`` (MP3 position top-1 at that evaluation eta), ``position_grid`` (DropPos's averaged position
    accuracy), ``validation_top1`` (a classifier's best validation top-1), else a metric key (``linear_probe``,
    ``consistency``, ``top1``)."""
    where = (lambda m: m.get("validation") or {}) if split == "validation" else (lambda m: m)
    if name.startswith("mp3_eta@"):
        eta = str(float(name.split("@", 1)[1]))
        return lambda m: where(m).get("mp3_eta_curve", {}).get(eta, {}).get("top1")
    if name == "position_grid":
        return lambda m: (where(m).get("droppos_grid") or {}).get("mean")
    return lambda m: where(m).get(name)


def pretext_regime(rows: dict[str, list[dict[str, Any]]], row: str, name: str, ceiling: float,
                   share: float) -> tuple[bool, str]:
    """The pretext task learned: ``row``'s measure on validation, mean over its seeds, at least ``share`` of the
    PE-free ``ceiling`` (fails closed where it was not measured on validation)."""
    values = per_seed(rows, row, measure(name, "validation"))
    level = share * ceiling
    if not values:
        return False, f"{row}: {name} not measured on validation"
    mean = statistics.mean(values.values())
    return mean >= level, (f"{row} {name} on validation {mean * 100:.1f}% {'>=' if mean >= level else '<'} "
                           f"{share:g} x the PE-free ceiling {ceiling * 100:.1f}% = {level * 100:.1f}%")


def converged(rows: dict[str, list[dict[str, Any]]], *names: str) -> tuple[bool, str]:
    """Each row trained to convergence: stopped early on validation on every seed, within its cap (printed); else
    every row that did not, with its seeds."""
    caps = {n: next((f"{m['epochs_cap']:g}" for m in rows.get(n, []) if m.get("epochs_cap")), None) for n in names}
    failed = []
    for name in names:
        stops = {m["seed"]: m.get("stopped") for m in rows.get(name, [])}
        capped = sorted(s for s, how in stops.items() if how != "early")
        if not stops or capped:
            failed.append(f"{name} ran to its {caps[name] or '?'}-epoch cap (or did not stop on validation) on "
                          f"seed(s) {','.join(map(str, capped)) or '-'}")
    if failed:
        return False, "; ".join(failed) + ": not converged"
    return True, "stopped early on validation on every seed (" + ", ".join(
        f"{n}: cap {caps[n] or '?'} epochs" for n in names) + ")"


def above_pixels(rows: dict[str, list[dict[str, Any]]], names: list[str], pixels: float) -> tuple[bool, str]:
    """Each classifier at least as good on validation (its best validation top-1, mean over seeds) as the linear
    probe of the raw pixels on the same images (``pixels``)."""
    parts = []
    for name in names:
        values = list(per_seed(rows, name, "validation_top1").values())
        if not values:
            return False, f"{name}: no validation top-1"
        mean = statistics.mean(values)
        if mean < pixels:
            return False, f"{name} validation top-1 {mean * 100:.1f}% < raw pixels {pixels * 100:.1f}%"
        parts.append(f"{name} {mean * 100:.1f}%")
    return True, f"validation top-1 {', '.join(parts)} >= raw pixels {pixels * 100:.1f}%"


def protocol_regime(rows: dict[str, list[dict[str, Any]]], protocol: Protocol, spec: dict[str, Any],
                    settings: dict[str, Any]) -> tuple[bool, str]:
    """One regime requirement of a protocol claim (``pretext`` | ``gate`` | ``converged`` | ``above_pixels`` |
    ``corpus``), checked on the validation split (or the corpus)."""
    (kind, value), = spec.items()
    if kind == "pretext":
        ceiling = protocol.ceiling(value["ceiling"], settings.get("patch_size"))
        return pretext_regime(rows, value["row"], value["measure"], ceiling, protocol.share)
    if kind == "gate":
        return gated(rows, *value)
    if kind == "converged":
        return converged(rows, *value)
    if kind == "above_pixels":
        return above_pixels(rows, value, float(protocol.data["regimes"]["classifier"]["pixels_validation"]))
    if kind == "corpus":
        corpus = settings.get("speech_corpus", "")
        real = value in corpus.lower()
        return real, f"{corpus or 'the corpus'} is " + ("Speech Commands" if real else
                                                       "synthetic (espeak-ng), not Table 5's data")
    raise ValueError(f"unknown regime {kind!r} in {protocol.path}")


def regime_text(protocol: Protocol, spec: dict[str, Any], patch: int | None = None) -> str:
    """A regime requirement as the claims table states it (at ``patch`` px: the protocol's by default)."""
    (kind, value), = spec.items()
    if kind == "pretext":
        level = protocol.share * protocol.ceiling(value["ceiling"], patch)
        return (f"{value['row']}: {value['measure']} on validation >= {protocol.share:g} x the PE-free ceiling "
                f"`{value['ceiling']}@{patch or protocol.patch_size}` ({level * 100:.1f}%)")
    pixels = float(protocol.data["regimes"]["classifier"]["pixels_validation"])
    return {"gate": lambda: f"features learned (the gate): {', '.join(value)}",
            "converged": lambda: f"trained to convergence (early stopping on validation): {', '.join(value)}",
            "above_pixels": lambda: f"validation top-1 >= raw pixels ({pixels * 100:.1f}%): {', '.join(value)}",
            "corpus": lambda: f"the corpus is {value.replace('_', ' ')}"}[kind]()


def log_odds_excluded_p(ours: dict[int, float], other: dict[int, float], paper_says_higher: bool,
                        paper: float) -> float | None:
    """One-sided paired t-test p of H0 "the log-odds effect here (per seed logit(ours) - logit(other), signed in
    the paper's direction) is at least the paper's ``paper``": small where an effect that large is excluded."""
    seeds = sorted(ours.keys() & other.keys())
    test = paired_test({s: logit(ours[s]) for s in seeds}, {s: logit(other[s]) for s in seeds}) if seeds else None
    return below_paper_p(test, paper_says_higher, paper) if test and test.p is not None else None


def protocol_claim(rows: dict[str, list[dict[str, Any]]], protocol: Protocol, spec: dict[str, Any],
                   settings: dict[str, Any]) -> Claim:
    """One claim of a protocol, as its spec says: its rows paired only on one machine model, its regime, its test
    (paired | peak), the paper's effect on the log-odds scale where the spec gives the paper's two numbers."""
    sides = [spec["ours"], *([spec["other"]] if "other" in spec else spec.get("others", []))]
    values = [per_seed(rows, side["row"], measure(side["measure"])) for side in sides]
    patch = settings.get("patch_size") or protocol.patch_size
    regime = "; ".join(regime_text(protocol, req, patch) for req in spec["regime"])
    setting = spec["setting"].format(patch=patch, positions=(32 // patch) ** 2)
    checks = [protocol_regime(rows, protocol, req, settings) for req in spec["regime"]]
    ok, why = both(*checks)
    if spec["test"] == "peak":
        claim = peak_claim(spec["claim"], setting, regime, values[0], values[1:], (ok, why))
    else:
        higher = spec["direction"] == "higher"
        claim = direction_claim(spec["claim"], setting, regime, values[0], values[1], higher, (ok, why))
        if "paper" in spec and claim.in_regime is not None:
            claim.paper_effect = paper_log_odds(spec["paper"]["ours"], spec["paper"]["other"])
            claim.paper_scale = "log_odds"
            signed = claim.paper_effect if higher else -claim.paper_effect
            claim.excluded_p = log_odds_excluded_p(values[0], values[1], higher, signed)
    claim.family = spec["family"]
    refused = pairing_problem(rows, sorted({side["row"] for side in sides}))
    if refused and claim.in_regime is not None:
        claim.refused, claim.in_regime = refused, False
    # before every planned seed has run, a claim is pending unless a regime already fails on what was measured (a
    # pretext below its level, a baseline at its cap)
    planned = min(len(protocol.planned_seeds(side["row"])) for side in sides)
    have = min(len(v) for v in values)
    failed_on_measure = any(not passed and "not measured" not in text for passed, text in checks)
    if claim.in_regime is not None and not claim.refused and have < planned and not failed_on_measure:
        claim.pending = f"{have} of {planned} seeds"
    return claim


def decide_families(items: list[Claim]) -> list[Claim]:
    """Holm within each family (one per question) over its claims in regime with a test, and its pending claims
    counted at p = 1: Holm's adjusted p-values never fall as a raw p rises, so a tested claim's is an upper bound
    that can only fall once the pending ones are tested (a verdict reached now stands). The paper's-effect tests
    are a family of their own (``size``), counted the same way."""
    for family in dict.fromkeys(c.family for c in items):
        members = [c for c in items if c.family == family and (c.tested or c.pending)]
        for c, adjusted in zip(members, holm([c.p if c.tested else 1.0 for c in members]), strict=True):
            c.adjusted = adjusted if c.tested else None
    sizes = [c for c in items if (c.tested and c.excluded_p is not None) or (c.pending and c.paper_effect is not None)]
    for c, adjusted in zip(sizes, holm([c.excluded_p if c.tested else 1.0 for c in sizes]), strict=True):
        c.excluded_adjusted = adjusted if c.tested else None
    return items


def protocol_items(rows: dict[str, list[dict[str, Any]]], protocol: Protocol,
                   settings: dict[str, Any] | None = None) -> list[Claim]:
    """Every claim the protocol runs, built from its specs in one loop and decided family by family.
    ``settings``: ``speech_corpus`` (the speech rows' corpus), ``patch_size`` (the rows'; default the protocol's:
    the ceilings and settings are read at it)."""
    return decide_families([protocol_claim(rows, protocol, spec, settings or {}) for spec in protocol.claims])


def one_sided_above(ours: dict[int, float], other: dict[int, float], claim: str,
                    regime_ok: tuple[bool, str]) -> Claim:
    """A frozen probe against a trained baseline (label efficiency's proxy, one-sided): a probe bounds a fine-tune
    from below, so it can support "pretrained above" and nothing else. One-sided paired t-test of ours > other; its
    verdict is "agrees" (above) or undecided ("not shown above"), never "contradicts"."""
    test = paired_test(ours, other) if ours and other else None
    if test is None:
        return _not_run(claim, "", "features learned and the baseline converged")
    ok, why = regime_ok
    if ok and len(test.seeds) < MIN_SEEDS:
        ok, why = False, f"{len(test.seeds)} shared seed(s), {MIN_SEEDS} needed"
    p = None if test.p is None else (test.p / 2 if test.mean > 0 else 1 - test.p / 2)
    return Claim(claim, "", "features learned and the baseline converged", ok, why,
                 effect_text(test) + " (probe: above only)", p, True if p is not None else None, len(test.seeds),
                 "one-sided paired t (above)")
