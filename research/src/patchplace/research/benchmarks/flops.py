"""The benchmarks' FLOPs: counted on the real training step by ``torch.utils.flop_counter.FlopCounterMode`` (the
matrix products, convolutions and attention kernels its forward and autograd's backward dispatch; everything else
is not counted), so every objective, registered now or later, is counted by what it runs: masks drawn, no-grad
passes (DropPos's full-image reference, I-JEPA's target encoder) at 1x, a patch embedding whose input needs no
gradient at 2x. FLOPs per sample x samples/s is the achieved FLOP/s the suites report beside the matmul peak.
:func:`block_flops` is the closed form of one block, the models suite's FLOP ratio and the tests' reference."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


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


def _cpu_sdpa(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_sdpa_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


# the CPU's fused attention, which FlopCounterMode does not count (it counts the CUDA kernels)
CPU_ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa,
                 aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward}


def example_batch(objective: nn.Module, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images of the objective's backbone shape and labels of its classes, on its device."""
    obj = unwrap(objective)
    c = obj.backbone.config
    device = next(obj.parameters()).device
    g = torch.Generator(device=device).manual_seed(0)
    images = torch.randn(batch, c.in_chans, c.img_size, c.img_size, device=device, generator=g)
    return images, torch.randint(0, max(c.num_classes, 2), (batch,), device=device, generator=g)


def step_flops(objective: nn.Module, data: tuple[torch.Tensor, ...], *, amp: torch.dtype | None = None,
               progress: float = 0.5, seed: int = 0) -> int:
    """FLOPs of one forward + backward of ``objective`` on ``data`` (the whole batch), counted as it runs. The RNG
    is forked (the masks of this count are drawn from ``seed``, the caller's streams are left as they were) and the
    gradients it leaves are dropped."""
    obj = unwrap(objective)
    device = data[0].device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        counter = FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION)
        autocast = torch.autocast(device.type, dtype=amp, enabled=amp is not None)
        with counter:
            with autocast:
                loss = obj(data, progress=progress)["loss"]
            loss.backward()
    for p in obj.parameters():
        p.grad = None
    return int(counter.get_total_flops())


def train_flops(objective: nn.Module, batch: int = 64) -> int:
    """FLOPs of one training step of ``objective`` per sample: :func:`step_flops` on a random batch of ``batch``
    (the optimizer's and an EMA update's elementwise work is not counted)."""
    return step_flops(objective, example_batch(objective, batch)) // batch


def train_flops_or_none(objective: nn.Module, batch: int) -> int | None:
    """:func:`train_flops`, None where the objective cannot run a step on a random batch (e.g. it needs audio)."""
    try:
        return train_flops(objective, batch)
    except (AttributeError, RuntimeError, ValueError):
        return None
