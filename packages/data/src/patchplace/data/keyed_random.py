"""Random numbers keyed by (seed, epoch, sample index, draw): the same sample gets the same augmentation whatever
batch, rank, worker count or resume point it is drawn in.

A counter-based generator: each number is a hash of its key, not the next state of a stream, so a batch of any
composition computes its samples' numbers at once (one vectorized op, on CPU or CUDA) and bit-identically. The hash
is MurmurHash3's 32-bit finalizer (``fmix32``), chained over the key's parts; it runs in int64 arithmetic that
never overflows (32-bit products are split into 16-bit halves), so the result does not depend on how a device
handles integer overflow.

    u = keyed_uniform(seed=0, epoch=3, index=torch.tensor([5, 17, 2]), draws=4)   # (3, 4) float64 in [0, 1)
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x * constant mod 2**32`` for ``0 <= x < 2**32`` in int64 without overflow."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def keyed_bits(seed: int, epoch: int, index: torch.Tensor, draws: int, stream: int = 0) -> torch.Tensor:
    """32-bit hashes (int64 in [0, 2**32)), shape ``(len(index), draws)``, of (seed, epoch, stream, index, draw)."""
    if index.dtype != torch.int64:
        index = index.to(torch.int64)
    key = torch.tensor(0, dtype=torch.int64, device=index.device)
    for part in (seed & _MASK32, seed >> 32 & _MASK32, epoch & _MASK32, stream & _MASK32):
        key = _fmix32(key ^ part)
    x = _fmix32((index[:, None] & _MASK32) ^ key)  # (B, 1)
    x = x ^ ((index[:, None] >> 32) & _MASK32)
    draw = torch.arange(draws, dtype=torch.int64, device=index.device)
    return _fmix32(_fmix32(x ^ _mul32(draw + 1, 0x9E3779B9)) + 0x6A09E667 & _MASK32)


def keyed_uniform(seed: int, epoch: int, index: torch.Tensor, draws: int, stream: int = 0) -> torch.Tensor:
    """Uniform float64 numbers in [0, 1), shape ``(len(index), draws)``, keyed as :func:`keyed_bits`."""
    return keyed_bits(seed, epoch, index, draws, stream).to(torch.float64) / 2.0**32
