"""The export-only attention path ORT's fusion recognises, and the split of fused skip layer norms."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from patchplace.export.optimize import MS_DOMAIN, FusableAttention, fusable, split_skip_layer_norm
from patchplace.models import Attention, ModelError, create_model


@pytest.mark.parametrize("qkv_bias", [True, False])
def test_fusable_attention_computes_the_training_attention(qkv_bias):
    torch.manual_seed(0)
    attn = Attention(32, 4, qkv_bias=qkv_bias).eval()
    if qkv_bias:
        torch.nn.init.normal_(attn.qkv.bias)
    export = FusableAttention(attn)
    x, bias = torch.randn(3, 9, 32), torch.randn(4, 9, 9)
    with torch.no_grad():
        for b in (None, bias):  # relbias2d's additive bias
            torch.testing.assert_close(export(x, bias=b), attn(x, bias=b), atol=1e-6, rtol=1e-5)
    with pytest.raises(ModelError, match="full self-attention only"):
        export(x, context_index=torch.zeros(3, 4, dtype=torch.long))


def test_fusable_copies_and_leaves_the_model_alone():
    torch.manual_seed(0)
    model = create_model("vit_micro", img_size=16, num_classes=3).eval()
    copy = fusable(model)
    assert all(isinstance(b.attn, FusableAttention) for b in copy.blocks)
    assert all(isinstance(b.attn, Attention) for b in model.blocks)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(copy(x), model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_bias", [False, True])
def test_split_skip_layer_norm_writes_the_same_tensors(with_bias):
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    weights = {name: rng.standard_normal(8).astype(np.float32) for name in ("gamma", "beta", "bias")}
    inputs = ["x", "skip", "gamma", "beta"] + (["bias"] if with_bias else [])
    node = helper.make_node("SkipLayerNormalization", inputs, ["y", "", "", "sum"], name="sln", domain=MS_DOMAIN,
                            epsilon=1e-5)
    graph = helper.make_graph(
        [node, helper.make_node("Mul", ["sum", "y"], ["z"])], "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3, 8]) for n in ("x", "skip")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "z")],
        [onnx.numpy_helper.from_array(v, k) for k, v in weights.items() if k in inputs])
    model = helper.make_model(graph, ir_version=10,
                              opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(MS_DOMAIN, 1)])
    feed = {n: rng.standard_normal((2, 3, 8)).astype(np.float32) for n in ("x", "skip")}

    def run(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)

    fused = run(model)
    assert split_skip_layer_norm(model.graph) == 1
    assert [n.op_type for n in model.graph.node] == ["Add"] * (2 if with_bias else 1) + ["LayerNormalization", "Mul"]
    for got, want in zip(run(model), fused, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
