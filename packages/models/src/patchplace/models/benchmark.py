"""Backbone benchmarks (called by ``pipelines/benchmark.py --suite models``).

``context_attention``: forward + backward time of one Transformer block with context-only keys/values at
masking ratio eta (MP3) vs full attention, measured interleaved in the same run, with the FLOP ratio counted
from the shapes beside it (only the K/V projections and the attention matrix shrink, so the bound at
eta = 0.75, N = 64, D = 192 is ~0.84).

``matmul_peak``: fp32 GEMM GFLOP/s of a large square matmul with torch's threads as configured — the denominator of
"achieved FLOP/s as a fraction of the machine's peak" in the objectives benchmark.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from .backbone import Block


def block_flops(num_tokens: int, num_keys: int, dim: int, mlp_ratio: float = 4.0) -> int:
    """Forward multiply-add FLOPs (x2) of a block: Q/out projections and MLP over N tokens, K/V over M keys,
    QK^T and AV over N x M."""
    n, m, d = num_tokens, num_keys, dim
    projections = 2 * n * d * d * 2 + 2 * m * d * d * 2  # Q + out proj on N, K + V on M
    attention = 2 * n * m * d * 2  # scores and weighted sum
    mlp = 2 * n * d * int(d * mlp_ratio) * 2
    return projections + attention + mlp


def context_attention(*, batch: int = 128, num_tokens: int = 64, dim: int = 192, num_heads: int = 3,
                      eta: float = 0.75, repeats: int = 15, warmup: int = 3, threads: int | None = None,
                      seed: int = 0) -> dict[str, Any]:
    """Median fwd+bwd seconds per step of a block, full vs context-only K/V; ratio and FLOP ratio."""
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    block = Block(dim, num_heads, 4.0, True, 0.0, 0.0, 0.0, 1e-6)
    x = torch.randn(batch, num_tokens, dim, requires_grad=True)
    m = round((1 - eta) * num_tokens)
    context = torch.rand(batch, num_tokens).argsort(dim=1)[:, :m]

    def step(ctx: torch.Tensor | None) -> float:
        start = time.perf_counter()
        block(x, context_index=ctx).sum().backward()
        seconds = time.perf_counter() - start
        block.zero_grad(set_to_none=True)
        x.grad = None
        return seconds

    for _ in range(warmup):
        step(None), step(context)
    full, ctx_times = [], []
    for _ in range(repeats):  # interleaved, so machine noise hits both alike
        full.append(step(None))
        ctx_times.append(step(context))
    t_full, t_ctx = statistics.median(full), statistics.median(ctx_times)
    return {"name": f"block_fwd_bwd/eta={eta}", "batch": batch, "tokens": num_tokens, "context_tokens": m,
            "dim": dim, "full_ms": round(t_full * 1e3, 2), "context_ms": round(t_ctx * 1e3, 2),
            "time_vs_full": round(t_ctx / t_full, 3),
            "flop_ratio": round(block_flops(num_tokens, m, dim) / block_flops(num_tokens, num_tokens, dim), 3),
            "threads": torch.get_num_threads()}


def matmul_peak(*, size: int = 2048, repeats: int = 5, warmup: int = 2, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, Any]:
    """Best and median GFLOP/s of ``size`` x ``size`` @ ``size`` x ``size`` (2 size^3 FLOPs) over ``repeats`` runs."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    out = torch.empty(size, size, device=device, dtype=dtype)

    def run() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    for _ in range(warmup):
        run()
    rates = [2 * size**3 / run() / 1e9 for _ in range(repeats)]
    return {"name": f"matmul_peak/{str(dtype).removeprefix('torch.')}/{size}", "size": size,
            "gflops": round(max(rates), 1), "median_gflops": round(statistics.median(rates), 1),
            "repeats": repeats, "threads": torch.get_num_threads(), "device": str(device)}
