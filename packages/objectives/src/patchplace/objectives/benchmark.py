"""The FLOP model the engine's ``tflops`` log field reads: the matmul FLOPs of a training step per sample, counted
from the shapes (projections, attention and MLPs; a training step = 3x the forward FLOPs of everything that gets
gradients, 1x for no-grad passes such as DropPos's full-image reference forward and I-JEPA's target encoder). Goes
with that log field; the benchmarks have their own (``patchplace.research.benchmarks.flops``)."""

from __future__ import annotations

import torch
from torch import nn

from patchplace.models import Backbone

from .block_masks import multiblock_masks
from .common import num_kept
from .droppos import DropPos
from .ijepa import IJEPA
from .mae import MAE
from .mjp import MJP
from .mp3 import MP3
from .randsac import RandSAC
from .supervised import Supervised


def block_flops(num_tokens: int, num_keys: int, dim: int, mlp_ratio: float = 4.0) -> int:
    """Forward multiply-add FLOPs (x2) of a block: Q/out projections and MLP over N tokens, K/V over M keys,
    QK^T and AV over N x M."""
    n, m, d = num_tokens, num_keys, dim
    projections = 2 * n * d * d * 2 + 2 * m * d * d * 2  # Q + out proj on N, K + V on M
    attention = 2 * n * m * d * 2  # scores and weighted sum
    mlp = 2 * n * d * int(d * mlp_ratio) * 2
    return projections + attention + mlp


def unwrap(objective: nn.Module) -> nn.Module:
    return getattr(objective, "_orig_mod", objective)  # torch.compile's OptimizedModule


def encoder_flops(backbone: Backbone, tokens: int, keys: int | None = None) -> int:
    c = backbone.config
    patch = 2 * backbone.num_patches * (c.patch_size**2 * c.in_chans) * c.embed_dim
    return patch + c.depth * block_flops(tokens, tokens if keys is None else keys, c.embed_dim, c.mlp_ratio)


def decoder_flops(in_dim: int, dim: int, depth: int, tokens: int, out: int) -> int:
    return 2 * tokens * in_dim * dim + depth * block_flops(tokens, tokens, dim) + 2 * tokens * dim * out


def train_flops(objective: nn.Module, batch: int = 64) -> int:
    """FLOPs of one training step of ``objective`` per sample (the module docstring gives the model). I-JEPA's
    context and target sizes vary with the masks: they are averaged over 16 draws of ``batch`` samples."""
    objective = unwrap(objective)
    bb = objective.backbone if hasattr(objective, "backbone") else objective
    n, d = bb.num_patches, bb.embed_dim
    if isinstance(objective, (Supervised, MJP)):
        flops = 3 * (encoder_flops(bb, n + 1) + 2 * d * bb.config.num_classes)
        if isinstance(objective, MJP):  # + the DAL regressor on the N PE-table rows (mlp: D -> D -> D -> 2)
            flops += 3 * 2 * n * (2 * d * d + 2 * d)
        return flops
    if isinstance(objective, MP3):  # the class token (if any) is a query and always a key (§3.1), no target
        m, prefix = num_kept(n, objective.config.eta), bb.num_prefix_tokens
        return 3 * (encoder_flops(bb, n + prefix, m + prefix) + 2 * n * d * n)
    if isinstance(objective, MAE):
        c, k = objective.config, num_kept(n, objective.config.mask_ratio)
        out = bb.config.patch_size**2 * bb.config.in_chans
        return 3 * (encoder_flops(bb, k + 1) + decoder_flops(d, c.decoder_dim, c.decoder_depth, n + 1, out))
    if isinstance(objective, DropPos):
        c, k = objective.config, num_kept(n, objective.config.mask_ratio)
        grad = encoder_flops(bb, k + 1) + decoder_flops(d, c.decoder_dim, c.decoder_depth, k + 1, n)
        reference = 0 if c.tau == float("inf") else encoder_flops(bb, n + 1)
        return 3 * grad + reference
    if isinstance(objective, IJEPA):
        c, gen, total = objective.config, torch.Generator().manual_seed(0), 0
        for _ in range(16):  # the batched generator: every I-JEPA variant counts the same draws
            masks = multiblock_masks(batch, bb.grid, num_targets=c.num_targets, target_scale=c.target_scale,
                                     target_aspect=c.target_aspect, context_scale=c.context_scale,
                                     min_keep=c.min_keep, generator=gen)
            k, t = masks.context.shape[1], masks.targets.shape[2]
            predictor = c.num_targets * decoder_flops(d, c.predictor_dim, c.predictor_depth, k + t, 0)
            predictor += c.num_targets * 2 * t * c.predictor_dim * d
            total += 3 * (encoder_flops(bb, k) + predictor) + encoder_flops(bb, n)  # + no-grad target encoder
        return total // 16
    if isinstance(objective, RandSAC):
        c, out = objective.config, bb.config.patch_size**2 * bb.config.in_chans
        dd = c.decoder_dim
        cross = 2 * n * dd * dd * 2 + 2 * n * dd * dd * 2 + 2 * n * n * dd * 2  # Q + out, K + V, attention
        layer = block_flops(n, n, dd, c.decoder_mlp_ratio) + cross + 2 * n * d * dd  # + memory projection
        return 3 * (encoder_flops(bb, n) + c.decoder_depth * layer + 2 * n * dd * out)
    raise TypeError(f"no FLOP model for {type(objective).__name__}")
