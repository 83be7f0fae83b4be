"""The claims of a pre-registered protocol (research/protocols/) against the study's numbers.

Each claim of the protocol is built in one loop (:func:`protocol_items`): its rows paired only on one machine
model, the regime it needs checked on the validation split (the pretext task learned to a share of the PE-free
ceiling, the gate, the classifiers trained to convergence and above the raw pixels, the corpus), its test (a
two-sided paired t-test over seeds; a peak by an intersection-union test) and, where the protocol gives the paper's
two numbers, the one-sided test of "an effect as large as the paper's" on the log-odds scale. A claim outside its
regime reads "out of regime at this budget" with its measured effect; the claims in regime are Holm-adjusted
within their family (one per question), and one is decided only where its adjusted p is below alpha. Before every
planned seed of a family has run, that family decides nothing (no optional stopping)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from patchplace.research.reproduction.gate import gated
from patchplace.research.reproduction.protocol import Protocol, logit, pairing_problem, paper_log_odds
from patchplace.research.reproduction.stats import (
    ALPHA,
    MIN_SEEDS,
    POWER,
    PairedTest,
    Value,
    below_paper_p,
    detectable,
    effect_text,
    holm,
    paired_test,
    per_seed,
    power,
    random_key,
    welch_greater,
)

# ALPHA, MIN_SEEDS, paired_test, random_key, welch_greater: also read from here by controls.py and the benchmarks
__all__ = ["ALPHA", "MIN_SEEDS", "Claim", "measure", "paired_test", "protocol_items", "random_key", "welch_greater"]


@dataclass
class Claim:
    """One paper claim as this study tests it: the numbers, the regime it needs and whether it holds."""

    claim: str
    setting: str  # paper's setting -> this study's
    regime: str  # what the comparison needs to be meaningful, stated beforehand
    in_regime: bool | None  # None: not run
    why: str = ""  # how the regime check came out
    effect: str = ""  # the measured effect (mean, 95% CI, seeds)
    p: float | None = None  # raw p of the claim's test
    agrees: bool | None = None  # the measured direction matches the paper's (None: no test)
    seeds: int = 0
    test: str = "paired t"  # paired t | intersection-union
    adjusted: float | None = None  # Holm-adjusted p within the claim's family
    # the paper's own effect in log-odds, in the paper's direction; with it, a one-sided paired t-test of "the
    # effect here is at least the paper's", Holm-adjusted within the family ``size``
    paper_effect: float | None = None
    excluded_p: float | None = None
    excluded_adjusted: float | None = None
    family: str = ""  # the protocol's Holm family (one per question)
    refused: str = ""  # why its rows are not paired (rows from two machine models): no effect, no verdict
    pending: str = ""  # rows short of their planned seeds ("1 of 5 seeds"): its family decides nothing yet
    here: str = ""  # the study's scale ("16 positions, 4 epochs"): a result against the paper is bounded by it
    # the same paper's-effect test in points (the paper's difference of accuracies): effect, one-sided p, the
    # paired test's power against that effect and the effect it detects at POWER
    points: dict[str, float] | None = None

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
        if self.adjusted is None:  # its family waits for a pending claim
            return f"undecided ({self.effect}, {raw}; its family waits for every planned seed)"
        text = f"{self.effect}, {raw}, Holm-adjusted p = {self.adjusted:.2g}{self.excluded_text}"
        if self.adjusted < ALPHA:
            # a miniature of the paper's setting can fail to show its effect, not refute it at the paper's scale
            against = f"**not reproduced at {self.here}**" if self.here else "**contradicts**"
            return f"{'agrees' if self.agrees is not False else against} ({text})"
        return f"undecided ({text})"

    @property
    def paper_excluded(self) -> bool:
        """Whether an effect as large as the paper's is excluded here (its Holm-adjusted one-sided p < alpha)."""
        return self.excluded_adjusted is not None and self.excluded_adjusted < ALPHA

    @property
    def excluded_text(self) -> str:
        if self.excluded_adjusted is None:  # not in the family (decide_families sets it)
            return ""
        text = (f"; the paper's effect (log-odds {self.paper_effect:+.2f}) "
                f"{'excluded' if self.paper_excluded else 'not excluded'} here: one-sided p = {self.excluded_p:.2g}, "
                f"Holm-adjusted p = {self.excluded_adjusted:.2g}")
        if self.points:
            text += (f"; in points ({self.points['effect'] * 100:+.2f} pt) one-sided p = {self.points['p']:.3f}; "
                     f"the paired test's power against {self.points['effect'] * 100:+.2f} pt is "
                     f"{self.points['power']:.2f} at {self.seeds} seeds, the effect it detects at {POWER:.0%} "
                     f"power {self.points['detectable'] * 100:.1f} pt")
        return text


def _not_run(claim: str, setting: str, regime: str) -> Claim:
    return Claim(claim, setting, regime, None)


def direction_claim(claim: str, setting: str, regime: str, ours: dict[int, float], other: dict[int, float],
                    paper_says_higher: bool, regime_ok: tuple[bool, str]) -> Claim:
    """A claim that ``ours`` is above (``paper_says_higher``) or below ``other``: two-sided paired t-test."""
    if not ours or not other:
        return _not_run(claim, setting, regime)
    test = paired_test(ours, other)
    if test is None:
        return Claim(claim, setting, regime, regime_ok[0], regime_ok[1] or "no shared seed: unpaired", "unpaired")
    ok, why = regime_ok
    if ok and len(test.seeds) < MIN_SEEDS:
        ok, why = False, f"{len(test.seeds)} shared seed(s), {MIN_SEEDS} needed"
    return Claim(claim, setting, regime, ok, why, effect_text(test), test.p,
                 (test.mean > 0) == paper_says_higher if test.p is not None else None, len(test.seeds))


def peak_claim(claim: str, setting: str, regime: str, peak: dict[int, float], ends: list[dict[int, float]],
               regime_ok: tuple[bool, str]) -> Claim:
    """A claim that ``peak`` is above each of ``ends`` (a maximum at an intermediate point): an intersection-union
    test — the paper's shape holds where every contrast is positive, with p the largest of their two-sided paired
    p; a contrast significantly negative goes against it (p: the smallest of the negative contrasts')."""
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


def both(*checks: tuple[bool, str]) -> tuple[bool, str]:
    failed = [why for ok, why in checks if not ok]
    return (False, "; ".join(failed)) if failed else (True, "; ".join(why for _, why in checks))


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


def in_points(test: PairedTest, paper_says_higher: bool, effect: float) -> dict[str, float] | None:
    """The paper's-effect test on the scale of the accuracies (``effect``: the paper's difference, in its
    direction): its one-sided p, the paired test's power against it, the effect detectable at :data:`POWER`."""
    p = below_paper_p(test, paper_says_higher, effect)
    if p is None or test.se == 0:
        return None
    return {"effect": effect, "p": p, "power": power(test, effect), "detectable": detectable(test)}


def with_paper_effect(claim: Claim, spec: dict[str, Any], ours: dict[int, float], other: dict[int, float]) -> None:
    """The protocol's paper's-effect test of ``claim``: on log-odds (its Holm family ``size``), and the same in
    points beside it (how much a 0-100 scale says at these seeds)."""
    higher = spec["direction"] == "higher"
    claim.paper_effect = paper_log_odds(spec["paper"]["ours"], spec["paper"]["other"])
    signed = claim.paper_effect if higher else -claim.paper_effect
    claim.excluded_p = log_odds_excluded_p(ours, other, higher, signed)
    test = paired_test(ours, other)
    if test is not None and test.p is not None:
        points = spec["paper"]["ours"] - spec["paper"]["other"]
        claim.points = in_points(test, higher, points if higher else -points)


def scale_here(rows: dict[str, list[dict[str, Any]]], row: str, patch: int) -> str:
    """The study's scale of a row the paper's effect is sought on: its positions and pretraining epochs."""
    epochs = {e for m in rows.get(row, []) if isinstance(e := m.get("pretrain_epochs"), int | float) and e > 0}
    return f"{(32 // patch) ** 2} positions" + (f", {epochs.pop():g} epochs" if len(epochs) == 1 else "")


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
    if spec["test"] == "peak":
        claim = peak_claim(spec["claim"], setting, regime, values[0], values[1:], both(*checks))
    else:
        claim = direction_claim(spec["claim"], setting, regime, values[0], values[1], spec["direction"] == "higher",
                                both(*checks))
        if "paper" in spec and claim.in_regime is not None:
            with_paper_effect(claim, spec, values[0], values[1])
    claim.family, claim.here = spec["family"], scale_here(rows, spec["ours"]["row"], patch)
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
    """Holm within each family (one per question) over its claims in regime with a test; a family with a pending
    claim decides nothing until that claim has all its seeds (a verdict never depends on when the report was
    read). The paper's-effect tests are a family of their own (``size``), held the same way."""
    for family in dict.fromkeys(c.family for c in items):
        members = [c for c in items if c.family == family]
        if not any(c.pending for c in members):
            tested = [c for c in members if c.tested]
            for c, adjusted in zip(tested, holm([c.p for c in tested]), strict=True):
                c.adjusted = adjusted
    sizes = [c for c in items if c.excluded_p is not None or (c.pending and c.paper_effect is not None)]
    if not any(c.pending for c in sizes):
        sizes = [c for c in sizes if c.tested]
        for c, adjusted in zip(sizes, holm([c.excluded_p for c in sizes]), strict=True):
            c.excluded_adjusted = adjusted
    return items


def protocol_items(rows: dict[str, list[dict[str, Any]]], protocol: Protocol,
                   settings: dict[str, Any] | None = None) -> list[Claim]:
    """Every claim the protocol runs, built from its specs in one loop and decided family by family.
    ``settings``: ``speech_corpus`` (the speech rows' corpus), ``patch_size`` (the rows'; default the protocol's:
    the ceilings and settings are read at it)."""
    return decide_families([protocol_claim(rows, protocol, spec, settings or {}) for spec in protocol.claims])
