"""Classification metrics: top-k accuracy and the confusion matrix."""

from __future__ import annotations

import torch


@torch.no_grad()
def topk_correct(logits: torch.Tensor, labels: torch.Tensor, ks: tuple[int, ...] = (1, 5)) -> dict[int, int]:
    """Number of samples whose label is among the top-k logits, for each k (k capped at the class count)."""
    top = logits.topk(min(max(ks), logits.shape[-1]), dim=-1).indices
    hits = top == labels.unsqueeze(-1)
    return {k: int(hits[:, :k].any(-1).sum()) for k in ks}


@torch.no_grad()
def confusion_matrix(predictions: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """(C, C) counts, rows = true class, columns = predicted class."""
    index = labels.long() * num_classes + predictions.long()
    return torch.bincount(index, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


class Accuracy:
    """Accumulates top-1 / top-5 and the confusion matrix over batches."""

    def __init__(self, num_classes: int) -> None:
        self.num_classes, self.count = num_classes, 0
        self.correct = {1: 0, 5: 0}
        self.confusion = torch.zeros(num_classes, num_classes, dtype=torch.long)

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        logits, labels = logits.detach().float().cpu(), labels.detach().cpu()
        for k, n in topk_correct(logits, labels).items():
            self.correct[k] += n
        self.confusion += confusion_matrix(logits.argmax(-1), labels, self.num_classes)
        self.count += len(labels)

    def compute(self) -> dict:
        n = max(self.count, 1)
        return {"top1": self.correct[1] / n, "top5": self.correct[5] / n, "count": self.count,
                "confusion": self.confusion.tolist()}
