"""Export + ONNX Runtime parity for each model kind on tiny checkpoints (ONNX Runtime's fused graph, or the plain
one when the optimizer fails); errors leave nothing behind."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from patchplace.export import ExportError, export_checkpoint, onnx_session
from patchplace.export.optimize import fused_ops, optimize_graph
from patchplace.models import create_model, save_pretrained


def _checkpoint(tmp_path, name: str, **overrides):
    torch.manual_seed(0)
    model = create_model(overrides.pop("preset", "vit_micro"), **overrides).eval()
    if model.config.pos_embed == "relbias2d":
        for block in model.blocks:
            torch.nn.init.normal_(block.rel_pos_bias.relative_position_bias_table, std=0.5)
    save_pretrained(model, tmp_path / name, metadata={"classes": ["a", "b", "c"], "method": "test"})
    return model, tmp_path / name


def _fused(path) -> dict[str, int]:
    return fused_ops(onnx.load(str(path)))


@pytest.mark.parametrize("pos_embed", ["learned", "sincos2d", "relbias2d", "none"])
def test_image_classifier_exports_with_parity_and_a_sidecar(tmp_path, pos_embed):
    model, ckpt = _checkpoint(tmp_path, "vit", img_size=16, num_classes=3, pos_embed=pos_embed,
                              global_pool="cls" if pos_embed != "none" else "mean")
    sidecar = export_checkpoint(ckpt, tmp_path / "out" / "model.onnx")
    assert max(sidecar["parity"]["max_abs_diff"].values()) <= 1e-4
    saved = json.loads((tmp_path / "out" / "model.json").read_text())
    assert saved["classes"] == ["a", "b", "c"] and saved["inputs"][0]["shape"] == ["batch", 3, 16, 16]
    assert len(saved["provenance"]["checkpoint_sha256"]) == 64
    # the shipped graph is ONNX Runtime's fused one: per block one BiasGelu and (but for relbias2d, whose additive
    # bias ORT's attention fusion does not take) one Attention; the skip layer norms are split back
    depth = model.config.depth
    assert saved["graph"]["optimized"] and saved["graph"]["skip_layer_norms_split"] == 2 * depth
    expected = {"BiasGelu": depth} if pos_embed == "relbias2d" else {"Attention": depth, "BiasGelu": depth}
    assert _fused(tmp_path / "out" / "model.onnx") == saved["graph"]["fused"] == expected
    assert saved["graph"].get("attention_unfused") == ("2 of 2" if pos_embed == "relbias2d" else None)
    session = onnx_session(tmp_path / "out" / "model.onnx")
    x = torch.randn(7, 3, 16, 16)
    logits, pooled = session.run(None, {"pixels": x.numpy()})
    np.testing.assert_allclose(logits, model(x).detach().numpy(), atol=1e-4)
    np.testing.assert_allclose(pooled, model.forward_head(model.forward_features(x), pre_logits=True).detach().numpy(),
                               atol=1e-4)
    # the metadata_props survive the optimization
    props = session.get_modelmeta().custom_metadata_map
    assert json.loads(props["classes"]) == ["a", "b", "c"] and json.loads(props["graph"]) == saved["graph"]
    assert props["checkpoint_sha256"] == saved["provenance"]["checkpoint_sha256"]
    assert json.loads(props["preprocessing"]) == saved["preprocessing"]


def test_mjp_classifier_takes_unknown_pos(tmp_path):
    model, ckpt = _checkpoint(tmp_path, "mjp", img_size=16, num_classes=3, unknown_pos=True)
    sidecar = export_checkpoint(ckpt, tmp_path / "mjp.onnx")
    assert [i["name"] for i in sidecar["inputs"]] == ["pixels", "unknown_pos"]
    assert _fused(tmp_path / "mjp.onnx") == {"Attention": 2, "BiasGelu": 2}
    session = onnx_session(tmp_path / "mjp.onnx")
    x, marked = torch.randn(3, 3, 16, 16), torch.rand(3, 16) < 0.3
    got = session.run(None, {"pixels": x.numpy(), "unknown_pos": marked.numpy()})[0]
    np.testing.assert_allclose(got, model(x, marked).detach().numpy(), atol=1e-4)


@pytest.mark.slow
def test_feature_extractor_and_speech_exports(tmp_path):
    _, ckpt = _checkpoint(tmp_path, "backbone", img_size=16, num_classes=0)
    with pytest.raises(ExportError, match="no classifier head"):
        export_checkpoint(ckpt, tmp_path / "bad.onnx")
    sidecar = export_checkpoint(ckpt, tmp_path / "features.onnx", kind="features")
    assert sidecar["outputs"] == ["pooled", "tokens"] and sidecar["graph"]["fused"]["Attention"] == 2
    _, speech = _checkpoint(tmp_path, "speech", preset="audio_mp3")
    wave = export_checkpoint(speech, tmp_path / "speech.onnx")
    assert wave["inputs"][0]["name"] == "waveform" and wave["inputs"][0]["shape"] == ["batch", 16000]
    feats = export_checkpoint(speech, tmp_path / "speech_features.onnx", speech_input="features")
    assert feats["inputs"][0]["shape"] == ["batch", 101, 40]
    for path in ("speech.onnx", "speech_features.onnx"):  # all 8 blocks, the MFCC frontend in the graph or not
        assert _fused(tmp_path / path) == {"Attention": 8, "BiasGelu": 8}, path
    assert max(wave["parity"]["max_abs_diff"].values()) <= 1e-4


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


def test_the_plain_graph_when_the_optimizer_fails_disagrees_or_is_not_asked(tmp_path, monkeypatch, capsys):
    import patchplace.export.exporter as exporter
    from patchplace.export.__main__ import main as export_main

    model, ckpt = _checkpoint(tmp_path, "vit", img_size=16, num_classes=3)
    x = torch.randn(3, 3, 16, 16)

    def check_plain(path, reason: str) -> None:
        sidecar = json.loads(path.with_suffix(".json").read_text())
        assert not sidecar["graph"]["optimized"] and sidecar["graph"]["reason"].startswith(reason)
        assert _fused(path) == {} and max(sidecar["parity"]["max_abs_diff"].values()) <= 1e-4
        got = onnx_session(path).run(None, {"pixels": x.numpy()})[0]
        np.testing.assert_allclose(got, model(x).detach().numpy(), atol=1e-4)

    export_checkpoint(ckpt, tmp_path / "plain.onnx", optimize=False)
    check_plain(tmp_path / "plain.onnx", "not asked (optimize=False)")

    def fails(*args):
        raise RuntimeError("unknown pattern")

    monkeypatch.setattr(exporter, "optimize_graph", fails)
    assert export_main([str(ckpt), "--out", str(tmp_path / "failed.onnx")]) == 0
    reason = "ONNX Runtime's optimizer failed (RuntimeError: unknown pattern)"
    check_plain(tmp_path / "failed.onnx", reason)
    out = capsys.readouterr()
    assert f"graph: not optimized, {reason}" in out.err and json.loads(out.out)["graph"]["optimized"] is False

    def wrong(graph, *args):  # an optimized graph whose head weights are off
        optimized, fusion = optimize_graph(graph, *args)
        head = next(t for t in optimized.graph.initializer if t.name == "backbone.head.weight")
        head.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(head) * 1.5, head.name))
        return optimized, fusion

    monkeypatch.setattr(exporter, "optimize_graph", wrong)
    export_checkpoint(ckpt, tmp_path / "wrong.onnx")
    check_plain(tmp_path / "wrong.onnx", "the optimized graph disagrees with PyTorch by ")
