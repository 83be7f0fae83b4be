"""DropPos's curves: position accuracy over the 4 x 4 grid of patch mask ratio gamma and position mask ratio
gamma_pos, and its mean (the averaged accuracy of DropPos Tables 1-4) — "DropPos: Pre-Training Vision
Transformers by Reconstructing Dropped Positions", arXiv:2309.03576."""

from __future__ import annotations

from pathlib import Path

import torch

from patchplace.objectives import position_accuracy_grid

from .kind import CurveKind


def position_grid_curves(objective, images: torch.Tensor, on_device: torch.Tensor, out_dir: Path) -> dict:
    """DropPos: position accuracy over the (gamma, gamma_pos) grid (:func:`position_accuracy_grid`)."""
    grid = position_accuracy_grid(objective, on_device, generator=torch.Generator().manual_seed(0))
    return {("mean" if k == "mean" else f"gamma={k[0]},gamma_pos={k[1]}"): v for k, v in grid.items()}


def markdown(grid: dict) -> list[str]:
    return ["", "DropPos position accuracy: " + ", ".join(f"{k}: {v:.3f}" for k, v in grid.items())]


KIND = CurveKind("position_grid", "droppos_grid", (), position_grid_curves, markdown)
