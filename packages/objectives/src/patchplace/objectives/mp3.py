"""MP3 — Masked Patch Position Prediction (Zhai et al. 2022, "Position Prediction as an Effective Pretraining
Strategy", arXiv:2207.07611).

Pretraining removes every position embedding, picks a random context of ``M = round((1 - eta) N)`` patch tokens
per sample, and runs the backbone so that in *every* layer queries come from all tokens while keys/values come only
from the context tokens (§3, App. A pseudo-code ``masked_attention``); a linear head D -> N then classifies each
patch token's position with cross-entropy over all patch tokens (App. A ``mp3_loss``). The class token is part of
the input (§3.1: "we add a learnable cls token"): it has no PE, is always a context token and has no position
target, so fine-tuning's "linear classifier head after the cls token" (§3.3) reads a trained token.

Speech (§3.1, §4.3): same objective on MFCC frames, eta = 0 by default, and a random 5% of the frames get their
true (sinusoidal) PE as anchors and are excluded from the loss; the others are predicted among all T positions.
The class token gets no PE there either.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from patchplace.models import Backbone

from .common import (
    BackboneObjective,
    ObjectiveError,
    check_ratio,
    image_to_patches,
    num_kept,
    patches_to_image,
    random_shuffle,
    split_batch,
    topk_accuracy,
)
from .configs import MP3Config
from .registry import register_method


@register_method("mp3")
@register_method("mp3_speech")
class MP3(BackboneObjective):
    """MP3 on any backbone of ``patchplace.models`` (ViT patches or audio frames), with or without a class token
    (with one, it is fed without PE and kept in every sample's context; the head reads the patch tokens only).

    A training loop (``progress``: the fraction of training done, in [0, 1]; schedules read it):

    >>> import torch
    >>> from patchplace.models import create_model
    >>> from patchplace.objectives import MP3, MP3Config
    >>> model = MP3(create_model("vit_micro", in_chans=1, pos_embed="none"), MP3Config(eta=0.5))
    >>> opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    >>> steps = 3
    >>> for step in range(steps):
    ...     images, labels = torch.randn(8, 1, 32, 32), torch.randint(0, 10, (8,))
    ...     out = model(images, progress=step / steps)  # loss, pos_acc, pos_acc_top5
    ...     opt.zero_grad(); out["loss"].backward(); opt.step()
    >>> bool(torch.isfinite(out["loss"]))
    True
    """

    def __init__(self, backbone: Backbone | nn.Module, config: MP3Config | None = None) -> None:
        super().__init__()
        self.config = self.setup_backbone(backbone, config or MP3Config())  # the registration's facts
        backbone = self.backbone
        if self.config.anchor_ratio > 0 and backbone.config.pos_embed == "none":
            raise ObjectiveError("MP3 anchors need the backbone's true PE: create it with pos_embed='sincos1d' "
                                 "(speech) or 'sincos2d', or set anchor_ratio=0")
        self.num_positions = backbone.num_patches
        self.head = nn.Linear(backbone.embed_dim, self.num_positions)  # App. A: linear_head, D -> N
        nn.init.xavier_uniform_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def context_first_logits(self, inputs: torch.Tensor, eta: float | None = None,
                             anchor_ratio: float | None = None, generator: torch.Generator | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Position logits with each sample's tokens reordered so that its context comes first: (B, N, N) logits,
        the (B, N) original index of each row (the targets) and the (B, N) bool anchor mask in the same order.

        The context is a random ``M = round((1 - eta) N)`` of the patch tokens (App. A). Pretraining has no PE
        (§3; speech anchors carry theirs with them), so the model is equivariant to the order of its tokens:
        putting the context first changes no output, and every layer's keys / values are then a slice of its
        input — nothing beyond what full attention saves for backward (``Attention``'s ``context_len``)."""
        eta = self.config.eta if eta is None else eta
        anchor_ratio = self.config.anchor_ratio if anchor_ratio is None else anchor_ratio
        tokens = self.backbone.patch_embed(inputs)  # (B, N, D), no PE (§3: positions are removed)
        b, n, d = tokens.shape
        anchors = torch.zeros(b, n, dtype=torch.bool, device=tokens.device)
        if anchor_ratio > 0:  # §4.3: a random 5% of frames keep their true PE
            picked = random_shuffle(b, n, tokens.device, generator)[:, : max(1, round(anchor_ratio * n))]
            anchors.scatter_(1, picked, True)
            tokens = tokens + anchors.unsqueeze(-1) * self.backbone.pos_embed()
        m = num_kept(n, eta)
        if m == n:  # eta 0: every token is context, no reordering
            order = torch.arange(n, device=tokens.device).expand(b, n)
        else:  # the context (a random M) first, then the rest in random order
            order = random_shuffle(b, n, tokens.device, generator)
            tokens = torch.gather(tokens, 1, order.unsqueeze(-1).expand(-1, -1, d))
            if anchor_ratio > 0:  # (no anchors: all False in any order)
                anchors = torch.gather(anchors, 1, order)
        cls = self.backbone.cls_token
        if cls is not None:  # §3.1: the class token, without PE, in every sample's context
            tokens = torch.cat([cls.to(tokens.dtype).expand(b, -1, -1), tokens], dim=1)
        prefix = self.backbone.num_prefix_tokens
        features = self.backbone.forward_tokens(tokens, context_len=None if m == n else prefix + m)
        patches = features[:, prefix:]  # the class token has no position target
        return self.head(patches), order, anchors

    def position_logits(self, inputs: torch.Tensor, eta: float | None = None, anchor_ratio: float | None = None,
                        generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, N, N) position logits of the patch tokens in their original order and the (B, N) bool anchor mask,
        at masking ratio ``eta``."""
        logits, order, anchors = self.context_first_logits(inputs, eta, anchor_ratio, generator)
        inverse = torch.argsort(order, dim=1)  # row of each original token
        logits = torch.gather(logits, 1, inverse.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        return logits, torch.gather(anchors, 1, inverse)

    def forward(self, batch, progress: float | None = None, generator: torch.Generator | None = None) -> dict:
        inputs, _ = split_batch(batch)
        logits, targets, anchors = self.context_first_logits(inputs, generator=generator)
        b, n, _ = logits.shape  # targets: each row's original index
        # fp32 loss whatever the autocast (bf16 / fp16 logits over N positions)
        ce = F.cross_entropy(logits.reshape(b * n, n).float(), targets.reshape(-1), reduction="none").view(b, n)
        predicted = (~anchors).float()  # anchors are given, not predicted: excluded from the loss
        loss = (ce * predicted).sum() / predicted.sum()
        return {"loss": loss, "pos_acc": topk_accuracy(logits, targets, 1, predicted),
                "pos_acc_top5": topk_accuracy(logits, targets, 5, predicted)}


@torch.no_grad()
def position_accuracy_vs_eta(model: MP3, inputs: torch.Tensor, etas=(0.0, 0.25, 0.5, 0.75, 0.9),
                             generator: torch.Generator | None = None) -> dict[float, dict[str, float]]:
    """Top-1 / top-5 position accuracy at each evaluation masking ratio (MP3 Fig. 3); eval mode, no grad."""
    was_training = model.training
    model.eval()
    try:
        table = {}
        for eta in etas:
            check_ratio("eta", eta)
            logits, anchors = model.position_logits(inputs, eta=eta, generator=generator)
            b, n, _ = logits.shape
            targets = torch.arange(n, device=logits.device).expand(b, n)
            table[float(eta)] = {"top1": float(topk_accuracy(logits, targets, 1, ~anchors)),
                                 "top5": float(topk_accuracy(logits, targets, 5, ~anchors))}
        return table
    finally:
        model.train(was_training)


def reassemble(images: torch.Tensor, logits: torch.Tensor, patch_size: int) -> np.ndarray:
    """MP3 Fig. 2: paste each patch at its *predicted* position (argmax), averaging patches that collide;
    positions nobody predicted stay 0. ``images`` (B, C, H, W), ``logits`` (B, N, N) -> (B, H, W, C) array."""
    b, c, h, w = images.shape
    gh, gw, p = h // patch_size, w // patch_size, patch_size
    if logits.shape[1:] != (gh * gw, gh * gw):
        raise ObjectiveError(f"logits {tuple(logits.shape)} do not match a {gh}x{gw} grid of {b} images")
    patches = image_to_patches(images, p).reshape(b, gh * gw, c * p * p)
    where = logits.argmax(-1)  # (B, N) predicted position of each patch
    total = torch.zeros_like(patches).scatter_add_(1, where.unsqueeze(-1).expand_as(patches), patches)
    count = torch.zeros(b, gh * gw, 1, dtype=patches.dtype, device=patches.device)
    count.scatter_add_(1, where.unsqueeze(-1), torch.ones_like(count))
    mean = (total / count.clamp_min(1.0)).reshape(b, gh * gw, c, p, p)
    return patches_to_image(mean, (gh, gw)).permute(0, 2, 3, 1).detach().cpu().numpy()
