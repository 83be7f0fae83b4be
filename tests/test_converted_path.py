"""The whole path on an authors' released file: ``python -m patchplace.models.convert`` -> ``finetune.py`` ->
``evaluate.py`` (linear / kNN / position probes; classification and consistency of the fine-tune) -> ``python -m
patchplace.export`` (parity gate on real images) -> the ONNX Runtime evaluator (accuracy, consistency, robustness),
each run once, as the commands of docs/interop.md ("The authors' released weights") run them: the conversion as a
command, the pipelines and the export through their ``main`` in this process (the same arguments; one Python start
each is most of a toy run's cost, and the scripts' entry points are the other end-to-end tests').

The file is an MAE training checkpoint in the authors' key layout (facebookresearch/mae models_mae.py: the encoder
keyed as timm's VisionTransformer, which models_vit.py subclasses, plus decoder_* / mask_token; main_pretrain.py's
{'model', 'optimizer', 'epoch', 'args'}), shrunk to the toy data only in size: width 64, depth 2, patch 4, one
channel, 32 px (the 28 px images zero-padded, as the pipelines' data.pad_to=32)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from pipeline_args import TINY, img

from patchplace.export.__main__ import main as export_main
from patchplace.export.evaluate import main as ort_evaluate_main
from patchplace.models import load_pretrained, sincos_2d
from patchplace.pipelines import evaluate, finetune

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # end to end: real runs of the pipelines


def mae_training_checkpoint(path: Path) -> Path:
    """An MAE pretraining checkpoint (encoder + decoder) at the toy data's size, as main_pretrain.py saves it."""
    torch.manual_seed(0)
    encoder = timm.create_model("vit_base_patch16_224", pretrained=False, img_size=32, patch_size=4, in_chans=1,
                                embed_dim=64, depth=2, num_heads=2, num_classes=0)
    state = dict(encoder.state_dict())
    state["pos_embed"] = torch.cat([torch.zeros(1, 64), sincos_2d((8, 8), 64)]).unsqueeze(0)  # MAE's fixed table
    decoder = timm.create_model("vit_base_patch16_224", pretrained=False, img_size=32, patch_size=4, in_chans=1,
                                embed_dim=32, depth=1, num_heads=2, num_classes=0).state_dict()
    state.update({f"decoder_{k}" if k.startswith(("blocks", "norm")) else k: v for k, v in decoder.items()
                  if k.startswith(("blocks.", "norm."))})
    state.update({"decoder_embed.weight": torch.randn(32, 64) * 0.02, "decoder_embed.bias": torch.zeros(32),
                  "mask_token": torch.randn(1, 1, 32) * 0.02, "decoder_pos_embed": torch.zeros(1, 65, 32),
                  "decoder_pred.weight": torch.randn(16, 32) * 0.02, "decoder_pred.bias": torch.zeros(16)})
    torch.save({"model": state, "optimizer": {"state": {}, "param_groups": []}, "epoch": 799,
                "args": argparse.Namespace(model="mae_vit_base_patch16", mask_ratio=0.75)}, path)
    return path


def run(*argv: str) -> str:
    """A command as a user runs it (the repository root as working directory); its stdout."""
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{argv[:3]} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done.stdout


def in_process(main, *argv: str, capsys) -> str:
    """A pipeline's ``main`` on ``argv``, as its script runs it; its stdout."""
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, f"{argv[:3]} exited {code}:\n{err[-3000:]}"
    return out


def test_a_converted_release_fine_tunes_probes_exports_and_evaluates_in_onnx_runtime(shards, tmp_path, capsys):
    file = mae_training_checkpoint(tmp_path / "checkpoint-799.pth")
    converted = tmp_path / "mae_converted"
    out = run("-m", "patchplace.models.convert", str(file), "--from", "mae", "--out", str(converted), "--num-heads",
              "2", "--mean", "0.5", "--std", "0.5", "--dataset", "toy")
    assert "PE sincos2d" in out and "dropped (MAE's decoder" in out
    model, meta = load_pretrained(converted)
    assert meta["method"] == "mae" and meta["converted_from"]["epoch"] == 799 and model.config.num_classes == 0

    # fine-tuning: the checkpoint's finetune_pool gives MAE's protocol (average pooling + a fresh fc_norm)
    data = [*img(shards), *(a for a in TINY if not a.startswith("model.preset="))]  # the checkpoint's architecture
    out = in_process(finetune.main, *data, "optim.max_steps=3", f"run.output={tmp_path / 'ft'}",
              f"model.checkpoint={converted}", "finetune.mixup=0", "finetune.cutmix=0", capsys=capsys)
    assert "finetune.global_pool: mean_fc_norm (the checkpoint's finetune_pool: mae fine-tunes on" in out
    ft = tmp_path / "ft" / "checkpoint"
    ft_meta = json.loads((ft / "config.json").read_text())
    assert ft_meta["backbone"]["fc_norm"] and ft_meta["metadata"]["pretrain_metadata"]["method"] == "mae"

    # probes on the converted (pretrained) checkpoint: linear, kNN per layer, position probe, on its class token
    probes = ["data.batch_size=8", "data.num_workers=0", "eval.probe_train_samples=32", "eval.probe_epochs=2",
              "eval.max_eval_samples=16"]
    in_process(evaluate.main, *img(shards), *probes, f"model.checkpoint={converted}",
               f"run.output={tmp_path / 'ev_pre'}", capsys=capsys)
    pre = json.loads((tmp_path / "ev_pre" / "results.json").read_text())
    assert pre["probe_feature"] == "cls" and len(pre["knn_per_layer"]) == 2
    assert 0 <= pre["position_probe"]["top1"] <= 1 and 0 <= pre["linear_probe"]["top1"] <= 1

    # the fine-tune: classification and consistency in PyTorch ...
    in_process(evaluate.main, *img(shards), *probes, f"model.checkpoint={ft}", f"run.output={tmp_path / 'ev_ft'}",
               capsys=capsys)
    torch_results = json.loads((tmp_path / "ev_ft" / "results.json").read_text())
    # ... the export's parity gate on real images, and the same numbers from ONNX Runtime
    assert export_main([str(ft), "--out", str(tmp_path / "m.onnx"), "--data", str(shards / "img" / "test"),
                        "--samples", "8"]) == 0
    assert ort_evaluate_main([str(tmp_path / "m.onnx"), "--data", str(shards / "img" / "test"), "--out",
                              str(tmp_path / "ort"), "--consistency-limit", "16", "--robustness-limit", "4",
                              "--latency-repeats", "0", "--batch-size", "8", "--checkpoint", str(ft)]) == 0
    assert "real_0" in json.loads((tmp_path / "m.json").read_text())["parity"]["max_abs_diff"]
    ort = json.loads((tmp_path / "ort" / "results.json").read_text())
    assert ort["accuracy"]["top1"] == torch_results["classification"]["top1"]
    assert ort["parity"]["max_abs_logit_diff"] < 1e-4 and ort["parity"]["argmax_agreement"] == 1.0
    for gamma, value in torch_results["consistency"].items():  # the logits' change under the jigsaw, continuous
        assert ort["consistency"][gamma]["consistency"] == value["consistency"], gamma
        assert ort["consistency"][gamma]["diff_norm"] == pytest.approx(value["diff_norm"], rel=1e-4, abs=1e-6)
    robustness = ort["robustness"]
    assert len(robustness["ran"]) + len(robustness["failed"]) == 15 and "gaussian_noise" in robustness["ran"]
