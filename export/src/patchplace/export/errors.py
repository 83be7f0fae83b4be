"""The export's errors and its finiteness test: what every part of the exporter and the evaluator raises and
checks."""

from __future__ import annotations

import math

import numpy as np
import torch


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked, or the exported graph disagrees with PyTorch."""


class Unavailable(ExportError):
    """An optional part of an evaluation cannot run here (a missing extra, images it cannot take): the evaluator
    skips it, says why and how to get it, and keeps what the other parts measured."""


def non_finite(values: np.ndarray | torch.Tensor) -> str:
    """What in ``values`` is not finite: "NaN", "inf", "NaN and inf" — or "" when everything is finite."""
    values = torch.as_tensor(values)
    if not values.is_floating_point() or bool(torch.isfinite(values).all()):
        return ""
    return " and ".join(k for k, bad in (("NaN", torch.isnan(values).any()), ("inf", torch.isinf(values).any()))
                        if bool(bad))


DIVERGED = "the training that wrote it diverged; use an earlier checkpoint, or train again with a lower optim.lr"


def worst_check(checks: dict[str, float]) -> tuple[str, float]:
    """(name, value) of the largest difference, NaN counting as larger than any number (``max`` would skip it)."""
    name = max(checks, key=lambda k: math.inf if math.isnan(checks[k]) else checks[k])
    return name, checks[name]
