"""Every pipeline stage on CUDA (``pytest -m gpu``; skipped where torch sees no CUDA device): pretraining of every
method in fp32, bf16 and fp16 (loss scaling), fine-tuning, evaluation with every probe and curve, export of the
CUDA-trained checkpoint and ONNX Runtime evaluation (its CUDA provider where onnxruntime-gpu can run it)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from pipeline_args import TINY, img, method_args

from patchplace.export.__main__ import main as export_main
from patchplace.export.evaluate import main as ort_evaluate_main
from patchplace.models import load_pretrained
from patchplace.objectives import method_names
from patchplace.pipelines import (
    evaluate,
    finetune,
    pretrain,
)

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pytest -m gpu)")]


def on_cuda(run) -> float:
    """Run ``run()`` and return the CUDA memory it allocated at its peak (MiB): > 0 proves it ran on the GPU."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    assert run() == 0
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "log.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
@pytest.mark.parametrize("method", method_names())
def test_every_method_pretrains_on_cuda(shards, tmp_path, method, precision):
    out = tmp_path / method
    peak = on_cuda(lambda: pretrain.main([*method_args(shards, method), "optim.max_steps=3",
                                          f"run.mixed_precision={precision}", f"run.output={out}"]))
    assert peak > 0, "the run allocated no CUDA memory: it did not train on the GPU"
    assert len(losses(out)) == 3 and all(math.isfinite(v) for v in losses(out))
    _, metadata = load_pretrained(out / "checkpoint")
    assert metadata["method"] == method


def test_cuda_pretrain_finetune_evaluate_export_ort(shards, tmp_path):
    """The README chain on the GPU: MP3 (bf16) -> fine-tune -> evaluate every probe and curve -> export -> ORT."""
    pre, ft, ev = tmp_path / "pre", tmp_path / "ft", tmp_path / "ev"
    assert on_cuda(lambda: pretrain.main(["method=mp3", *img(shards), *TINY, "optim.max_steps=3",
                                          "run.mixed_precision=bf16", f"run.output={pre}"])) > 0
    assert on_cuda(lambda: finetune.main([*img(shards), *TINY, "optim.max_steps=3", "run.mixed_precision=bf16",
                                          f"run.output={ft}", f"model.checkpoint={pre / 'checkpoint'}"])) > 0
    probes = [*img(shards), "data.batch_size=8", "data.num_workers=0", "eval.probe_train_samples=32",
              "eval.probe_epochs=2", "eval.max_eval_samples=16"]
    for checkpoint, out in ((ft, ev), (pre, tmp_path / "ev_pre")):  # classifier; MP3 position curve + probes
        assert on_cuda(lambda c=checkpoint, o=out: evaluate.main([*probes, f"run.output={o}",
                                                                  f"model.checkpoint={c / 'checkpoint'}"])) > 0
    results = json.loads((ev / "results.json").read_text())
    assert {"classification", "linear_probe", "knn_per_layer", "position_probe", "consistency"} <= set(results)
    assert "mp3_position_accuracy" in json.loads((tmp_path / "ev_pre" / "results.json").read_text())
    assert export_main([str(ft / "checkpoint"), "--out", str(tmp_path / "m.onnx")]) == 0
    assert ort_evaluate_main([str(tmp_path / "m.onnx"), "--data", str(shards / "img" / "test"), "--out",
                              str(tmp_path / "ort"), "--consistency-limit", "16", "--robustness-limit", "2",
                              "--latency-repeats", "2"]) == 0
    ort = json.loads((tmp_path / "ort" / "results.json").read_text())
    assert ort["accuracy"]["top1"] == results["classification"]["top1"], "ORT and the CUDA-evaluated model agree"


@pytest.mark.parametrize("method", ["droppos", "mjp"])
def test_cuda_method_curves_and_privacy(shards, tmp_path, method):
    """Evaluation's method-specific parts on the GPU: the DropPos position grid, MJP's gradient inversion."""
    pre = tmp_path / "pre"
    assert pretrain.main([*method_args(shards, method), "optim.max_steps=2", f"run.output={pre}"]) == 0
    checkpoint = pre / "checkpoint"
    if method == "mjp":
        assert finetune.main([*img(shards), *TINY, "optim.max_steps=2", f"run.output={tmp_path / 'ft'}",
                              f"model.checkpoint={checkpoint}", "finetune.pos_embed=learned"]) == 0
        checkpoint = tmp_path / "ft" / "checkpoint"
    extra = ["--privacy", "privacy.images=2", "privacy.steps=3"] if method == "mjp" else []
    assert on_cuda(lambda: evaluate.main([*img(shards), "data.batch_size=8", "data.num_workers=0",
                                          "eval.probe_train_samples=16", "eval.probe_epochs=1",
                                          "eval.max_eval_samples=8", f"run.output={tmp_path / 'ev'}",
                                          f"model.checkpoint={checkpoint}", *extra])) > 0
    results = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert ("droppos_grid" if method == "droppos" else "privacy") in results


def test_cuda_and_cpu_forwards_agree(shards, tmp_path):
    """A CUDA-trained checkpoint gives the same logits on the GPU and on the CPU (fp32; TF32 off)."""
    assert pretrain.main(["method=supervised", *img(shards), *TINY, "optim.max_steps=2",
                          f"run.output={tmp_path / 'sup'}"]) == 0
    backbone, _ = load_pretrained(tmp_path / "sup" / "checkpoint")
    x = torch.randn(4, 1, 32, 32)
    cpu = backbone.eval()(x)
    gpu = backbone.cuda()(x.cuda()).cpu()
    assert torch.allclose(cpu, gpu, atol=1e-3, rtol=1e-3), (cpu - gpu).abs().max()


def test_stop_draws_its_noise_on_the_gpu_from_a_host_generator():
    """StoP's noise (B x blocks x T x D values a step) is drawn on the GPU when the caller seeds a CPU generator (the
    benchmark does), by a CUDA generator seeded from it: the same seed gives the same loss."""
    from patchplace.models import create_model
    from patchplace.objectives import IJEPA, IJEPAConfig
    from patchplace.objectives.ijepa import generator_on

    assert generator_on(torch.device("cuda"), torch.Generator()).device.type == "cuda"
    torch.manual_seed(0)
    backbone = create_model("vit_micro", img_size=32, patch_size=4, in_chans=3, pos_embed="sincos2d")
    model = IJEPA(backbone, IJEPAConfig(stop=True, predictor_dim=32, predictor_depth=1, predictor_heads=2,
                                        min_keep=2)).cuda()
    images = torch.randn(4, 3, 32, 32, device="cuda")
    losses = [model((images, None), generator=torch.Generator().manual_seed(1))["loss"].item() for _ in range(2)]
    assert losses[0] == losses[1] and math.isfinite(losses[0])
