"""Supervised baseline: the backbone trained from scratch with the fine-tuning recipe's loss — cross-entropy
with label smoothing, or soft-target cross-entropy when timm's Mixup / CutMix produced soft labels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from patchplace.models import Backbone

from .common import BackboneObjective, ObjectiveError, split_batch
from .configs import SupervisedConfig
from .registry import register_method


@register_method("supervised")
class Supervised(BackboneObjective):
    """``forward((images, labels))``: labels are class indices (B,) or soft targets (B, classes) from mixup.

    A training loop (``progress``: the fraction of training done, in [0, 1]; schedules read it):

    >>> import torch
    >>> from patchplace.models import create_model
    >>> from patchplace.objectives import Supervised, SupervisedConfig
    >>> model = Supervised(create_model("vit_micro", in_chans=1, num_classes=10), SupervisedConfig())
    >>> opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    >>> steps = 3
    >>> for step in range(steps):
    ...     images, labels = torch.randn(8, 1, 32, 32), torch.randint(0, 10, (8,))
    ...     out = model((images, labels), progress=step / steps)  # loss, acc
    ...     opt.zero_grad(); out["loss"].backward(); opt.step()
    >>> bool(torch.isfinite(out["loss"]))
    True
    """

    def __init__(self, backbone: Backbone | nn.Module, config: SupervisedConfig | None = None) -> None:
        super().__init__()
        self.config = self.setup_backbone(backbone, config or SupervisedConfig())  # the registration's facts
        self.freeze_unknown_pos()  # an MJP checkpoint's E_unk: plain supervised steps never use it

    def forward(self, batch, progress: float | None = None) -> dict:
        inputs, labels = split_batch(batch)
        if labels is None:
            raise ObjectiveError("supervised training needs (inputs, labels) batches")
        logits = self.backbone(inputs)
        loss, acc = classification_loss(logits, labels, self.config.label_smoothing)
        return {"loss": loss, "acc": acc}


def classification_loss(logits: torch.Tensor, labels: torch.Tensor,
                        label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The fine-tuning recipe's loss, shared by every supervised objective (Supervised, MJP).

    ``labels``: class indices (B,) -> cross-entropy with ``label_smoothing``; soft targets (B, classes) from timm's
    Mixup / CutMix -> soft-target cross-entropy (the smoothing is already in the targets). Returns the loss and the
    detached top-1 accuracy against the (argmax of the) labels.
    """
    logits = logits.float()  # fp32 softmax / loss whatever the autocast
    if labels.dim() == 2:  # soft targets (timm Mixup / CutMix already applied the smoothing)
        loss = torch.sum(-labels * F.log_softmax(logits, dim=-1), dim=-1).mean()
        hard = labels.argmax(dim=-1)
    else:
        loss = F.cross_entropy(logits, labels, label_smoothing=label_smoothing)
        hard = labels
    return loss, (logits.argmax(-1) == hard).float().mean().detach()
