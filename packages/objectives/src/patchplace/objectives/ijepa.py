"""I-JEPA (Assran et al. 2023, arXiv:2301.08243) with Stochastic Positional Embeddings — StoP (Bar et al. 2024,
"Stochastic positional embeddings improve masked image modeling", arXiv:2308.00566).

A context encoder sees one large context block minus 4 target blocks (I-JEPA multi-block masks); a target encoder,
the EMA of the context encoder, sees the full image; its final-normed features at the target blocks, passed through a
LayerNorm without affine, are the targets. A narrow predictor ViT receives the context tokens and one masked token per
target position and regresses the targets with smooth-L1 (beta 1), as both official codes do.

The masks (:mod:`.multiblock`) keep one shape for the whole run, so a GPU step is one graph: every sample's context
keeps K patches (by default the official collator's expected batch minimum), target blocks are padded to the largest
area the config allows, the padded slots masked out of the predictor's attention and out of the loss; they are drawn
inside the step, on the device, from the global RNG.

Predictor inputs (docs/methods/stop.md, with A, b the predictor's input Linear and psi its fixed sin-cos PE):

* I-JEPA: ``c_i = A s_i + b + psi_i``, ``m_j = m~ + psi_j`` (m~ a learned mask token);
* StoP (Eq. 3, Alg. 1 lines 9-11): ``m_j = A n_j + b + psi_j`` with ``n_j ~ N(0, sigma^2 I)`` in encoder width —
  sigma is a *standard deviation*; fresh noise per sample and target block; the *same* A for features and noise;
  the bias b plays the paper's m~ (the official code has no separate mask token with StoP), so StoP at sigma = 0 is
  I-JEPA with m~ tied to b. Ablations: noise on context tokens / both (Table 7), and a fixed covariance sigma * I
  in predictor width instead of the learned A A^T (Fig. 3).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from patchplace.models import Backbone, sincos_2d
from patchplace.models.attention import additive_mask, attention_dtype

from .common import (
    BackboneObjective,
    ObjectiveError,
    TransformerDecoder,
    gather_rows,
    split_batch,
)
from .configs import IJEPAConfig
from .multiblock import MultiBlockMasker, MultiBlockMasks
from .registry import register_method


def generator_on(device: torch.device, generator: torch.Generator | None) -> torch.Generator | None:
    """A generator that draws on ``device``: ``generator`` itself when it is there (or None: the global RNG), else
    one on ``device`` seeded from it, so a seeded CPU generator still fixes StoP's noise while the noise (B x blocks x
    T x D values a step) is drawn on the accelerator instead of on the host and copied over."""
    if generator is None or generator.device == torch.device(device):
        return generator
    seed = int(torch.randint(2**62, (), generator=generator))
    return torch.Generator(device=device).manual_seed(seed)


@register_method("ijepa")
@register_method("stop")
class IJEPA(BackboneObjective):
    """I-JEPA / StoP on an image backbone with fixed ``sincos2d`` PE (the class token, if any, is not used here).

    After each optimizer step call ``update_target(progress)``: the EMA target encoder follows the context encoder
    with a momentum scheduled by ``progress`` (``IJEPAConfig(stop=True)`` is StoP).

    A training loop (``progress``: the fraction of training done, in [0, 1]; schedules read it):

    >>> import torch
    >>> from patchplace.models import create_model
    >>> from patchplace.objectives import IJEPA, IJEPAConfig
    >>> model = IJEPA(create_model("vit_micro", in_chans=1, pos_embed="sincos2d"),
    ...               IJEPAConfig(stop=True, predictor_dim=32, predictor_depth=1, predictor_heads=2))
    >>> opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    >>> steps = 3
    >>> for step in range(steps):
    ...     images, labels = torch.randn(8, 1, 32, 32), torch.randint(0, 10, (8,))
    ...     out = model(images, progress=step / steps)  # loss
    ...     opt.zero_grad(); out["loss"].backward(); opt.step()
    ...     _ = model.update_target((step + 1) / steps)  # EMA of the target encoder (returns the momentum)
    >>> bool(torch.isfinite(out["loss"]))
    True
    """

    no_weight_decay_tokens = ("mask_token",)

    def __init__(self, backbone: Backbone | nn.Module, config: IJEPAConfig | None = None) -> None:
        super().__init__()
        self.config = c = self.setup_backbone(backbone, config or IJEPAConfig())  # the registration's facts
        backbone = self.backbone
        self.target_encoder = copy.deepcopy(backbone).requires_grad_(False)  # EMA of the context encoder
        d = backbone.embed_dim
        self.predictor = TransformerDecoder(d, c.predictor_dim, c.predictor_depth, c.predictor_heads)
        self.predictor_proj = nn.Linear(c.predictor_dim, d)
        # I-JEPA's separate mask token m~ (unused with StoP, where b plays its role).
        self.mask_token = None if c.stop else nn.Parameter(torch.zeros(1, 1, c.predictor_dim))
        if self.mask_token is not None:
            nn.init.trunc_normal_(self.mask_token, std=0.02)
        self.register_buffer("predictor_pos", sincos_2d(backbone.grid, c.predictor_dim).unsqueeze(0),
                             persistent=False)
        # the masks' fixed shapes (context K, padded target T) are settled here, once per run
        self.masker = MultiBlockMasker(backbone.grid, num_targets=c.num_targets, target_scale=c.target_scale,
                                       target_aspect=c.target_aspect, context_scale=c.context_scale,
                                       min_keep=c.min_keep, context_keep=c.context_keep)

    # ------------------------------------------------------------------ schedule and EMA
    def momentum(self, progress: float) -> float:
        """Linear EMA momentum schedule ema_start -> ema_end over training (I-JEPA)."""
        progress = min(max(float(progress), 0.0), 1.0)
        return self.config.ema_start + (self.config.ema_end - self.config.ema_start) * progress

    @torch.no_grad()
    def update_target(self, progress: float) -> float:
        """theta_target <- m theta_target + (1 - m) theta_context; call after each optimizer step."""
        m = self.momentum(progress)
        targets, online = list(self.target_encoder.parameters()), list(self.backbone.parameters())
        if len(targets) != len(online):
            raise ObjectiveError("the target encoder no longer mirrors the context encoder (parameters differ)")
        torch._foreach_mul_(targets, m)  # one fused pass over all tensors (as timm's ModelEmaV3)
        torch._foreach_add_(targets, [p.detach() for p in online], alpha=1.0 - m)
        return m

    # ------------------------------------------------------------------ steps
    def sample_masks(self, batch: int, generator: torch.Generator | None = None) -> MultiBlockMasks:
        """Multi-block masks of the run's fixed shapes, drawn on the model's device (``generator`` there, or None:
        the global RNG)."""
        return self.masker(batch, generator)

    @torch.no_grad()
    def targets(self, images: torch.Tensor) -> torch.Tensor:
        """Target encoder on the full image, final-normed, then LayerNorm without affine -> (B, N, D)."""
        enc = self.target_encoder
        features = enc.forward_tokens(enc.patch_embed(images) + enc.pos_embed())
        return F.layer_norm(features.float(), features.shape[-1:])  # fp32 targets under autocast

    def encode_context(self, images: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """Context encoder on the context tokens only (with their true PEs) -> (B, K, D)."""
        tokens = self.backbone.patch_embed(images) + self.backbone.pos_embed()
        return self.backbone.forward_tokens(gather_rows(tokens, context))

    def predictor_inputs(self, s_x: torch.Tensor, context: torch.Tensor, target: torch.Tensor,
                         generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Context inputs c (R, K, Dp) and masked-token inputs m (R, T, Dp) for R = B x num_targets rows."""
        c, a = self.config, self.predictor.embed  # a.weight = A, a.bias = b
        psi = self.predictor_pos.expand(s_x.shape[0], -1, -1)
        ctx = a(s_x) + gather_rows(psi, context)  # c_i = A s_i + b + psi_i
        psi_t = gather_rows(psi, target)
        if not c.stop:
            return ctx, self.mask_token + psi_t  # I-JEPA: m_j = m~ + psi_j

        generator = generator_on(s_x.device, generator)

        def noise(shape: tuple[int, ...]) -> torch.Tensor:  # fresh per sample, block and token
            return c.sigma * torch.randn(shape, generator=generator, device=s_x.device)

        r, t, k = target.shape[0], target.shape[1], context.shape[1]
        if c.covariance == "learned":  # Eq. 3: psi^ = A n + psi with n ~ N(0, sigma^2 I) in encoder width
            masked = F.linear(noise((r, t, s_x.shape[-1])), a.weight, a.bias) + psi_t  # A n + b + psi
            ctx_noise = F.linear(noise((r, k, s_x.shape[-1])), a.weight) if c.noise_on != "masked" else 0.0
        else:  # Fig. 3 ablation: fixed covariance sigma * I, in predictor width
            masked = a.bias + noise((r, t, c.predictor_dim)) + psi_t
            ctx_noise = noise((r, k, c.predictor_dim)) if c.noise_on != "masked" else 0.0
        if c.noise_on == "context":  # Table 7: deterministic masked positions, noisy context
            masked = a.bias + psi_t
        return ctx + ctx_noise, masked

    def forward(self, batch, progress: float | torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> dict:
        images, _ = split_batch(batch)
        generator = generator_on(images.device, generator)  # None (the trainer's case) stays None
        return self.loss_on(images, self.sample_masks(images.shape[0], generator), generator)

    def loss_on(self, images: torch.Tensor, masks: MultiBlockMasks, generator: torch.Generator | None = None) -> dict:
        """The I-JEPA / StoP loss of ``images`` under ``masks``: target slots past the batch's block area
        (``masks.target_valid``) are never attended to and count in no mean, so the loss is the official mean over
        the batch's ``h * w`` target tokens."""
        context, targets_idx, valid = masks.context, masks.targets, masks.target_valid
        b, n_blocks, t = targets_idx.shape
        s_x = self.encode_context(images, context)  # (B, K, D)
        rows = lambda x: x.repeat_interleave(n_blocks, dim=0)  # noqa: E731 - one predictor row per target block
        target_idx = targets_idx.reshape(b * n_blocks, t)
        ctx_in, masked_in = self.predictor_inputs(rows(s_x), rows(context), target_idx, generator)
        tokens = torch.cat([ctx_in, masked_in], dim=1)
        out = self.predictor(tokens, attn_mask=self.key_padding(valid, ctx_in.shape[1], tokens))
        prediction = self.predictor_proj(out[:, ctx_in.shape[1]:])  # (B * blocks, T, D)
        # Gather every block's targets from the (B, N, D) features at once: the same rows as repeating the features
        # per block first, without copying them num_targets times.
        target = gather_rows(self.targets(images), targets_idx.reshape(b, n_blocks * t)).reshape(b * n_blocks, t, -1)
        weight = valid.to(torch.float32)  # (T,)
        per_token = F.smooth_l1_loss(prediction.float(), target.float(), reduction="none", beta=1.0).mean(-1)
        loss = (per_token * weight).sum() / (weight.sum() * per_token.shape[0])  # fp32 under autocast
        return {"loss": loss, "context_tokens": torch.full((), float(context.shape[1]), device=images.device),
                "target_std": masked_std(target.detach(), weight).mean()}

    @staticmethod
    def key_padding(valid: torch.Tensor, context_len: int, tokens: torch.Tensor) -> torch.Tensor:
        """(1, 1, 1, K + T) additive mask, built once per step for every predictor block (:func:`additive_mask`):
        -inf on the padded target slots, in the dtype the predictor attends in."""
        keep = torch.cat([valid.new_ones(context_len), valid]).view(1, 1, 1, -1)
        return additive_mask(keep, attention_dtype(tokens.device.type, tokens.dtype))


def masked_std(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(R, T, D), (T,) 0/1 -> (R, D): the standard deviation over the weighted tokens (unbiased, as ``std``)."""
    w = weight.view(1, -1, 1)
    n = weight.sum()
    mean = (x * w).sum(1, keepdim=True) / n
    return (((x - mean) ** 2 * w).sum(1) / (n - 1)).sqrt()
