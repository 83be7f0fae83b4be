"""DropPos: pretraining ViTs by reconstructing dropped positions (Wang et al., NeurIPS 2023).

Mask a large random subset of patches, drop the PEs of most visible patches (replacing them by one learnable
[MASK] position token), and let a light decoder classify the true position of every visible patch whose PE was
dropped — with position smoothing (Eq. 5-7) and attentive reconstruction (Eq. 8-9). Where the paper and the official
code differ, docs/methods/droppos.md ("DropPos") decides; the comments below say where that is.

Usage::

    backbone = create_model("vit_small", pos_embed="sincos2d")
    objective = DropPos(backbone, DropPosConfig())
    out = objective(images, progress=step / total_steps)   # {"loss", "pos_acc", "pos_acc_top5", "sigma"}
    out["loss"].backward()
    table = position_accuracy_grid(objective, val_images)  # DropPos Tables 1-4: 4 x 4 grid + "mean"
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import trunc_normal_
from torch import nn

from patchplace.models import Backbone

from .common import (
    BackboneObjective,
    ObjectiveError,
    TransformerDecoder,
    check_positive,
    check_ratio,
    gather_rows,
    num_kept,
    random_masking,
    split_batch,
    squared_grid_distance,
    topk_accuracy,
)
from .configs import DropPosConfig
from .registry import register_method


@register_method("droppos")
class DropPos(BackboneObjective):
    """DropPos objective on a ``sincos2d`` backbone with a class token (paper §3, Alg. 1).

    ``forward(batch, progress)`` returns ``loss`` (Eq. 8) and detached metrics: ``pos_acc`` / ``pos_acc_top5``
    (plain top-1 / top-5 position accuracy over the visible tokens whose PE was dropped, each token counted once),
    ``pos_acc_attn_weighted`` (top-1 with each dropped token weighted by its attentive weight, Eq. 9 — the accuracy
    the official code logs) and the current ``sigma`` (Eq. 7). Pass ``progress`` every step: sigma decays with it.

    A training loop (``progress``: the fraction of training done, in [0, 1]; schedules read it):

    >>> import torch
    >>> from patchplace.models import create_model
    >>> from patchplace.objectives import DropPos, DropPosConfig
    >>> model = DropPos(create_model("vit_micro", in_chans=1, pos_embed="sincos2d"),
    ...                 DropPosConfig(decoder_dim=32, decoder_heads=2))
    >>> opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    >>> steps = 3
    >>> for step in range(steps):
    ...     images, labels = torch.randn(8, 1, 32, 32), torch.randint(0, 10, (8,))
    ...     out = model(images, progress=step / steps)  # loss, pos_acc, sigma
    ...     opt.zero_grad(); out["loss"].backward(); opt.step()
    >>> bool(torch.isfinite(out["loss"]))
    True
    """

    no_weight_decay_tokens = ("mask_pos_token",)  # the [MASK] position token p_mask (Eq. 3)

    def __init__(self, backbone: Backbone | nn.Module, config: DropPosConfig | None = None) -> None:
        super().__init__()
        # fixed 2D sin-cos PE (docs/methods/droppos.md) and a class token: the registration's facts
        self.config = c = self.setup_backbone(backbone, config or DropPosConfig())
        backbone = self.backbone
        self.num_patches = backbone.num_patches
        dim = backbone.embed_dim
        # One learnable [MASK] position token p_mask (Eq. 3). trunc-normal .02 as the official code (normal .02,
        # "effectively" the same): a non-zero start lets dropped tokens differ from "no PE" from step 0, like
        # MAE's mask token; zeros would also train (its gradient is non-zero) but has no advantage.
        self.mask_pos_token = nn.Parameter(trunc_normal_(torch.zeros(1, 1, dim), std=0.02))
        # Decoder without any PE (§3.2, official code): its blocks are permutation-equivariant, so the only position
        # information it gets is what the encoder put into the features (anchors + content).
        self.decoder = TransformerDecoder(dim, c.decoder_dim, c.decoder_depth, c.decoder_heads)
        self.head = nn.Linear(c.decoder_dim, self.num_patches)  # logits over ALL N positions
        nn.init.xavier_uniform_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        # d2(i, j) on the model's own grid: squared distance, as the official code (docs/methods/droppos.md),
        # though Eq. 5 says
        # "Euclidean distance".
        self.register_buffer("grid_sq_dist", squared_grid_distance(backbone.grid), persistent=False)

    # ------------------------------------------------------------------ masking (Eq. 1-2, Alg. 1)
    def mask_patches(self, batch: int, mask_ratio: float, device: torch.device | str,
                     generator: torch.Generator | None = None) -> torch.Tensor:
        """Per-sample patch mask (Eq. 1): MAE shuffle, keep the first (1 - gamma) N.

        Returns ``ids_vis`` (B, V): the (shuffled) positions of the visible patches, V = (1 - gamma) N.
        """
        ids_vis, _, _ = random_masking(batch, self.num_patches, num_kept(self.num_patches, mask_ratio),
                                       device, generator)
        return ids_vis

    def drop_positions(self, batch: int, num_vis: int, pos_mask_ratio: float, device: torch.device | str,
                       generator: torch.Generator | None = None) -> torch.Tensor:
        """Per-sample position drop among the visible tokens (Eq. 2), "using the same masking operation" (§3.1).

        Returns ``dropped`` (B, V) bool: True where the PE is replaced by [MASK] (1 - M_pos); at least one anchor
        keeps its PE (``num_kept``).
        """
        _, dropped, _ = random_masking(batch, num_vis, num_kept(num_vis, pos_mask_ratio),
                                       device, generator)
        return dropped

    # ------------------------------------------------------------------ encoder / decoder
    def position_embeddings(self, ids_vis: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
        """p' of Eq. 3 for the patch tokens: true sin-cos PE of anchors, [MASK] PE of dropped ones -> (B, V, D)."""
        true_pe = self.backbone.pos_embed(ids_vis)  # (B, V, D)
        return torch.where(dropped.unsqueeze(-1), self.mask_pos_token.to(true_pe.dtype), true_pe)

    def encoder_input(self, images: torch.Tensor, ids_vis: torch.Tensor, dropped: torch.Tensor,
                      tokens: torch.Tensor | None = None) -> torch.Tensor:
        """z' = [x_cls; x_vis] + p' (Eq. 3): (B, C, H, W) -> (B, 1 + V, D); CLS keeps its own PE p_0. ``tokens``:
        ``patch_embed(images)`` when the caller has it (the step shares it with :meth:`attention_map`)."""
        tokens = self.backbone.patch_embed(images) if tokens is None else tokens
        x_vis = gather_rows(tokens, ids_vis)  # (B, V, D)
        return self.backbone.prepend_cls(x_vis + self.position_embeddings(ids_vis, dropped))

    def forward_encoder(self, images: torch.Tensor, ids_vis: torch.Tensor, dropped: torch.Tensor,
                        tokens: torch.Tensor | None = None) -> torch.Tensor:
        """f_theta(z'): (B, C, H, W) -> (B, 1 + V, D) features of [CLS; visible]."""
        return self.backbone.forward_tokens(self.encoder_input(images, ids_vis, dropped, tokens))

    def forward_decoder(self, latent: torch.Tensor) -> torch.Tensor:
        """o = g_psi(f_theta(z')) (§3.2): (B, 1 + V, D) -> (B, V, N) position logits; CLS dropped before the head."""
        x = self.decoder(self.decoder.embed(latent))
        return self.head(x[:, 1:])

    # ------------------------------------------------------------------ targets and weights
    def sigma_at(self, progress: float | torch.Tensor | None) -> torch.Tensor:
        """sigma_t = t/T (sigma_T - sigma_0) + sigma_0 (Eq. 7), with t/T = ``progress`` in [0, 1] (None = 0), as a
        0-d float tensor: tensor math on a tensor ``progress`` (the trainer's, on the step's device: no host read,
        so it is not range-checked), a Python ``progress`` checked and placed on the model's device."""
        if progress is None or not isinstance(progress, torch.Tensor):
            p = 0.0 if progress is None else float(progress)
            if not 0.0 <= p <= 1.0:
                raise ObjectiveError(f"progress must be in [0, 1] (training fraction done), got {progress}")
            progress = torch.full((), p, dtype=torch.float64, device=self.grid_sq_dist.device)
        c = self.config  # in float64, as Python's floats (the schedule's sigma bit for bit, whichever was given)
        return c.sigma_start + progress.to(torch.float64) * (c.sigma_end - c.sigma_start)

    def smoothing_matrix(self, sigma: float | torch.Tensor) -> torch.Tensor:
        """w*(y, j) (Eq. 5-6): (N, N), row y = smoothed target of true position y, each ROW summing to 1.

        The official code divides by the column sums through a broadcasting slip; we normalize rows as Eq. 6 says
        (docs/methods/droppos.md). sigma = 0 is exactly one-hot (the limit of Eq. 5): sigma^2 is clamped to the
        smallest normal float, so every off-diagonal logit -d2 / sigma^2 (d2 >= 1) is <= -8e37 and its exp is 0,
        while the diagonal's is exp(0) = 1 — no branch on the value of sigma, no 0 / 0.
        """
        d2 = self.grid_sq_dist
        if not isinstance(sigma, torch.Tensor):
            sigma = torch.full((), float(sigma), dtype=torch.float64, device=d2.device)
        sigma2 = sigma.to(torch.float64).square().clamp_min(torch.finfo(d2.dtype).tiny)  # (sigma ** 2 in float64)
        # softmax over j == exp(-d2 / sigma^2) / row sum, without underflow to 0/0 for tiny sigma.
        return torch.softmax(-d2 / sigma2, dim=1)

    def smoothed_targets(self, labels: torch.Tensor, sigma: float | torch.Tensor) -> torch.Tensor:
        """Rows of w* for the true positions ``labels`` (B, V) -> (B, V, N) soft targets (detached)."""
        return self.smoothing_matrix(sigma)[labels].detach()

    @torch.no_grad()
    def attention_map(self, images: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """A (Eq. 9) over ALL N patches: softmax_i cos(f_cls, f_i) / tau -> (B, N), no gradient.

        f comes from the CURRENT encoder on the full, unmasked image with all true PEs (patch_embed + pos_embed +
        prepend_cls, then the blocks) — the official ``get_feature_similarity``, which however hard-codes
        tau = 0.1; we use ``config.tau``. It runs in the encoder's current train/eval mode, as the official code.
        ``tokens``: ``patch_embed(images)`` when the caller has it (the step computes it once for both forwards).
        """
        tokens = self.backbone.patch_embed(images) if tokens is None else tokens.detach()
        features = self.backbone.forward_tokens(self.backbone.prepend_cls(tokens + self.backbone.pos_embed()))
        sim = F.cosine_similarity(features[:, :1].float(), features[:, 1:].float(), dim=-1)  # (B, N)
        return torch.softmax(sim / self.config.tau, dim=-1)

    def attentive_weights(self, images: torch.Tensor, ids_vis: torch.Tensor,
                          tokens: torch.Tensor | None = None) -> torch.Tensor:
        """A_{y_i} of Eq. 8 for the visible tokens: Eq. 9 gathered at ``ids_vis`` and renormalized to sum 1 per
        sample -> (B, V), detached; all ones when tau = inf (no attentive reconstruction, no extra forward)."""
        if math.isinf(self.config.tau):
            return torch.ones(ids_vis.shape, device=ids_vis.device)
        weights = torch.gather(self.attention_map(images, tokens), 1, ids_vis)
        return (weights / weights.sum(dim=1, keepdim=True)).detach()

    # ------------------------------------------------------------------ loss
    def forward_loss(self, logits: torch.Tensor, labels: torch.Tensor, dropped: torch.Tensor,
                     weights: torch.Tensor, sigma: float | torch.Tensor) -> torch.Tensor:
        """L^attn_smooth (Eq. 8), normalized: sum(w * CE_smooth) / sum(w) over the batch's dropped-PE tokens.

        logits (B, V, N); labels (B, V) true positions; dropped (B, V) bool; weights (B, V). Anchors (kept PEs)
        get weight exactly 0, masked patches never reach the decoder. The log-softmax runs over all N positions
        (Eq. 4-6 print a sum over the (1 - gamma) N visible ones; the official code, and
        docs/methods/droppos.md, use all N).
        """
        targets = self.smoothed_targets(labels, sigma)  # (B, V, N)
        ce = -(targets * F.log_softmax(logits.float(), dim=-1)).sum(dim=-1)  # (B, V)
        w = weights.detach().float() * dropped.float()
        # No dropped token (gamma_pos = 0 or V = 1) -> loss 0 rather than 0 / 0; the official code would give nan.
        return (w * ce).sum() / w.sum().clamp_min(torch.finfo(w.dtype).tiny)

    # ------------------------------------------------------------------ forward
    def predict_positions(self, images: torch.Tensor, mask_ratio: float, pos_mask_ratio: float,
                          generator: torch.Generator | None = None, tokens: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mask, drop, encode, decode: returns ``logits`` (B, V, N), ``ids_vis`` (B, V) — which is also the label
        y = gather([0, ..., N-1], M) of §3.2, the true positions — and ``dropped`` (B, V). The patch mask draws from
        ``generator`` before the PE drop (from the device's default generator without one); ``tokens``: the
        images' ``patch_embed`` when the caller has it."""
        b, device = images.shape[0], images.device
        ids_vis = self.mask_patches(b, mask_ratio, device, generator)
        dropped = self.drop_positions(b, ids_vis.shape[1], pos_mask_ratio, device, generator)
        logits = self.forward_decoder(self.forward_encoder(images, ids_vis, dropped, tokens))
        return logits, ids_vis, dropped

    def forward(self, batch: Any, progress: float | torch.Tensor | None = None, *,
                generator: torch.Generator | None = None,
                mask_ratio: float | None = None, pos_mask_ratio: float | None = None) -> dict[str, torch.Tensor]:
        """One DropPos step on ``batch`` (images, or (images, labels) — labels are ignored).

        ``progress`` in [0, 1] drives the sigma decay (Eq. 7); ``generator`` makes the masks deterministic;
        ``mask_ratio`` / ``pos_mask_ratio`` override the config for this call only (evaluation grids).
        """
        images, _ = split_batch(batch)
        gamma = self.config.mask_ratio if mask_ratio is None else mask_ratio
        gamma_pos = self.config.pos_mask_ratio if pos_mask_ratio is None else pos_mask_ratio
        check_ratio("mask_ratio", gamma)
        check_ratio("pos_mask_ratio", gamma_pos)
        sigma = self.sigma_at(progress)
        tokens = self.backbone.patch_embed(images)  # once, for the masked encoder and the attention map (Eq. 9)
        logits, labels, dropped = self.predict_positions(images, gamma, gamma_pos, generator, tokens)
        weights = self.attentive_weights(images, labels, tokens)
        loss = self.forward_loss(logits, labels, dropped, weights, sigma)
        return {
            "loss": loss,
            # plain accuracy: every dropped-PE token counts once (what position_accuracy_grid reports)
            "pos_acc": topk_accuracy(logits.detach(), labels, k=1, weight=dropped),
            "pos_acc_top5": topk_accuracy(logits.detach(), labels, k=5, weight=dropped),
            # the official code's logged accuracy: each dropped token weighted by its attentive weight A (Eq. 9);
            # equals pos_acc when tau = inf
            "pos_acc_attn_weighted": topk_accuracy(logits.detach(), labels, k=1, weight=weights * dropped),
            "sigma": sigma.detach().float(),  # logged in float32
        }



@torch.no_grad()
def position_accuracy_grid(model: DropPos, images: torch.Tensor,
                           mask_ratios: Sequence[float] = (0.0, 0.25, 0.5, 0.75),
                           pos_mask_ratios: Sequence[float] = (0.25, 0.5, 0.75, 0.95),
                           generator: torch.Generator | None = None,
                           batch_size: int = 256) -> dict[Any, float]:
    """Top-1 position accuracy over the dropped-PE visible tokens for every (gamma, gamma_pos) (DropPos Tables 1-4,
    S3-S5: gamma in {0, .25, .5, .75} x gamma_pos in {.25, .5, .75, .95}) and their mean.

    Returns ``{(gamma, gamma_pos): accuracy, ..., "mean": mean accuracy}`` (floats in [0, 1]). Runs in eval mode
    without gradients, leaves ``model.config`` and its train/eval mode as they were; deterministic given
    ``generator`` (the cells are evaluated in order, ``batch_size`` images at a time).
    """
    if images.dim() != 4 or images.shape[0] == 0:
        raise ObjectiveError(f"images must be a non-empty (B, C, H, W) tensor, got {tuple(images.shape)}")
    check_positive("batch_size", batch_size)
    for ratio in mask_ratios:
        check_ratio("mask_ratios", ratio)
    for ratio in pos_mask_ratios:
        check_ratio("pos_mask_ratios", ratio)
    was_training = model.training
    model.eval()
    try:
        table: dict[Any, float] = {}
        for gamma in mask_ratios:
            for gamma_pos in pos_mask_ratios:
                hits, count = 0.0, 0.0
                for chunk in images.split(batch_size):
                    logits, labels, dropped = model.predict_positions(chunk, gamma, gamma_pos, generator)
                    correct = (logits.argmax(dim=-1) == labels) & dropped
                    hits += float(correct.sum())
                    count += float(dropped.sum())
                table[(float(gamma), float(gamma_pos))] = hits / count if count else float("nan")
    finally:
        model.train(was_training)
    table["mean"] = sum(table.values()) / len(table)
    return table
