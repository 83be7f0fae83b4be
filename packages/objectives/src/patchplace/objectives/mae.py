"""MAE baseline (He et al. 2022): mask 75% of patches, encode the visible ones with fixed sin-cos PEs, a light
decoder with mask tokens reconstructs normalized pixels; MSE on masked patches only."""

from __future__ import annotations

import torch
from torch import nn

from patchplace.models import Backbone, sincos_2d

from .common import (
    BackboneObjective,
    ObjectiveError,
    TransformerDecoder,
    gather_rows,
    num_kept,
    random_masking,
    split_batch,
)
from .configs import MAEConfig
from .registry import register_method


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, p*p*C), MAE's order (row-major patches, pixels then channels)."""
    b, c, h, w = images.shape
    p = patch_size
    x = images.reshape(b, c, h // p, p, w // p, p)
    return torch.einsum("nchpwq->nhwpqc", x).reshape(b, (h // p) * (w // p), p * p * c)


def pixel_targets(images: torch.Tensor, patch_size: int, normalize: bool = True) -> torch.Tensor:
    """(B, N, p*p*C) patches; with ``normalize`` each patch is standardized by its own mean / variance (MAE's
    norm_pix_loss, eps 1e-6), the target of MAE and RandSAC."""
    target = patchify(images, patch_size)
    if normalize:
        mean, var = target.mean(dim=-1, keepdim=True), target.var(dim=-1, keepdim=True)
        target = (target - mean) / (var + 1e-6) ** 0.5
    return target


@register_method("mae")
class MAE(BackboneObjective):
    """Masked autoencoder on an image backbone with ``pos_embed='sincos2d'`` and a class token.

    A training loop (``progress``: the fraction of training done, in [0, 1]; schedules read it):

    >>> import torch
    >>> from patchplace.models import create_model
    >>> from patchplace.objectives import MAE, MAEConfig
    >>> model = MAE(create_model("vit_micro", in_chans=1, pos_embed="sincos2d"),
    ...             MAEConfig(decoder_dim=32, decoder_depth=1, decoder_heads=2))
    >>> opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    >>> steps = 3
    >>> for step in range(steps):
    ...     images, labels = torch.randn(8, 1, 32, 32), torch.randint(0, 10, (8,))
    ...     out = model(images, progress=step / steps)  # loss
    ...     opt.zero_grad(); out["loss"].backward(); opt.step()
    >>> bool(torch.isfinite(out["loss"]))
    True
    """

    no_weight_decay_tokens = ("mask_token",)

    def __init__(self, backbone: Backbone | nn.Module, config: MAEConfig | None = None) -> None:
        super().__init__()
        self.config = c = self.setup_backbone(backbone, config or MAEConfig())  # the registration's facts
        backbone = self.backbone
        n = backbone.num_patches
        if num_kept(n, c.mask_ratio) >= n:  # the loss is over masked patches only: it would be 0 at every step
            raise ObjectiveError(f"mask_ratio={c.mask_ratio:g} masks none of the {n} patches, so MAE's loss (over the "
                                 "masked patches) is 0 and nothing trains: use a ratio that masks at least one "
                                 f"(> {0.5 / n:.3g}; the paper's is 0.75)")
        self.patch_size = backbone.config.patch_size
        self.decoder = TransformerDecoder(backbone.embed_dim, c.decoder_dim, c.decoder_depth, c.decoder_heads)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, c.decoder_dim))
        nn.init.normal_(self.mask_token, std=0.02)
        table = torch.cat([torch.zeros(1, c.decoder_dim), sincos_2d(backbone.grid, c.decoder_dim)]).unsqueeze(0)
        self.register_buffer("decoder_pos", table, persistent=False)  # fixed, CLS row 0 (as MAE)
        out = self.patch_size**2 * backbone.config.in_chans
        self.decoder_pred = nn.Linear(c.decoder_dim, out)
        nn.init.xavier_uniform_(self.decoder_pred.weight)
        nn.init.zeros_(self.decoder_pred.bias)

    def forward_encoder(self, images: torch.Tensor, mask_ratio: float, generator: torch.Generator | None = None):
        """Visible tokens (+ their sin-cos PE) -> encoder. Returns latent (B, 1+K, D), mask (B, N), ids_restore."""
        tokens = self.backbone.patch_embed(images) + self.backbone.pos_embed()
        b, n, _ = tokens.shape
        keep, mask, restore = random_masking(b, n, num_kept(n, mask_ratio), tokens.device, generator)
        latent = self.backbone.forward_tokens(self.backbone.prepend_cls(gather_rows(tokens, keep)))
        return latent, mask, restore

    def forward_decoder(self, latent: torch.Tensor, restore: torch.Tensor) -> torch.Tensor:
        """Append mask tokens, unshuffle, add decoder PE, decode -> (B, N, p*p*C) pixel predictions."""
        x = self.decoder.embed(latent)
        b, n = restore.shape
        masked = self.mask_token.expand(b, n + 1 - x.shape[1], -1)
        patches = gather_rows(torch.cat([x[:, 1:], masked], dim=1), restore)  # back to raster order
        x = torch.cat([x[:, :1], patches], dim=1) + self.decoder_pos
        return self.decoder_pred(self.decoder(x))[:, 1:]

    def forward_loss(self, images: torch.Tensor, pred: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean squared error per patch, averaged over the masked patches only (``mask`` (B, N): bool, or 1.0 where
        masked)."""
        target = pixel_targets(images.float(), self.patch_size, self.config.norm_pix_loss)  # fp32 under autocast
        per_patch = ((pred.float() - target) ** 2).mean(dim=-1)
        return (per_patch * mask).sum() / mask.sum().clamp_min(1)

    def forward(self, batch, progress: float | None = None, generator: torch.Generator | None = None) -> dict:
        images, _ = split_batch(batch)
        latent, mask, restore = self.forward_encoder(images, self.config.mask_ratio, generator)
        pred = self.forward_decoder(latent, restore)
        return {"loss": self.forward_loss(images, pred, mask.float())}
