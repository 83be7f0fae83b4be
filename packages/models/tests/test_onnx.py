"""Every PE mode's classifier path exports to ONNX (dynamic batch) and matches ONNX Runtime."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from patchplace.models import create_model

# The ONNX stack is optional for patchplace-models: onnx and onnxscript (torch's exporter) come with its [test] extra,
# ONNX Runtime with patchplace-export[cpu] or [gpu] (make test installs one of them)
onnx = pytest.importorskip("onnx", reason="install 'packages/models[test]' for the ONNX tests")
pytest.importorskip("onnxscript", reason="install 'packages/models[test]' for torch's ONNX exporter")
ort = pytest.importorskip("onnxruntime", reason="install patchplace-export[cpu] (or [gpu]) for ONNX Runtime")

# fp32 parity bound of docs/design.md (ONNX contract); measured max abs diff on these models: ~1e-6.
ATOL = 1e-4


def _export(model: torch.nn.Module, example: torch.Tensor, path, input_name: str) -> ort.InferenceSession:
    batch = torch.export.Dim("batch", min=1, max=1024)
    # dynamo=True: the maintained exporter since torch 2.9 (the TorchScript one is deprecated).
    torch.onnx.export(model, (example,), str(path), dynamo=True, opset_version=18, input_names=[input_name],
                      output_names=["logits"], dynamic_shapes={"x": {0: batch}}, verbose=False)
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("mode", ["none", "learned", "sincos2d", "relbias2d"])
def test_vit_exports_and_matches_onnx_runtime(micro, tmp_path, mode):
    model = micro(pos_embed=mode, global_pool="mean" if mode == "none" else "cls")
    if mode == "relbias2d":
        for block in model.blocks:
            torch.nn.init.normal_(block.rel_pos_bias.relative_position_bias_table, std=0.5)
    session = _export(model, torch.randn(2, 3, 16, 16), tmp_path / "vit.onnx", "pixels")
    for batch in (1, 5):
        x = torch.randn(batch, 3, 16, 16)
        (got,) = session.run(None, {"pixels": x.numpy()})
        np.testing.assert_allclose(got, model(x).detach().numpy(), atol=ATOL, rtol=0)


@pytest.mark.slow
def test_audio_transformer_exports_and_matches_onnx_runtime(tmp_path):
    torch.manual_seed(0)
    # the preset at 2 of its 8 blocks (every block exports the same ops; ~4 s of export instead of ~9 at 1 thread);
    # export/tests/test_exporter.py exports and checks the whole preset
    model = create_model("audio_mp3", depth=2).eval()
    session = _export(model, torch.randn(2, 101, 40), tmp_path / "audio.onnx", "features")
    x = torch.randn(3, 101, 40) * 10
    (got,) = session.run(None, {"features": x.numpy()})
    np.testing.assert_allclose(got, model(x).detach().numpy(), atol=ATOL, rtol=0)


def test_mjp_classifier_exports_with_an_unknown_pos_input(micro, tmp_path):
    model = micro(pos_embed="learned", unknown_pos=True)
    batch = torch.export.Dim("batch", min=1, max=1024)  # one shared batch dimension for both inputs
    x, marked = torch.randn(2, 3, 16, 16), torch.rand(2, 16) < 0.3
    torch.onnx.export(model, (x, marked), str(tmp_path / "mjp.onnx"), dynamo=True, opset_version=18,
                      input_names=["pixels", "unknown_pos"], output_names=["logits"],
                      dynamic_shapes={"x": {0: batch}, "unknown_pos": {0: batch}}, verbose=False)
    # (torch warns that the shared name "batch" is used once: expected for two inputs with one batch axis)
    session = ort.InferenceSession(str(tmp_path / "mjp.onnx"), providers=["CPUExecutionProvider"])
    x, marked = torch.randn(3, 3, 16, 16), torch.rand(3, 16) < 0.3
    (got,) = session.run(None, {"pixels": x.numpy(), "unknown_pos": marked.numpy()})
    np.testing.assert_allclose(got, model(x, marked).detach().numpy(), atol=ATOL, rtol=0)
