"""What an evaluation measures and what early stopping makes of it: :func:`classify` (top-1 / top-5 / confusion of
a classifier's head over a split) and :class:`BestTracker` (the best value of ``run.early_stop_metric`` so far)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from patchplace.data import ShardDataset
from patchplace.data.memory import MemoryReader
from patchplace.models import Backbone
from patchplace.pipelines.config import ConfigError
from patchplace.pipelines.engine.launch import NonFiniteOutput


@torch.no_grad()
def classify(backbone: Backbone, dataset: ShardDataset | MemoryReader, batch_size: int, device: torch.device,
             frontend: nn.Module | None = None, unknown_pos: Callable | None = None) -> dict[str, Any]:
    """Top-1 / top-5 / confusion matrix of ``backbone``'s head over the whole dataset (eval mode)."""
    from patchplace.finetune import Accuracy

    was_training = backbone.training
    backbone.eval()
    accuracy = Accuracy(backbone.config.num_classes)
    for x, y in dataset.batches(batch_size, epoch=0):
        x = x.to(device)
        if frontend is not None:
            x = frontend(x)
        logits = backbone(x)
        if not bool(logits.isfinite().all()):  # an argmax of NaN still "scores" a class: no accuracy of it
            if bool(x.isfinite().all()) and all(bool(p.isfinite().all()) for p in backbone.parameters()):
                raise NonFiniteOutput(
                    "the model's logits overflow (inf / NaN) on data.val although its weights and inputs are finite: "
                    "its weights are too large for float32 arithmetic (the training that wrote it diverged); no "
                    "accuracy is reported; use an earlier checkpoint, or train again with a lower optim.lr / "
                    "optim.clip_grad")
            raise NonFiniteOutput("the model's logits are not finite (NaN / inf) on data.val: its weights or inputs "
                                  "hold NaN / inf; no accuracy is reported; use an earlier checkpoint or a lower "
                                  "optim.lr")
        accuracy.update(logits, y)
    backbone.train(was_training)
    return accuracy.compute()


class BestTracker:
    """Early stopping's state: the best value of ``metric`` so far, its step and evaluation, and the evaluations
    since it. Rebuilt on resume by :meth:`replay` of the log's evaluations (each one counted as when it ran)."""

    def __init__(self, metric: str, patience: int) -> None:
        self.metric, self.patience = metric, patience
        self.lower = "loss" in metric  # a loss: lower is better
        self.best: float | None = None
        self.best_step: int | None = None
        self.best_eval: dict[str, Any] = {}
        self.since = 0

    def update(self, step: int, result: dict[str, Any]) -> bool:
        """Count the evaluation ``result`` of ``step``; True when it is a new best."""
        value = result.get(self.metric)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            numbers = sorted(k for k, v in result.items() if isinstance(v, int | float) and not isinstance(v, bool))
            raise ConfigError(f"run.early_stop_metric={self.metric}: the evaluation at step {step} gives "
                              f"{value!r} for it; it reports {', '.join(numbers) or 'no number'}")
        if self.best is None or (value < self.best if self.lower else value > self.best):
            self.best, self.best_step, self.best_eval, self.since = value, step, result, 0
            return True
        self.since += 1
        return False

    @property
    def exhausted(self) -> bool:
        return self.since >= self.patience

    def replay(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            if isinstance(record.get("eval"), dict):
                self.update(record["step"], record["eval"])

    def summary(self) -> dict[str, Any]:
        return {"best_step": self.best_step, "metric": self.metric, "best": self.best, "patience": self.patience}
