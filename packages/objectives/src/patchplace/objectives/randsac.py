"""RandSAC — Random Segments with Autoregressive Coding (Hua et al. 2022, "Self-supervision through Random
Segments with Autoregressive Coding", arXiv:2203.12054).

Tokens are grouped into segments (blobs or squares, §3.2), the segments are serialized in a random, optionally
hierarchical order (§3.3), and a masked encoder-decoder predicts the pixels of each segment from the segments before
it (§4.1, Fig. 4): tokens inside a segment are predicted in parallel, segments one after another.

* Encoder: the backbone on all patch tokens + fixed 2-D sin-cos PE, no class token (the paper has none: App. B.2
  pools the encoder's average feature), under the segment-causal *source mask* (a token sees its own segment and
  the earlier ones).
* Decoder: inputs are the fixed sin-cos PEs of the tokens to predict; self-attention under the same source mask;
  cross-attention to the encoder under the *memory mask*, which also hides the segment being predicted — except for
  the first segment, which has no predecessor and "attends to its own encoding" (§4.1). Its prediction can thus
  see its own pixels, so it is left out of the loss.
* Trainable skip connections (§4.2, Table 8): decoder layer l attends to ``Z^l = sum_k W[k, l] H^k`` over the
  encoder layers' outputs H^1..H^L_enc.
* Loss: MSE to per-patch normalized pixels (``norm_pix_loss``, Tables 7, 13-14) on every token whose segment is
  not the first.

Evaluation and fine-tuning drop both masks and the decoder (§4.1 "Evaluation"): use ``model.backbone`` as is, with
full attention (the paper fine-tunes / probes on the average-pooled feature, App. B.2: ``global_pool="mean"``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.layers import Mlp
from torch import nn

from patchplace.models import Backbone, sincos_2d
from patchplace.models.attention import Attention, additive_mask, attention_dtype
from patchplace.models.backbone import CheckpointedBlock

from .common import (
    BackboneObjective,
    ObjectiveError,
    init_linear,
    split_batch,
)
from .configs import RandSACConfig
from .mae import pixel_targets
from .registry import register_method
from .segments import (
    blob_segments,
    num_squares,
    patch_random_order,
    raster_order,
    serialize,
    square_segments,
    token_positions,
)


class DecoderBlock(CheckpointedBlock):
    """Pre-norm Transformer decoder block (§4.1, Fig. 4 right): masked self-attention, masked cross-attention to the
    memory, MLP — each with a residual connection."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.cross_attn = Attention(dim, num_heads)
        self.norm3 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, self_mask: torch.Tensor | None = None,
                memory_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, d), memory (B, S, d); masks bool (True = attend) or additive, broadcastable to (B, heads, T, T / S)
        (:meth:`RandSAC.attention_masks` builds both once per step, for every layer)."""
        return self.run(self._forward, x, memory, self_mask, memory_mask)

    def _forward(self, x: torch.Tensor, memory: torch.Tensor, self_mask: torch.Tensor | None,
                 memory_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), attn_mask=self_mask)
        x = x + self.cross_attn(self.norm2(x), attn_mask=memory_mask, memory=memory)
        return x + self.mlp(self.norm3(x))


@register_method("randsac")
class RandSAC(BackboneObjective):
    """RandSAC pretraining on an image backbone with ``pos_embed='sincos2d'``.

    A training loop (``progress``: the fraction of training done, in [0, 1]; schedules read it):

    >>> import torch
    >>> from patchplace.models import create_model
    >>> from patchplace.objectives import RandSAC, RandSACConfig
    >>> model = RandSAC(create_model("vit_micro", in_chans=1, pos_embed="sincos2d", global_pool="mean"),
    ...                 RandSACConfig(decoder_dim=32, decoder_depth=1, decoder_heads=2))
    >>> opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    >>> steps = 3
    >>> for step in range(steps):
    ...     images, labels = torch.randn(8, 1, 32, 32), torch.randint(0, 10, (8,))
    ...     out = model(images, progress=step / steps)  # loss, num_segments
    ...     opt.zero_grad(); out["loss"].backward(); opt.step()
    >>> bool(torch.isfinite(out["loss"]))
    True
    >>> model.backbone.forward_features(images).shape  # evaluation: no masks, no decoder; class token + 64 patches
    torch.Size([8, 65, 32])
    """

    def __init__(self, backbone: Backbone | nn.Module, config: RandSACConfig | None = None) -> None:
        super().__init__()
        self.config = c = self.setup_backbone(backbone, config or RandSACConfig())  # the registration's facts
        backbone = self.backbone
        self.grid = tuple(backbone.grid)
        self.patch_size = backbone.config.patch_size
        if c.segments == "square" and self._num_squares() < 2:
            raise ObjectiveError(f"square_size={c.square_size} gives one segment on the {self.grid} token grid: "
                                 "nothing to predict; use a smaller square_size")
        if c.segments == "square" and c.hierarchy and c.hierarchy[0] >= self._num_squares():
            raise ObjectiveError(f"hierarchy {c.hierarchy} must start below the {self._num_squares()} square "
                                 f"segments of the {self.grid} grid")
        enc_depth, dim = len(backbone.blocks), backbone.embed_dim
        # §4.1: the decoder input is a fixed sin-cos PE of the tokens to predict, built directly in decoder width.
        self.register_buffer("decoder_pos", sincos_2d(self.grid, c.decoder_dim).unsqueeze(0), persistent=False)
        self.decoder_embed = nn.Linear(dim, c.decoder_dim)  # encoder memory -> decoder width
        self.decoder_blocks = nn.ModuleList(DecoderBlock(c.decoder_dim, c.decoder_heads, c.decoder_mlp_ratio)
                                            for _ in range(c.decoder_depth))
        self.decoder_norm = nn.LayerNorm(c.decoder_dim, eps=1e-6)
        self.decoder_pred = nn.Linear(c.decoder_dim, self.patch_size**2 * backbone.config.in_chans)
        # App. B.1: xavier-uniform for the Transformer blocks (as MAE's decoder; common.init_linear).
        self._init_decoder()
        # constant tables of the segment draws, on the model's device: the token positions of §3.2 and the squares
        self.register_buffer("token_pos", token_positions(self.grid), persistent=False)
        self.register_buffer("square_ids", square_segments(self.grid, c.square_size), persistent=False)
        # §4.2 skip connections: W (L_enc x L_dec), Z^l = sum_k W[k, l] H^k. The paper calls it a plain linear layer
        # (no softmax / normalization) and gives no init: we start every decoder layer from the average of the
        # encoder layers (W = 1 / L_enc), so all layers feed the decoder from step 0 and W stays unconstrained.
        self.skip_weight = (nn.Parameter(torch.full((enc_depth, c.decoder_depth), 1.0 / enc_depth))
                            if c.skip_connections else None)

    def _init_decoder(self) -> None:
        for module in (self.decoder_embed, self.decoder_blocks, self.decoder_pred):
            module.apply(init_linear)

    def _num_squares(self) -> int:
        return num_squares(self.grid, self.config.square_size)

    # ------------------------------------------------------------------ segments, serialization, masks
    def make_order(self, batch: int, generator: torch.Generator | None = None,
                   device: torch.device | str | None = None) -> torch.Tensor:
        """(B, N) per-sample segment rank of every token (0 = first segment), §3.1-§3.3, drawn on ``device`` (the
        model's by default) with fixed shapes: K from the config, the partitions of each level from ``hierarchy``.
        Random numbers come from ``generator`` (on its device) when given, else from ``device``'s default one."""
        c = self.config
        pos = self.token_pos if device is None else self.token_pos.to(device)
        if c.segments == "raster":
            return raster_order(self.grid, batch, pos.device)
        if c.segments == "patch_random":
            return patch_random_order(self.grid, generator, batch, pos.device)
        if c.segments == "blob":
            ids, k = blob_segments(self.grid, c.num_segments, generator, batch, positions=pos), c.num_segments
        else:
            ids, k = self.square_ids.to(pos.device).expand(batch, -1), self._num_squares()
        return serialize(ids, self.grid, c.hierarchy, generator, num_segments=k, positions=pos)

    @staticmethod
    def source_mask(order: torch.Tensor) -> torch.Tensor:
        """(B, 1, N, N) bool: query i may attend to key j iff j's segment is i's or an earlier one (Fig. 4)."""
        return (order[:, None, :] <= order[:, :, None]).unsqueeze(1)

    @staticmethod
    def memory_mask(order: torch.Tensor) -> torch.Tensor:
        """(B, 1, N, N) bool: a token of segment s sees encoder tokens of segments < s only; the first segment has
        no predecessor and sees its own encoding (§4.1): segments < max(s, 1)."""
        return (order[:, None, :] < order[:, :, None].clamp_min(1)).unsqueeze(1)

    def attention_masks(self, order: torch.Tensor, device_type: str | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """The source and memory masks of a step as additive (B, 1, N, N) masks in the attention dtype (autocast's
        where on), each built once and shared by every encoder / decoder layer (:func:`additive_mask`)."""
        dtype = attention_dtype(device_type or order.device.type, self.decoder_pos.dtype)
        return additive_mask(self.source_mask(order), dtype), additive_mask(self.memory_mask(order), dtype)

    # ------------------------------------------------------------------ encoder, decoder, loss
    def forward_encoder(self, images: torch.Tensor, order: torch.Tensor,
                        source_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Patch tokens + sin-cos PE through every block under the source mask (``source_mask``: the additive one of
        :meth:`attention_masks`, else built here). Returns H^1..H^L_enc, each (B, N, D) and passed through the
        backbone's final norm (so H^L_enc is ``forward_tokens``' output)."""
        x = self.backbone.patch_embed(images) + self.backbone.pos_embed()
        mask = self.attention_masks(order, images.device.type)[0] if source_mask is None else source_mask
        hidden = []
        for block in self.backbone.blocks:
            x = block(x, attn_mask=mask)
            hidden.append(self.backbone.norm(x))
        return hidden

    def memories(self, hidden: list[torch.Tensor]) -> torch.Tensor:
        """(L_dec, B, N, d) memory per decoder layer: the skip-connection mix of all encoder layers (§4.2), or the
        last encoder layer for every decoder layer without skip connections."""
        if self.skip_weight is None:
            return self.decoder_embed(hidden[-1]).expand(len(self.decoder_blocks), -1, -1, -1)
        mixed = torch.einsum("kl,kbnd->lbnd", self.skip_weight, torch.stack(hidden))
        return self.decoder_embed(mixed)

    def forward_decoder(self, hidden: list[torch.Tensor], order: torch.Tensor,
                        masks: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Decode every token from its PE -> (B, N, p*p*C) pixel predictions (raster order); ``masks``: the
        (source, memory) masks of :meth:`attention_masks`, else built here."""
        self_mask, memory_mask = self.attention_masks(order, hidden[0].device.type) if masks is None else masks
        x = self.decoder_pos.expand(order.shape[0], -1, -1)
        for block, memory in zip(self.decoder_blocks, self.memories(hidden), strict=True):
            x = block(x, memory, self_mask, memory_mask)
        return self.decoder_pred(self.decoder_norm(x))

    def targets(self, images: torch.Tensor) -> torch.Tensor:
        """(B, N, p*p*C) patches, normalized per patch with ``norm_pix_loss`` (as MAE)."""
        return pixel_targets(images, self.patch_size, self.config.norm_pix_loss)

    def forward_loss(self, images: torch.Tensor, pred: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """Mean squared error per patch, averaged over the tokens of every segment after the first."""
        per_patch = F.mse_loss(pred.float(), self.targets(images.float()), reduction="none").mean(dim=-1)  # fp32
        predicted = (order > 0).to(per_patch.dtype)
        return (per_patch * predicted).sum() / predicted.sum().clamp_min(1)

    def forward(self, batch, progress: float | None = None, generator: torch.Generator | None = None) -> dict:
        images, _ = split_batch(batch)
        order = self.make_order(images.shape[0], generator, images.device)
        masks = self.attention_masks(order, images.device.type)  # once for all layers
        pred = self.forward_decoder(self.forward_encoder(images, order, masks[0]), order, masks)
        loss = self.forward_loss(images, pred, order)
        return {"loss": loss, "num_segments": (order.amax(dim=1) + 1).float().mean().detach()}
