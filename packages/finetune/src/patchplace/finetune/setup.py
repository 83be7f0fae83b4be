"""Turning a pretrained backbone into a classifier: head, PE mode, drop path, optimizer groups, mixup."""

from __future__ import annotations

from dataclasses import replace

import torch
from timm.data import Mixup
from timm.layers import DropPath
from timm.optim import create_optimizer_v2
from torch import nn

from patchplace.models import Backbone


def prepare_for_finetune(backbone: Backbone, num_classes: int, *, pos_embed: str | None = None,
                         global_pool: str | None = None, drop_path_rate: float | None = None) -> Backbone:
    """Fresh head for ``num_classes``; optionally a new PE mode (e.g. MP3: ``none`` -> ``learned`` / ``relbias2d``,
    all other weights kept) and stochastic depth (linearly increasing over blocks, as timm)."""
    if pos_embed is not None and pos_embed != backbone.config.pos_embed:
        backbone.set_pos_embed(pos_embed)
    backbone.reset_classifier(num_classes, global_pool)
    if drop_path_rate is not None:
        set_drop_path(backbone, drop_path_rate)
    return backbone


def set_drop_path(backbone: Backbone, rate: float) -> None:
    """Stochastic depth with rates linspace(0, rate, depth) on both residual branches of every block."""
    backbone.config = replace(backbone.config, drop_path_rate=rate).validate()
    rates = torch.linspace(0, rate, len(backbone.blocks)).tolist()
    for block, r in zip(backbone.blocks, rates, strict=True):
        block.drop_path1 = DropPath(r) if r > 0 else nn.Identity()
        block.drop_path2 = DropPath(r) if r > 0 else nn.Identity()


def finetune_optimizer(model: nn.Module, *, lr: float, weight_decay: float = 0.05, layer_decay: float | None = 0.75,
                       betas: tuple[float, float] = (0.9, 0.999)) -> torch.optim.Optimizer:
    """AdamW through timm's ``create_optimizer_v2`` with layer-wise lr decay (BEiT/MAE recipe): parameter groups
    carry ``lr_scale`` = layer_decay^(depth + 1 - layer); PEs, CLS, norms and biases get no weight decay."""
    return create_optimizer_v2(model, "adamw", lr=lr, weight_decay=weight_decay, layer_decay=layer_decay,
                               betas=betas)


def build_mixup(num_classes: int, *, mixup_alpha: float = 0.8, cutmix_alpha: float = 1.0, prob: float = 1.0,
                label_smoothing: float = 0.1) -> Mixup | None:
    """timm's batch-level Mixup / CutMix (soft targets, smoothing included); None when both alphas are 0."""
    if mixup_alpha <= 0 and cutmix_alpha <= 0:
        return None
    return Mixup(mixup_alpha=mixup_alpha, cutmix_alpha=cutmix_alpha, prob=prob, label_smoothing=label_smoothing,
                 num_classes=num_classes)
