"""The layers a backbone is built of: the patchifiers (image patches, speech frames), the Transformer block with its
optional relative position bias and activation checkpointing, and timm's / MAE's weight init."""

from __future__ import annotations

from typing import Any

import torch
from timm.layers import DropPath, Mlp, trunc_normal_
from torch import nn
from torch.utils.checkpoint import checkpoint

from .attention import Attention
from .errors import ModelError
from .pos_embed import RelativePositionBias2d


class PatchEmbed(nn.Module):
    """Non-overlapping p x p patches -> linear projection (a strided conv, as timm / MAE)."""

    def __init__(self, img_size: tuple[int, int], patch_size: int, in_chans: int, embed_dim: int) -> None:
        super().__init__()
        self.img_size, self.in_chans = img_size, in_chans
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.in_chans or tuple(x.shape[2:]) != self.img_size:
            raise ModelError(f"expected images (B, {self.in_chans}, {self.img_size[0]}, {self.img_size[1]}), got "
                             f"{tuple(x.shape)}: check in_chans / img_size of the model against the data")
        # contiguous (B, N, D): a transposed view would carry its strides through every residual add of a path
        # with no class-token cat or PE add (MP3), and each LayerNorm would copy it (measured on an H100, ViT-B
        # bf16: the MP3 step 11% slower than supervised with the view, see results/benchmark.md's GPU section)
        return self.proj(x).flatten(2).transpose(1, 2).contiguous()


class FrameEmbed(nn.Module):
    """Speech: each feature frame is a 1-D patch, projected by one shared Linear (MP3 §3.1)."""

    def __init__(self, num_frames: int, in_features: int, embed_dim: int) -> None:
        super().__init__()
        self.num_frames, self.in_features = num_frames, in_features
        self.proj = nn.Linear(in_features, embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[1] != self.num_frames or x.shape[2] != self.in_features:
            raise ModelError(f"expected features (B, {self.num_frames}, {self.in_features}), got {tuple(x.shape)}: "
                             "check num_frames / in_features against the MFCC frontend")
        return self.proj(x)


class CheckpointedBlock(nn.Module):
    """A Transformer block whose activations may be recomputed in the backward instead of kept (activation
    checkpointing: Chen et al. 2016, Training Deep Nets with Sublinear Memory Cost, arXiv:1604.06174), switched by
    :func:`set_grad_checkpointing` as timm's ``VisionTransformer.set_grad_checkpointing``. Off by default; a block
    runs its math through :meth:`run` and keeps it in one place either way."""

    grad_checkpointing: bool = False

    def run(self, fn: Any, *args: Any) -> torch.Tensor:
        """``fn(*args)``; while checkpointing and under autograd, through ``torch.utils.checkpoint.checkpoint``
        (non-reentrant: it replays the CPU and device RNG state, so dropout and drop path draw the same masks in the
        recomputation, and it composes with ``torch.compile``, which traces it as one higher-order op)."""
        if self.grad_checkpointing and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)


def set_grad_checkpointing(model: nn.Module, enable: bool = True) -> int:
    """Switch activation checkpointing on every Transformer block of ``model`` (a backbone, an objective with its
    decoders / predictors); returns how many blocks it switched. Parameter names and outputs are unchanged."""
    blocks = [m for m in model.modules() if isinstance(m, CheckpointedBlock)]
    for block in blocks:
        block.grad_checkpointing = enable
    return len(blocks)


class Block(CheckpointedBlock):
    """Pre-norm Transformer block (timm names) with an optional per-layer relative position bias."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, qkv_bias: bool, drop: float,
                 attn_drop: float, drop_path: float, eps: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=drop)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU, drop=drop)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.rel_pos_bias: RelativePositionBias2d | None = None

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None,
                context_index: torch.Tensor | None = None, context_len: int | None = None) -> torch.Tensor:
        return self.run(self._forward, x, attn_mask, context_index, context_len)

    def _forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None, context_index: torch.Tensor | None,
                 context_len: int | None) -> torch.Tensor:
        bias = None
        if self.rel_pos_bias is not None:
            bias = self.rel_pos_bias()  # (heads, T, T)
            if context_index is not None:  # keep the columns of the context tokens, per sample
                bias = torch.gather(bias.unsqueeze(0).expand(x.shape[0], -1, -1, -1), 3,
                                    context_index[:, None, None, :].expand(-1, bias.shape[0], bias.shape[1], -1))
            elif context_len is not None:
                bias = bias[..., :context_len]
        x = x + self.drop_path1(self.attn(self.norm1(x), attn_mask=attn_mask, context_index=context_index,
                                          bias=bias, context_len=context_len))
        return x + self.drop_path2(self.mlp(self.norm2(x)))


def _init_weights(module: nn.Module) -> None:
    """timm's ViT init (trunc-normal .02 Linear weights, zero biases); the patch conv as MAE initialises it
    (xavier-uniform of the weight viewed as a Linear)."""
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Conv2d):
        nn.init.xavier_uniform_(module.weight.view(module.out_channels, -1))
        if module.bias is not None:
            nn.init.zeros_(module.bias)
