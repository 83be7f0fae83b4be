"""Multi-head self-attention with the paths the methods need.

* full attention (fine-tuning, export);
* ``attn_mask``: a boolean mask (``True`` = may attend, SDPA's convention) or an additive float mask, per sample
  or shared, e.g. RandSAC's segment-causal masks;
* ``context_len`` M: keys and values come from the **first** M tokens only, a slice of the queries' input (no
  copy), while queries are projected for all N tokens — MP3's masked attention (paper §3, App. A pseudo-code
  ``masked_attention``) once MP3 has put each sample's context first (it can: pretraining has no PE, so the model
  is equivariant to the token order); the saving comes from the K/V projections and the attention matrix
  shrinking from N to M columns, with nothing N x D saved beyond what full attention saves;
* ``context_index`` (B, M): the same with the context gathered per sample (a copy of M tokens; the general form);
* ``memory`` (B, S, D): cross-attention — keys and values come from ``memory`` (e.g. RandSAC's decoder attending
  to the encoder).

Two kernels (:func:`set_attention_kernel`, :func:`attention_kernel`): ``sdpa`` (``F.scaled_dot_product_attention``,
fused where the device has it; the default) and ``math``, the materialised softmax of the papers' time
(``softmax(q k^T / sqrt(d)) v`` with the softmax in fp32, as GPU autocast runs it), so a paper's cost table can be
measured in its setting and today's. The fused ``qkv`` Linear keeps timm's parameter names; the context paths use
its row blocks, on one low-precision copy of the input and one of the weight under autocast.

A mask shared by many layers (RandSAC's segment-causal masks) is best built once per step by :func:`additive_mask`:
in the attention dtype and with aligned rows, every layer's SDPA call then uses it as is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ModelError

ATTENTION_KERNELS = ("sdpa", "math")
_kernel = "sdpa"


def set_attention_kernel(name: str) -> str:
    """Select the attention kernel of every :class:`Attention` (``sdpa`` | ``math``); returns the previous one."""
    global _kernel
    if name not in ATTENTION_KERNELS:
        raise ModelError(f"attention kernel must be one of {ATTENTION_KERNELS}, got {name!r}")
    previous, _kernel = _kernel, name
    return previous


def get_attention_kernel() -> str:
    return _kernel


@contextlib.contextmanager
def attention_kernel(name: str) -> Iterator[None]:
    """``with attention_kernel("math"): ...`` — the kernel for the block, restored after."""
    previous = set_attention_kernel(name)
    try:
        yield
    finally:
        set_attention_kernel(previous)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
           dropout_p: float = 0.0) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v for (B, H, N, d) queries and (B, H, K, d) keys / values, by the selected
    kernel; ``mask`` bool (True = attend) or additive, broadcastable to (B, H, N, K)."""
    if _kernel == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = scores.float().softmax(dim=-1)  # fp32 softmax: what GPU autocast does (and what it saves)
    if dropout_p:
        probs = F.dropout(probs, dropout_p)
    return probs.to(v.dtype) @ v


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the autocast dtype when autocast is on (else unchanged): cast once, so the Q and K/V projections of
    the context paths save one copy of their input instead of casting (and saving) it twice."""
    return x.to(attention_dtype(x.device.type, x.dtype)) if x.is_floating_point() else x


class SliceLinear(torch.autograd.Function):
    """``x @ weight.T + bias`` for a strided view ``x`` (B, M, D) that saves the view itself for backward — no
    storage beyond its base, which the caller saves anyway — where ``F.linear`` would save a contiguous copy. The
    copies its matmuls need are transient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = x @ weight.t()
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] \
            else None
        grad_b = grad.sum(dim=tuple(range(grad.dim() - 1))) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[b, index[b]]`` for (B, N, D) tokens and (B, M) indices -> (B, M, D)."""
    return torch.gather(x, 1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


# Elements: SDPA's memory-efficient kernel pads (copies, in every call) a mask whose rows are not 8-aligned in storage.
MASK_ALIGNMENT = 16


def attention_dtype(device_type: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype attention runs in on ``device_type``: autocast's where it is on, else ``dtype`` (also on devices
    autocast does not know, such as ``meta``)."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return dtype


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean (True = attend) -> additive 0 / -inf mask in ``dtype``, made to be built once and shared by every
    layer: SDPA converts a boolean mask to this in every call, and pads (copies) one whose rows are unaligned, so
    each row here starts at a multiple of :data:`MASK_ALIGNMENT` elements of a padded buffer (a view of it)."""
    *lead, keys = allowed.shape
    padded = -(-keys // MASK_ALIGNMENT) * MASK_ALIGNMENT
    mask = torch.zeros(*lead, padded, dtype=dtype, device=allowed.device)[..., :keys]
    return mask.masked_fill_(~allowed, float("-inf"))


def as_additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean (True = attend) -> additive (0 / -inf, :func:`additive_mask`); float masks pass through."""
    return additive_mask(mask, dtype) if mask.dtype == torch.bool else mask.to(dtype)


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
                memory: torch.Tensor | None = None, context_len: int | None = None) -> torch.Tensor:
        """x (B, N, D); attn_mask broadcastable to (B, heads, N, K); bias (heads or B x heads, N, K) additive,
        K = N, M under ``context_len`` / ``context_index`` (mask / bias columns then refer to the context tokens),
        or S for ``memory`` (B, S, D). At most one of ``context_len``, ``context_index``, ``memory``."""
        b, n, d = x.shape
        if sum(t is not None for t in (context_len, context_index, memory)) > 1:
            raise ValueError("pass one of context_len, context_index, memory")
        if context_index is None and memory is None and context_len is None:
            q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        else:
            x = autocast_input(x)  # one copy for Q and K/V: the K/V source is a slice or gather of it
            if memory is not None:
                source = memory
            elif context_len is not None:
                source = x[:, :context_len]  # a view: saves nothing beyond what Q saves
            else:
                source = gather_tokens(x, context_index)
            # the row blocks of ONE cast of the weight (autocast would cast each block, a view, anew)
            dtype = attention_dtype(x.device.type, self.qkv.weight.dtype)
            wq, wkv = self.qkv.weight.to(dtype).split([d, 2 * d])
            bq, bkv = (None, None) if self.qkv.bias is None else self.qkv.bias.to(dtype).split([d, 2 * d])
            q = self._heads(F.linear(x, wq, bq))
            # a context slice is strided: F.linear would save a contiguous copy of it
            linear = SliceLinear.apply if context_len is not None else F.linear
            kv = linear(source, wkv, bkv)
            k, v = (self._heads(t) for t in kv.chunk(2, dim=-1))
        mask = attn_mask
        if bias is not None:
            mask = bias if mask is None else as_additive_mask(mask, q.dtype) + bias
        out = attend(q, k, v, mask, self.attn_drop if self.training else 0.0)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(b, n, d)))
