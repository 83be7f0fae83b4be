"""The learned gate: a pretrained row's frozen features count as learned where a one-sided Welch t-test over >= 3
seeds finds their linear probe on the validation split above the random init of the same architecture and feature
(same seeds, same images) at alpha 0.05; it fails closed (a missing control or fewer seeds is "not learned")."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from patchplace.research.reproduction.stats import ALPHA, MIN_SEEDS, welch_greater


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


def gated(rows: dict[str, list[dict[str, Any]]], *names: str) -> tuple[bool, str]:
    """The regime "features learned": every row passes the gate at its own pretraining epochs."""
    gates = [gate(rows, n) for n in names]
    failed = [g.text for g in gates if not g.passed]
    return (False, "not learned: " + "; ".join(failed)) if failed else (True, "learned: " + "; ".join(
        g.text for g in gates))
