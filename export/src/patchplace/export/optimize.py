"""ONNX Runtime's transformer optimizer on exported graphs: fused ``Attention``, ``BiasGelu`` (com.microsoft ops).

* :func:`fusable` — a copy of the module to export whose attention layers are :class:`FusableAttention`: three
  q / k / v projections and an explicit ``softmax(q k^T / sqrt(d)) v``, the subgraph ORT's attention fusion
  recognises. The training model's fused ``qkv`` + ``scaled_dot_product_attention`` exports as Slice / Squeeze and a
  reshaped key, which it does not (0 of 6 attentions fused on the study ViT).
* :func:`optimize_graph` — ``onnxruntime.transformers.optimizer`` (model type ``vit``, Python fusions only, so the
  graph is not tied to this CPU); the SkipLayerNormalizations it fuses (needed to find the attention) are split back
  into Add + LayerNormalization: ORT's CPU SkipLayerNormalization kernel is scalar, 2.3 ms vs 0.2 ms for
  LayerNormalization on the study ViT at batch 64 (one thread, this CPU).
"""

from __future__ import annotations

import copy
import logging
import math
from collections import Counter

import onnx
import torch
from onnx import helper
from torch import nn

from patchplace.models import Attention, ModelError

MS_DOMAIN = "com.microsoft"


def _projection(qkv: nn.Linear, part: int) -> nn.Linear:
    """Rows ``part`` (0 = q, 1 = k, 2 = v) of a fused qkv Linear as a Linear of their own; a zero bias when the
    layer has none (the fusion expects MatMul + Add; adding 0 changes nothing)."""
    dim = qkv.in_features
    rows = slice(part * dim, (part + 1) * dim)
    linear = nn.Linear(dim, dim).to(qkv.weight.device, qkv.weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(qkv.weight[rows])
        linear.bias.copy_(qkv.bias[rows] if qkv.bias is not None else torch.zeros(dim))
    return linear


class FusableAttention(nn.Module):
    """:class:`~patchplace.models.Attention`'s full self-attention path (with the additive bias of ``relbias2d``),
    written as ORT's attention fusion expects it; same weights, PyTorch numerics equal up to float rounding."""

    def __init__(self, attn: Attention) -> None:
        super().__init__()
        self.num_heads, self.head_dim = attn.num_heads, attn.head_dim
        self.q, self.k, self.v = (_projection(attn.qkv, i) for i in range(3))
        self.proj = attn.proj

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, n, _ = t.shape
        return t.reshape(b, n, self.num_heads, self.head_dim)

    def forward(self, x: torch.Tensor, *, attn_mask: torch.Tensor | None = None,
                context_index: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                memory: torch.Tensor | None = None, context_len: int | None = None) -> torch.Tensor:
        if attn_mask is not None or context_index is not None or memory is not None or context_len is not None:
            raise ModelError("FusableAttention is the export path: full self-attention only")
        b, n, d = x.shape
        q = self._heads(self.q(x)).transpose(1, 2)
        k = self._heads(self.k(x)).permute(0, 2, 3, 1)  # (B, heads, head_dim, N): the key layout the fusion reads
        v = self._heads(self.v(x)).transpose(1, 2)
        scores = torch.matmul(q, k) / math.sqrt(self.head_dim)
        if bias is not None:
            scores = scores + bias
        out = torch.matmul(scores.softmax(dim=-1), v)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


def fusable(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with every :class:`Attention` replaced by a :class:`FusableAttention` (``module`` is left
    as it is)."""
    module = copy.deepcopy(module)
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Attention):
                setattr(parent, name, FusableAttention(child))
    return module


def split_skip_layer_norm(graph: onnx.GraphProto) -> int:
    """Replace each SkipLayerNormalization by Add (+ Add of its bias) and LayerNormalization writing the same tensors;
    -> how many were split."""
    nodes, split = [], 0
    for node in graph.node:
        if node.domain != MS_DOMAIN or node.op_type != "SkipLayerNormalization":
            nodes.append(node)
            continue
        if any(node.output[1:3]):
            raise ValueError(f"{node.name}: mean / inv_std_var outputs are used; cannot split it")
        split += 1
        epsilon = next(a.f for a in node.attribute if a.name == "epsilon")
        summed = node.output[3] if len(node.output) > 3 and node.output[3] else f"{node.name}_sum"
        bias = node.input[4] if len(node.input) > 4 else ""
        first = f"{node.name}_skip" if bias else summed
        nodes.append(helper.make_node("Add", list(node.input[:2]), [first], name=f"{node.name}_add"))
        if bias:
            nodes.append(helper.make_node("Add", [first, bias], [summed], name=f"{node.name}_bias"))
        nodes.append(helper.make_node("LayerNormalization", [summed, *node.input[2:4]], [node.output[0]],
                                      name=f"{node.name}_norm", axis=-1, epsilon=epsilon))
    del graph.node[:]
    graph.node.extend(nodes)
    return split


def fused_ops(model: onnx.ModelProto) -> dict[str, int]:
    """Counts of the com.microsoft (ONNX Runtime contrib) ops in ``model``'s graph."""
    return dict(sorted(Counter(n.op_type for n in model.graph.node if n.domain == MS_DOMAIN).items()))


def optimize_graph(model: onnx.ModelProto, num_heads: int, hidden_size: int) -> tuple[onnx.ModelProto, dict]:
    """ONNX Runtime's transformer fusions on a copy of ``model`` -> (optimized model, what was fused).

    Raises whatever the optimizer raises on a graph it cannot handle (the caller falls back to ``model``)."""
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    options = FusionOptions("vit")
    options.enable_embed_layer_norm = False  # CLS + PE is not BERT's embedding
    options.enable_bias_skip_layer_norm = False  # the skip layer norms are split again, so neither their bias
    options.enable_shape_inference = False  # nor their broadcast check (shape inference fails on the MFCC frontend)
    source = onnx.ModelProto()
    source.CopyFrom(model)
    logging.getLogger("fusion_skiplayernorm").setLevel(logging.ERROR)  # "shape inference disabled": on purpose
    optimizer = optimize_model(source, model_type="vit", num_heads=num_heads, hidden_size=hidden_size,
                               optimization_options=options, opt_level=0)
    optimized = optimizer.model
    split = split_skip_layer_norm(optimized.graph)
    if not any(o.domain == MS_DOMAIN for o in optimized.opset_import):
        optimized.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    optimized.graph.ClearField("value_info")  # stale after the rewrite; ONNX Runtime infers shapes itself
    onnx.checker.check_model(optimized)
    return optimized, {"fused": fused_ops(optimized), "skip_layer_norms_split": split}
