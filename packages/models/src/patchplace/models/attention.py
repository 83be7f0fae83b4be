"""Multi-head self-attention with the three paths the methods need, all through ``F.scaled_dot_product_attention``.

* full attention (fine-tuning, export);
* ``attn_mask``: a boolean mask (``True`` = may attend, SDPA's convention) or an additive float mask, per sample
  or shared, e.g. RandSAC's segment-causal masks;
* ``context_index`` (B, M): keys and values are projected **only** for the gathered context tokens while queries
  are projected for all N tokens — MP3's masked attention (paper §3, App. A pseudo-code), where the saving comes
  from (K/V projections and the attention matrix shrink from N to M columns);
* ``memory`` (B, S, D): cross-attention — keys and values come from ``memory`` (e.g. RandSAC's decoder attending
  to the encoder).

The fused ``qkv`` Linear keeps timm's parameter names; the context path slices its weight rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ModelError


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[b, index[b]]`` for (B, N, D) tokens and (B, M) indices -> (B, M, D)."""
    return torch.gather(x, 1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def as_additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean (True = attend) -> additive (0 / -inf); float masks pass through."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


class Attention(nn.Module):
    """timm-compatible attention (``qkv``, ``proj``) with masks, context-only K/V and an optional bias."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0) -> None:
        super().__init__()
        if dim % num_heads:
            raise ModelError(f"embed_dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, n, _ = t.shape
        return t.reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, *, attn_mask: torch.Tensor | None = None,
                context_index: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                memory: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, N, D); attn_mask broadcastable to (B, heads, N, K); bias (heads or B x heads, N, K) additive,
        K = N, M under ``context_index`` (mask / bias columns then refer to the context tokens), or S for
        ``memory`` (B, S, D)."""
        b, n, d = x.shape
        if context_index is None and memory is None:
            q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        else:
            if context_index is not None and memory is not None:
                raise ValueError("pass context_index or memory, not both")
            source = memory if memory is not None else gather_tokens(x, context_index)
            w, bqkv = self.qkv.weight, self.qkv.bias
            q = self._heads(F.linear(x, w[:d], None if bqkv is None else bqkv[:d]))
            kv = F.linear(source, w[d:], None if bqkv is None else bqkv[d:])
            k, v = (self._heads(t) for t in kv.chunk(2, dim=-1))
        mask = attn_mask
        if bias is not None:
            mask = bias if mask is None else as_additive_mask(mask, q.dtype) + bias
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             dropout_p=self.attn_drop if self.training else 0.0)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(b, n, d)))
