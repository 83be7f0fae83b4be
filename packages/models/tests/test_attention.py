"""Attention paths: context-only K/V (MP3), boolean / additive / per-sample masks (RandSAC), and their errors."""

from __future__ import annotations

import pytest
import torch

from patchplace.models import ModelError


def _context(b: int, n: int, m: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(n, generator=g)[:m] for _ in range(b)])


def test_non_context_tokens_cannot_influence_any_other_token(micro):
    model = micro(pos_embed="none")
    tokens = torch.randn(2, 16, 32)
    ctx = _context(2, 16, 4)
    out = model.forward_tokens(tokens, context_index=ctx)
    outside = next(i for i in range(16) if i not in ctx[0].tolist())
    changed = tokens.clone()
    changed[0, outside] += 5.0 * torch.randn(32)  # not a constant: LayerNorm would erase it
    out2 = model.forward_tokens(changed, context_index=ctx)
    others = [i for i in range(16) if i != outside]
    torch.testing.assert_close(out2[0, others], out[0, others], atol=1e-6, rtol=0)
    assert not torch.allclose(out2[0, outside], out[0, outside])  # its own query still sees its content
    torch.testing.assert_close(out2[1], out[1], atol=0, rtol=0)
    inside = ctx[0, 0]
    changed = tokens.clone()
    changed[0, inside] += 5.0 * torch.randn(32)
    out3 = model.forward_tokens(changed, context_index=ctx)
    assert (out3[0, others] - out[0, others]).abs().amax() > 1e-3, "context tokens must reach every query"


def test_context_path_equals_masked_full_attention(micro):
    """Projecting K/V only for context tokens = full attention with non-context key columns masked out."""
    model = micro(pos_embed="relbias2d")
    for block in model.blocks:  # a non-zero bias, so its column gather is exercised too
        torch.nn.init.normal_(block.rel_pos_bias.relative_position_bias_table, std=0.5)
    tokens = torch.randn(3, 17, 32)
    ctx = _context(3, 17, 6, seed=1)
    mask = torch.zeros(3, 17, 17, dtype=torch.bool)
    mask[torch.arange(3)[:, None], :, ctx] = True
    torch.testing.assert_close(model.forward_tokens(tokens, context_index=ctx),
                               model.forward_tokens(tokens, attn_mask=mask), atol=2e-5, rtol=0)


def test_segment_causal_mask_hides_later_segments(micro):
    model = micro(pos_embed="learned")
    segments = torch.tensor([0] * 5 + [1] * 6 + [2] * 6)  # 17 tokens
    mask = segments[None, :] <= segments[:, None]  # query i sees key j iff seg(j) <= seg(i)
    tokens = torch.randn(2, 17, 32)
    out = model.forward_tokens(tokens, attn_mask=mask)
    later = tokens.clone()
    later[:, 11:] += 3.0 * torch.randn(2, 6, 32)
    torch.testing.assert_close(model.forward_tokens(later, attn_mask=mask)[:, :11], out[:, :11], atol=1e-6, rtol=0)
    earlier = tokens.clone()
    earlier[:, :5] += 3.0 * torch.randn(2, 5, 32)
    assert (model.forward_tokens(earlier, attn_mask=mask)[:, 5:] - out[:, 5:]).abs().amax() > 1e-3


def test_per_sample_and_additive_masks(micro):
    model = micro()
    tokens = torch.randn(2, 17, 32)
    masks = torch.ones(2, 17, 17, dtype=torch.bool)
    masks[1, :, 9:] = False  # sample 1 may only attend to its first 9 tokens
    out = model.forward_tokens(tokens, attn_mask=masks)
    torch.testing.assert_close(out[0], model.forward_tokens(tokens[:1])[0], atol=1e-6, rtol=0)
    additive = torch.zeros(2, 17, 17).masked_fill(~masks, float("-inf"))
    torch.testing.assert_close(model.forward_tokens(tokens, attn_mask=additive), out, atol=1e-6, rtol=0)
    changed = tokens.clone()
    changed[1, 12] += 4.0 * torch.randn(32)
    torch.testing.assert_close(model.forward_tokens(changed, attn_mask=masks)[1, :12],
                               out[1, :12], atol=1e-6, rtol=0)


def test_context_first_slice_equals_the_gathered_context_values_and_gradients(micro):
    """``context_len`` M (keys / values = the first M tokens, a slice) on tokens reordered context-first gives the
    outputs of ``context_index`` on the original order, reordered the same way, and the same weight gradients."""
    model = micro(pos_embed="none")
    params = [p for name, p in model.named_parameters() if name.startswith(("blocks.", "norm."))]
    tokens = torch.randn(3, 17, 32)
    ctx = _context(3, 17, 6, seed=2)
    rest = torch.stack([torch.tensor([i for i in range(17) if i not in row.tolist()]) for row in ctx])
    order = torch.cat([ctx, rest], dim=1)
    gathered = model.forward_tokens(tokens, context_index=ctx)
    grads = torch.autograd.grad(gathered.square().sum(), params)
    first = torch.gather(tokens, 1, order[..., None].expand(-1, -1, 32))
    sliced = model.forward_tokens(first, context_len=6)
    torch.testing.assert_close(sliced, torch.gather(gathered, 1, order[..., None].expand(-1, -1, 32)),
                               atol=1e-6, rtol=0)
    for g, h in zip(grads, torch.autograd.grad(sliced.square().sum(), params), strict=True):
        torch.testing.assert_close(h, g, atol=1e-5, rtol=1e-4)


def test_slice_linear_gradients_match_autograd():
    from patchplace.models.attention import SliceLinear

    base = torch.randn(3, 7, 5, dtype=torch.double, requires_grad=True)
    weight = torch.randn(4, 5, dtype=torch.double, requires_grad=True)
    bias = torch.randn(4, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: SliceLinear.apply(x[:, :3], w, b), (base, weight, bias))
    assert torch.autograd.gradcheck(lambda x, w: SliceLinear.apply(x[:, :3], w, None), (base, weight))


@pytest.mark.parametrize("mask", ["none", "bool", "additive", "context"])
def test_math_kernel_equals_the_fused_kernel(micro, mask):
    """The materialised softmax (``math``) and SDPA compute the same attention, with every mask kind and with
    context-only keys; the kernel is restored after the block."""
    from patchplace.models import attention_kernel, get_attention_kernel

    model = micro(pos_embed="none")
    tokens = torch.randn(2, 17, 32)
    kwargs = {"none": {}, "context": {"context_len": 5},
              "bool": {"attn_mask": (torch.rand(2, 17, 17) > 0.3) | torch.eye(17, dtype=torch.bool)},
              "additive": {"attn_mask": torch.randn(17, 17)}}[mask]
    fused = model.forward_tokens(tokens, **kwargs)
    with attention_kernel("math"):
        assert get_attention_kernel() == "math"
        materialised = model.forward_tokens(tokens, **kwargs)
    assert get_attention_kernel() == "sdpa"
    torch.testing.assert_close(materialised, fused, atol=2e-5, rtol=0)
    with pytest.raises(ModelError, match="attention kernel must be one of"), attention_kernel("flash3"):
        pass


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"context_len": 0}, r"context_len must lie in \[1, 17\]"),
    ({"context_len": 18}, r"context_len must lie in \[1, 17\]"),
    ({"context_index": torch.tensor([[0, 17]])}, r"context_index values must lie in \[0, 17\)"),
    ({"context_index": torch.tensor([[0, 1]], dtype=torch.int32)}, "must be a long tensor"),
    ({"context_index": torch.tensor([0, 1])}, "must be a long tensor"),
    ({"attn_mask": torch.ones(17, 16, dtype=torch.bool)}, r"attn_mask of shape \(17, 16\) does not fit"),
    ({"attn_mask": torch.ones(2, 17, 17, dtype=torch.bool)}, r"does not fit 1 samples"),
    ({"attn_mask": torch.ones(17, 17, dtype=torch.int64)}, "must be bool"),
])
def test_bad_masks_and_indices_are_refused_before_compute(micro, kwargs, message):
    with pytest.raises(ModelError, match=message):
        micro().forward_tokens(torch.randn(1, 17, 32), **kwargs)


def test_cross_attention_takes_keys_and_values_from_memory():
    from patchplace.models import Attention

    torch.manual_seed(0)
    attn = Attention(32, 2).eval()
    x, memory = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    out = attn(x, memory=memory)
    # equals self-attention over [x; memory] where queries may only attend to the memory columns
    joint = torch.cat([x, memory], dim=1)
    mask = torch.zeros(12, 12, dtype=torch.bool)
    mask[:, 5:] = True
    torch.testing.assert_close(out, attn(joint, attn_mask=mask)[:, :5], atol=1e-6, rtol=0)
    changed = memory.clone()
    changed[0, 3] += torch.randn(32)
    assert (attn(x, memory=changed)[0] - out[0]).abs().amax() > 1e-4
    torch.testing.assert_close(attn(x, memory=changed)[1], out[1])


def test_additive_mask_is_aligned_and_equals_the_boolean_mask_in_both_kernels(micro):
    """A mask built once per step (``additive_mask``): 0 / -inf in the attention dtype, rows 16-aligned in storage
    (SDPA's memory-efficient kernel pads an unaligned mask in every call), and the same attention as the boolean."""
    from patchplace.models import attention_kernel
    from patchplace.models.attention import MASK_ALIGNMENT, additive_mask, attention_dtype

    model = micro(pos_embed="none")
    tokens = torch.randn(2, 17, 32)
    allowed = ((torch.rand(2, 1, 17, 17) > 0.4) | torch.eye(17, dtype=torch.bool))
    mask = additive_mask(allowed, torch.float32)
    assert mask.shape == allowed.shape and mask.stride(-2) % MASK_ALIGNMENT == 0 and mask.stride(-1) == 1
    assert torch.equal(mask == 0, allowed) and torch.equal(mask == float("-inf"), ~allowed)
    for kernel in ("sdpa", "math"):
        with attention_kernel(kernel):
            torch.testing.assert_close(model.forward_tokens(tokens, attn_mask=mask),
                                       model.forward_tokens(tokens, attn_mask=allowed), atol=1e-6, rtol=0)
    assert attention_dtype("cpu", torch.float32) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attention_dtype("cpu", torch.float32) == torch.bfloat16


def _casts(fn) -> dict[tuple[int, ...], int]:
    """Shapes of the floating-point casts (``_to_copy``) dispatched by ``fn()``."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Casts(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default:
                self.seen[tuple(args[0].shape)] += 1
            return func(*args, **(kwargs or {}))

    with Casts() as mode:
        fn()
    return mode.seen


@pytest.mark.parametrize("path", ["context_len", "memory"])
def test_context_paths_cast_the_qkv_weight_once_and_equal_per_block_casts(path):
    """Under autocast the context paths use the row blocks of ONE low-precision copy of the qkv weight (and bias):
    the same outputs and gradients as casting the Q block and the K/V block separately (autocast's way for views)."""
    import torch.nn.functional as F

    from patchplace.models import Attention

    torch.manual_seed(0)
    attn = Attention(32, 2).eval()
    x, memory = torch.randn(2, 9, 32), torch.randn(2, 7, 32)
    kwargs = {"context_len": {"context_len": 4}, "memory": {"memory": memory}}[path]

    def reference() -> torch.Tensor:  # each block cast on its own, as F.linear under autocast casts a weight view
        w, b, lp = attn.qkv.weight, attn.qkv.bias, torch.bfloat16
        xl = x.to(lp)
        source = xl[:, :4] if path == "context_len" else memory.to(lp)
        q = attn._heads(F.linear(xl, w[:32].to(lp), b[:32].to(lp)))
        k, v = (attn._heads(t) for t in F.linear(source, w[32:].to(lp), b[32:].to(lp)).chunk(2, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v)
        return attn.proj(out.transpose(1, 2).reshape(2, 9, 32))

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ref = reference()
        casts = _casts(lambda: attn(x, **kwargs))
        out = attn(x, **kwargs)
    assert casts[(96, 32)] == 1 and casts[(96,)] == 1, "one cast of the full qkv weight and bias"
    assert not casts[(32, 32)] and not casts[(64, 32)], "no cast of a row block"
    torch.testing.assert_close(out, out_ref, atol=0, rtol=0)
    grad = torch.autograd.grad(out.float().square().sum(), attn.qkv.weight)[0]
    grad_ref = torch.autograd.grad(out_ref.float().square().sum(), attn.qkv.weight)[0]
    torch.testing.assert_close(grad, grad_ref, atol=1e-6, rtol=1e-6)
