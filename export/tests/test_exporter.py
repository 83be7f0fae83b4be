"""Export + ONNX Runtime parity for each model kind on tiny checkpoints; errors leave nothing behind."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from patchplace.export import ExportError, export_checkpoint, onnx_session
from patchplace.models import create_model, save_pretrained


def _checkpoint(tmp_path, name: str, **overrides):
    torch.manual_seed(0)
    model = create_model(overrides.pop("preset", "vit_micro"), **overrides).eval()
    if model.config.pos_embed == "relbias2d":
        for block in model.blocks:
            torch.nn.init.normal_(block.rel_pos_bias.relative_position_bias_table, std=0.5)
    save_pretrained(model, tmp_path / name, metadata={"classes": ["a", "b", "c"], "method": "test"})
    return model, tmp_path / name


@pytest.mark.parametrize("pos_embed", ["learned", "relbias2d", "none"])
def test_image_classifier_exports_with_parity_and_a_sidecar(tmp_path, pos_embed):
    model, ckpt = _checkpoint(tmp_path, "vit", img_size=16, num_classes=3, pos_embed=pos_embed,
                              global_pool="cls" if pos_embed != "none" else "mean")
    sidecar = export_checkpoint(ckpt, tmp_path / "out" / "model.onnx")
    assert max(sidecar["parity"]["max_abs_diff"].values()) <= 1e-4
    saved = json.loads((tmp_path / "out" / "model.json").read_text())
    assert saved["classes"] == ["a", "b", "c"] and saved["inputs"][0]["shape"] == ["batch", 3, 16, 16]
    assert len(saved["provenance"]["checkpoint_sha256"]) == 64
    session = onnx_session(tmp_path / "out" / "model.onnx")
    x = torch.randn(7, 3, 16, 16)
    logits, pooled = session.run(None, {"pixels": x.numpy()})
    np.testing.assert_allclose(logits, model(x).detach().numpy(), atol=1e-4)
    np.testing.assert_allclose(pooled, model.forward_head(model.forward_features(x), pre_logits=True).detach().numpy(),
                               atol=1e-4)


def test_mjp_classifier_takes_unknown_pos(tmp_path):
    model, ckpt = _checkpoint(tmp_path, "mjp", img_size=16, num_classes=3, unknown_pos=True)
    sidecar = export_checkpoint(ckpt, tmp_path / "mjp.onnx")
    assert [i["name"] for i in sidecar["inputs"]] == ["pixels", "unknown_pos"]
    session = onnx_session(tmp_path / "mjp.onnx")
    x, marked = torch.randn(3, 3, 16, 16), torch.rand(3, 16) < 0.3
    got = session.run(None, {"pixels": x.numpy(), "unknown_pos": marked.numpy()})[0]
    np.testing.assert_allclose(got, model(x, marked).detach().numpy(), atol=1e-4)


def test_feature_extractor_and_speech_exports(tmp_path):
    _, ckpt = _checkpoint(tmp_path, "backbone", img_size=16, num_classes=0)
    with pytest.raises(ExportError, match="no classifier head"):
        export_checkpoint(ckpt, tmp_path / "bad.onnx")
    sidecar = export_checkpoint(ckpt, tmp_path / "features.onnx", kind="features")
    assert sidecar["outputs"] == ["pooled", "tokens"]
    _, speech = _checkpoint(tmp_path, "speech", preset="audio_mp3")
    wave = export_checkpoint(speech, tmp_path / "speech.onnx")
    assert wave["inputs"][0]["name"] == "waveform" and wave["inputs"][0]["shape"] == ["batch", 16000]
    feats = export_checkpoint(speech, tmp_path / "speech_features.onnx", speech_input="features")
    assert feats["inputs"][0]["shape"] == ["batch", 101, 40]


def test_failed_parity_and_bad_inputs_leave_nothing(tmp_path, monkeypatch):
    import patchplace.export.exporter as exporter

    _, ckpt = _checkpoint(tmp_path, "vit", img_size=16, num_classes=3)
    monkeypatch.setattr(exporter, "max_abs_diff", lambda *args: 0.5)  # a graph that disagrees with PyTorch
    with pytest.raises(ExportError, match=r"disagrees with PyTorch by 5.00e-01"):
        export_checkpoint(ckpt, tmp_path / "out" / "model.onnx")
    assert list((tmp_path / "out").iterdir()) == []
    with pytest.raises(ExportError, match=r"no config\.json"):
        export_checkpoint(tmp_path / "nowhere", tmp_path / "x.onnx")
    (tmp_path / "fake.onnx").write_bytes(b"not onnx")
    with pytest.raises(ExportError, match="not a loadable ONNX model"):
        onnx_session(tmp_path / "fake.onnx")
