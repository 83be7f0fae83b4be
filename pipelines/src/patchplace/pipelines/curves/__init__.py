"""Each method's own evaluation curves, drawn by evaluate.py from the checkpoint's saved objective
(``objective.safetensors``): one module per kind, keyed by the name a method's registration gives it
(``MethodSpec.curves``), each declaring its ``results.json`` key, the pictures it writes in run.output and its lines
of ``report.md`` (:class:`CurveKind`). Adding a kind is one module here and its entry in :data:`CURVES`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from patchplace.models import ModelError
from patchplace.models.hub import check_finite
from patchplace.objectives import MethodSpec, get_method, method_names

from . import eta, position_grid
from .kind import CurveKind

__all__ = ["CURVES", "FILES", "CurveKind", "curve_method", "markdown", "method_curves", "objective_state"]

# The curves a method's registration may name (MethodSpec.curves): each draws from its objective and the images.
CURVES: dict[str, CurveKind] = {kind.name: kind for kind in (eta.KIND, position_grid.KIND)}
FILES = tuple(name for kind in CURVES.values() for name in kind.files)  # every picture a kind may write


def objective_state(extras: Path) -> dict[str, torch.Tensor]:
    """The saved objective's parameters (``objective.safetensors``), refused in one line when unreadable or not
    finite."""
    try:
        state = load_file(str(extras))
    except Exception as exc:  # SafetensorError (a pickle renamed, a torn file): one line, no code runs
        raise ModelError(f"{extras} is not a readable safetensors file ({' '.join(str(exc).split())[:160]}): "
                         "restore it from the run's checkpoint, or evaluate without the method curves") from None
    check_finite(state, extras)
    return state


def curve_method(metadata: dict[str, Any]) -> MethodSpec | None:
    """The checkpoint's method when its saved objective gives evaluation curves (its registration says so)."""
    method = metadata.get("method")
    if method not in method_names():
        return None
    spec = get_method(method)
    return spec if spec.curves else None


def method_curves(backbone, metadata: dict, checkpoint: Path, images: torch.Tensor, out_dir: Path) -> dict:
    """The curves the checkpoint's method registers (``MethodSpec.curves``, a name of :data:`CURVES`), drawn from
    the saved objective parameters (on the backbone's device; the images and the picture stay on the CPU)."""
    spec, extras = curve_method(metadata), checkpoint / "objective.safetensors"
    if spec is None or not extras.is_file():
        return {}
    if spec.curves not in CURVES:
        raise ModelError(f"evaluate has no curves {spec.curves!r} for {spec.name}: register it with curves in "
                         f"{sorted(CURVES)} or none")
    objective = spec.build(backbone, metadata.get("objective", {}))
    state = objective_state(extras)
    missing, unexpected = objective.load_state_dict(state, strict=False)
    if unexpected or any(not k.startswith("backbone.") for k in missing):
        raise ModelError(f"{extras} does not match the {spec.name} objective")
    device = next(backbone.parameters()).device
    kind = CURVES[spec.curves]
    return {kind.key: kind.draw(objective.to(device), images, images.to(device), out_dir)}


def markdown(results: dict[str, Any]) -> list[str]:
    """``report.md``'s lines of every kind of curves ``results`` holds."""
    return [line for kind in CURVES.values() if kind.key in results for line in kind.markdown(results[kind.key])]
