"""A study's pre-registered protocol (study v5, ``research/protocols/study_v5.yaml``): the file, its sha256 and the
commit that holds it; what every row records of where and under what it ran (:func:`record_start`); the rows the
report refuses (:func:`refusals`) and the pairs it never forms (:func:`pairing_problem`); the PE-free position
ceiling a position regime is measured against (:func:`position_ceiling`, :func:`droppos_grid_ceiling`); the
pre-stated doubling rule (:func:`doubling_decision`).

The protocol is data: the claims, their regimes, measures, seeds, epochs, Holm families and margins are read from
the file, never from the numbers (``claims.protocol_items`` builds the claims table from it in one loop).

Provenance: a (row, seed) run directory holds ``provenance.json``, one record per start of its stages (CPU model,
device, the protocol's sha256, the commit, the UTC time). A row counts only where every start ran under the
protocol's hash, after the protocol's commit (its commit a descendant of it, or, where none was recorded, a start
time after the commit's); a claim pairs rows of one machine model only.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from patchplace.pipelines.config import ConfigError, read_yaml
from patchplace.pipelines.engine.hardware import cpu_info

PROVENANCE = "provenance.json"  # in each (row, seed) run directory: one record per start


class ProtocolError(ValueError):
    """A protocol file that cannot be read as one (the message is the one line a user sees)."""


@dataclass(frozen=True)
class Protocol:
    """A protocol file as read: its path, its content (the YAML mapping) and the sha256 of its bytes."""

    path: Path
    data: dict[str, Any]
    sha256: str

    @property
    def claims(self) -> list[dict[str, Any]]:
        return list(self.data.get("claims") or [])

    @property
    def share(self) -> float:
        """The share of the PE-free ceiling a pretext task must reach on validation to be learned."""
        return float(self.data["regimes"]["pretext"]["share"])

    @property
    def patch_size(self) -> int:
        return int(self.data["data"]["patch_size"])

    def planned_seeds(self, row: str) -> list[int]:
        """The seeds the protocol trains ``row`` on: those named after its epoch group, else the ``position``
        seeds (the MP3 and DropPos groups share them); [] for a row in no group."""
        seeds = self.data["seeds"]
        for group, spec in self.data["epochs"].items():
            if row in spec["rows"]:
                return list(seeds.get(group, seeds.get("position", [])))
        return []

    def ceiling(self, kind: str, patch: int | None = None) -> float:
        """The PE-free ceiling ``kind`` (``all_patches`` | ``droppos_grid``) at ``patch`` px (default: the
        protocol's patch size) as the protocol records it (computed on validation by :func:`ceilings_of_split`
        before any row ran)."""
        key = f"{kind}@{patch or self.patch_size}"
        try:
            return float(self.data["ceilings"]["values"][key])
        except KeyError as exc:
            raise ProtocolError(f"{self.path}: no ceiling {key!r} under ceilings.values; known: "
                                f"{sorted(self.data.get('ceilings', {}).get('values', {}))}") from exc


REQUIRED = ("version", "claims", "families", "regimes", "ceilings", "seeds", "epochs", "doubling", "alpha")


def sha256_of(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_protocol(path: str | Path) -> Protocol:
    """The protocol at ``path``; a file that is not one is a :class:`ProtocolError` naming what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise ProtocolError(f"protocol {path}: no such file (protocol= names the pre-registered protocol)")
    try:
        data = read_yaml(path.read_bytes(), f"protocol {path}", "fix the file")
    except ConfigError as exc:
        raise ProtocolError(str(exc)) from None
    if not isinstance(data, dict):
        raise ProtocolError(f"protocol {path}: a YAML mapping is needed, got {type(data).__name__}")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise ProtocolError(f"protocol {path}: no {', '.join(missing)}")
    families = set(data["families"])
    for spec in data["claims"]:
        if spec.get("family") not in families:
            raise ProtocolError(f"protocol {path}: claim {spec.get('id')!r} names family {spec.get('family')!r}, "
                                f"not one of {sorted(families)}")
    return Protocol(path, data, sha256_of(path))


# ------------------------------------------------------------------------------------------------- the commit
@dataclass(frozen=True)
class Commit:
    """The commit that last changed a file (the version rows must run under), and whether the file differs
    from it now."""

    sha: str
    time: datetime
    dirty: bool


def _git(where: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def protocol_commit(path: Path) -> Commit | None:
    """The commit that last changed ``path`` (read-only git queries), or None where it is not committed (or no git
    repository holds it: e.g. a copy of the working tree without its .git)."""
    path = Path(path).resolve()
    line = _git(path.parent, "log", "-1", "--format=%H %cI", "--", path.name)
    if not line:
        return None
    sha, when = line.split(" ", 1)
    dirty = bool(_git(path.parent, "status", "--porcelain", "--", path.name))
    return Commit(sha, datetime.fromisoformat(when), dirty)


def head_commit(where: Path) -> str | None:
    """The commit checked out at ``where`` (None without git)."""
    return _git(Path(where), "rev-parse", "HEAD")


def contains(where: Path, ancestor: str, commit: str) -> bool | None:
    """Whether ``commit`` descends from (or is) ``ancestor``; None where git cannot say (unknown commits)."""
    try:
        out = subprocess.run(["git", "-C", str(where), "merge-base", "--is-ancestor", ancestor, commit],
                             capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {0: True, 1: False}.get(out.returncode)


def unregistered(path: Path) -> str | None:
    """Why rows may not run under the protocol at ``path`` yet (one line), or None: it must be committed and
    unchanged since (pre-registration). Where no git repository holds it (a copy without .git), None: the report
    checks the start times against the commit instead."""
    path = Path(path)
    if _git(path.resolve().parent, "rev-parse", "--git-dir") is None:
        return None
    commit = protocol_commit(path)
    if commit is None:
        return f"the protocol {path} is not committed: commit it before any row runs (pre-registration)"
    if commit.dirty:
        return (f"the protocol {path} differs from its commit {commit.sha[:10]}: commit the change (rows then run "
                "under the new hash) or restore it")
    return None


# -------------------------------------------------------------------------------------------------- provenance
def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo 'model name', else what platform knows): the engine's reading."""
    return cpu_info().name


def machine_model() -> str:
    """The model a row's numbers depend on: the GPU's name where the stages train on one, else the CPU's."""
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else cpu_model()


def record_start(directory: Path, protocol: Path | None, repo: Path | None = None,
                 now: datetime | None = None) -> dict[str, Any]:
    """Append this start of a (row, seed)'s stages to ``directory/provenance.json``: the machine model, the CPU
    model, the protocol's sha256 (None without a protocol), the commit checked out (None without git), whether
    tracked files differed from it, and the UTC time. Returns the record."""
    repo = repo or (Path(protocol).resolve().parent if protocol else Path.cwd())
    commit = head_commit(repo)
    record = {"machine": machine_model(), "cpu_model": cpu_model(),
              "protocol_sha256": sha256_of(protocol) if protocol else None, "commit": commit,
              # tracked files changed since that commit (the numbers then depend on more than the commit)
              "dirty": bool(_git(repo, "status", "--porcelain", "--untracked-files=no")) if commit else None,
              "started": (now or datetime.now(timezone.utc)).isoformat(timespec="seconds")}
    path = Path(directory) / PROVENANCE
    starts = read_starts(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"starts": [*starts, record]}, indent=1))
    return record


def read_starts(path: Path) -> list[dict[str, Any]]:
    """The start records of a ``provenance.json`` ([] where there is none or it is not one)."""
    try:
        starts = json.loads(Path(path).read_text()).get("starts")
    except (OSError, ValueError, AttributeError):
        return []
    return [s for s in starts if isinstance(s, dict)] if isinstance(starts, list) else []


def machines_of(m: dict[str, Any]) -> set[str]:
    """The machine models a row's seed ran on (its provenance's starts); {} where it recorded none."""
    return {s.get("machine") or s.get("cpu_model") or "?" for s in (m.get("provenance") or {}).get("starts", [])}


def refusal(m: dict[str, Any], sha256: str, commit: Commit | None, repo: Path | None = None) -> str | None:
    """Why one (row, seed) may not count under the protocol (its hash ``sha256``, committed at ``commit``), or
    None: no provenance (trained before the protocol existed), a start under another hash, a start before the
    protocol's commit (by commit ancestry where both are known, else by time), or no commit of the protocol."""
    starts = (m.get("provenance") or {}).get("starts") or []
    if not starts:
        return "no provenance: trained before the protocol"
    if commit is None:
        return "the protocol is not committed: no row counts until it is"
    for s in starts:
        if s.get("protocol_sha256") != sha256:
            return f"ran under protocol hash {str(s.get('protocol_sha256'))[:12]}, not {sha256[:12]}"
        ran_at = s.get("commit")
        descends = contains(repo, commit.sha, ran_at) if repo and ran_at else None
        if descends is False:
            return f"ran at commit {ran_at[:10]}, which predates the protocol's commit {commit.sha[:10]}"
        started = _when(s.get("started"))
        if descends is None and (started is None or started < commit.time):
            return (f"started {s.get('started')}, before the protocol's commit {commit.sha[:10]} "
                    f"({commit.time.isoformat()})")
    return None


def _when(text: Any) -> datetime | None:
    try:
        when = datetime.fromisoformat(str(text))
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def refusals(rows: dict[str, list[dict[str, Any]]], sha256: str, commit: Commit | None,
             repo: Path | None = None) -> tuple[dict[str, list[dict[str, Any]]], list[str]]:
    """(the rows that count, one line per row name with the seeds refused and why)."""
    kept, lines = {}, []
    for name, metrics in rows.items():
        why: dict[str, list[int]] = {}
        for m in metrics:
            reason = refusal(m, sha256, commit, repo)
            if reason:
                why.setdefault(reason, []).append(m["seed"])
        kept_rows = [m for m in metrics if not any(m["seed"] in seeds for seeds in why.values())]
        if kept_rows:
            kept[name] = kept_rows
        lines += [f"refused: {name} seed(s) {','.join(map(str, seeds))}: {reason}" for reason, seeds in why.items()]
    return kept, lines


def pairing_problem(rows: dict[str, list[dict[str, Any]]], names: Sequence[str]) -> str | None:
    """One line where the rows ``names`` of a claim ran on more than one machine model (a claim never pairs them),
    else None."""
    models = sorted({model for n in names for m in rows.get(n, []) for model in machines_of(m)})
    if len(models) > 1:
        return (f"rows from {len(models)} machine models ({'; '.join(models)}) are never paired: rerun the claim's "
                "rows on one")
    return None


# ------------------------------------------------------------------------------------------- the PE-free ceiling
def patches_of(images: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, C * patch * patch), patches in row-major grid order."""
    b, c, h, w = images.shape
    if h % patch or w % patch:
        raise ValueError(f"{h}x{w} images do not split into {patch} px patches")
    grid = images.unfold(2, patch, patch).unfold(3, patch, patch)  # (B, C, H/p, W/p, p, p)
    return grid.permute(0, 2, 3, 1, 4, 5).reshape(b, (h // patch) * (w // patch), c * patch * patch)


def patch_ids(patches: torch.Tensor) -> torch.Tensor:
    """(B, N, D) patches -> (B, N) int64 ids, equal where the patches are identical (one ``torch.unique`` over all
    the images' patches, not one per image)."""
    b, n, d = patches.shape
    return torch.unique(patches.reshape(b * n, d), dim=0, return_inverse=True)[1].reshape(b, n)


def _distinct(ids: torch.Tensor, asked: torch.Tensor | None = None) -> int:
    """Distinct ids per row of (B, K) ``ids``, summed over the rows; ``asked``: (B, K) bool, the entries counted."""
    if asked is not None:
        ids = torch.where(asked, ids, -1)  # the entries not asked: one value below every id, then left out
    ordered = ids.sort(dim=1).values
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    return int((first & (ordered >= 0)).sum())


def position_ceiling(images: torch.Tensor, patch: int) -> float:
    """The best position top-1 a model without a PE can reach on ``images`` when every patch is asked its position
    (MP3): identical patches of one image get identical outputs, so of each group of identical patches at most one
    is right. The share of distinct patches per image, pooled over the images."""
    ids = patch_ids(patches_of(images, patch))
    return _distinct(ids) / (ids.shape[0] * ids.shape[1])


def droppos_grid_ceiling(images: torch.Tensor, patch: int,
                         mask_ratios: Sequence[float] = (0.0, 0.25, 0.5, 0.75),
                         pos_mask_ratios: Sequence[float] = (0.25, 0.5, 0.75, 0.95), seed: int = 0) -> float:
    """The same ceiling for DropPos's averaged position accuracy (DropPos Tables 1-4): per (gamma, gamma_pos)
    cell, the patches asked are the visible ones whose PE is dropped (DropPos's own masks: ``random_masking`` /
    ``num_kept``); identical patches among them get identical outputs. Pooled per cell over the images (as
    ``position_accuracy_grid``), then the mean of the cells."""
    from patchplace.objectives.common import num_kept, random_masking

    ids = patch_ids(patches_of(images, patch))
    b, n = ids.shape
    generator, cells = torch.Generator().manual_seed(seed), []
    for gamma in mask_ratios:
        for gamma_pos in pos_mask_ratios:
            visible, _, _ = random_masking(b, n, num_kept(n, gamma), "cpu", generator)
            v = visible.shape[1]
            _, dropped, _ = random_masking(b, v, num_kept(v, gamma_pos), "cpu", generator)
            if dropped.any():  # a cell that asks nothing (a grid too small for it) has no accuracy
                hits = _distinct(ids.gather(1, visible), dropped.bool())
                cells.append(hits / int(dropped.sum()))
    return sum(cells) / len(cells)


def validation_images(train: Path, holdout: int, seed: int = 0, pad_to: int = 32) -> torch.Tensor:
    """The validation images of a study (``data.holdout`` class-balanced images of the train split,
    ``data.holdout_seed``), zero-padded as the stages pad them: uint8 (N, C, pad_to, pad_to)."""
    from patchplace.data.memory import InMemorySplit
    from patchplace.data.transforms import PadTo
    from patchplace.pipelines.engine.inputs import holdout_indices

    split = InMemorySplit.load(Path(train))
    images = split.inputs[holdout_indices(split.labels, holdout, seed)]
    return PadTo(pad_to)(images) if pad_to else images


def ceilings_of_split(images: torch.Tensor, patches: Sequence[int]) -> dict[str, float]:
    """{``all_patches@<p>``, ``droppos_grid@<p>``: ceiling} for each patch size (the keys a protocol records)."""
    out = {}
    for p in patches:
        out[f"all_patches@{p}"] = round(position_ceiling(images, p), 4)
        out[f"droppos_grid@{p}"] = round(droppos_grid_ceiling(images, p), 4)
    return out


# ------------------------------------------------------------------------------------------ the doubling rule
def doubling_decision(seed0: dict[str, float | None], threshold: dict[str, float], epochs: float,
                      factor: float = 2.0) -> dict[str, Any]:
    """The pre-stated rule on one epoch group: where any row's seed-0 measure on validation (``seed0``: row ->
    value, None: not measured) is below its ``threshold``, the epochs are multiplied by ``factor`` (double) once
    for every seed; otherwise they stay. A row still below at the doubled epochs is out of regime (the claims'
    regime check says so)."""
    below = sorted(r for r, v in seed0.items() if v is None or v < threshold[r])
    values = {r: (None if v is None else round(v, 4)) for r, v in seed0.items()}
    return {"seed0_validation": values, "threshold": {r: round(t, 4) for r, t in threshold.items()},
            "below": below, "doubled": bool(below), "epochs": epochs * factor if below else epochs}


# ------------------------------------------------------------------------------ the paper's effect on log-odds
def logit(p: float) -> float:
    """log(p / (1 - p)), kept finite at 0 and 1 (clipped to [1e-4, 1 - 1e-4])."""
    p = min(max(p, 1e-4), 1 - 1e-4)
    return math.log(p / (1 - p))


def paper_log_odds(ours: float, other: float) -> float:
    """The paper's effect on the log-odds scale: logit(ours) - logit(other) (accuracies in [0, 1])."""
    return logit(ours) - logit(other)
