"""Corrections to a protocol's report stated after its rows ran (an audit that recomputed every number of study v5:
all matched; two readings were stronger than the numbers allow). Each is keyed by the protocol's sha256 and a claim
id, and is written from the claim's own numbers, so the report regenerated from the results says it."""

from __future__ import annotations

from collections.abc import Callable

from patchplace.research.reproduction.claims import Claim
from patchplace.research.reproduction.protocol import Protocol
from patchplace.research.reproduction.stats import POWER

STUDY_V5 = "f5facfb9ae380b453877f446c540602603daa9018c38da0d2112dfd0975a5894"  # research/protocols/study_v5.yaml


def _mp3_peak(c: Claim) -> str:
    return (f"MP3 Fig. 3 (train eta 0.75): **not reproduced at {c.here}**, no longer \"contradicts\": a study of "
            f"{c.here} shows the peak absent here, not absent at the paper's 196 positions and 100 epochs. The same "
            "contrast had been measured before this protocol was written, on v4's rows (4 px patches: 64 "
            "positions, 0.5 epoch, 5 seeds, the test split; results/study.md): eval 0.55 - eval 0 = -0.72 pt (95% "
            "CI [-0.85, -0.59], p = 0.00011), the direction v5 then found. The protocol's header says no claim's "
            "contrast was measured before it; this one was, at another patch size and budget.")


def _droppos_size(c: Claim) -> str:
    pts = c.points
    if not pts or c.paper_effect is None or c.excluded_p is None:
        return ""
    return (f"DropPos Table 3 (position): the paper's effect is excluded on the log-odds scale the protocol fixed "
            f"(log-odds {c.paper_effect:+.2f}: one-sided p = {c.excluded_p:.2g}), less strongly in points "
            f"({pts['effect'] * 100:+.2f} pt: one-sided p = {pts['p']:.3f}). The paired test over {c.seeds} seeds "
            f"has power {pts['power']:.2f} against {pts['effect'] * 100:+.2f} pt; the effect it detects at "
            f"{POWER:.0%} power is {pts['detectable'] * 100:.1f} pt. An effect as large as the paper's is unlikely "
            f"here, and one of that size would go unseen at {c.seeds} seeds more often than not.")


CORRECTIONS: dict[tuple[str, str], Callable[[Claim], str]] = {
    (STUDY_V5, "mp3_fig3_eta075"): _mp3_peak,
    (STUDY_V5, "droppos_t3_position"): _droppos_size,
}


def correction_lines(protocol: Protocol, items: list[Claim]) -> list[str]:
    """The corrections of this protocol's claims that are decided or tested in this report, as a section."""
    lines = []
    for spec, claim in zip(protocol.claims, items, strict=True):
        write = CORRECTIONS.get((protocol.sha256, spec.get("id", "")))
        text = write(claim) if write and claim.tested and claim.adjusted is not None else ""
        lines += [f"- {text}"] if text else []
    return ["## Corrections (an audit that recomputed every number: all matched)", "", *lines, ""] if lines else []
