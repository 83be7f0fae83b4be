"""What a kind of method curves declares: the name a registration gives it, its ``results.json`` key, the pictures
it writes, how it draws from the saved objective and its lines of ``report.md``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# (objective on the backbone's device, the images on the CPU, the same on the device, run.output) -> the result
Draw = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, Path], Any]


@dataclass(frozen=True)
class CurveKind:
    """One kind of curves, keyed by ``MethodSpec.curves`` (:data:`patchplace.pipelines.curves.CURVES`)."""

    name: str  # the registration's MethodSpec.curves
    key: str  # where results.json holds what ``draw`` returns
    files: tuple[str, ...]  # the pictures ``draw`` writes in run.output
    draw: Draw
    markdown: Callable[[Any], list[str]]  # report.md's lines of the result
