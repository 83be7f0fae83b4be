"""Inputs as users give them: one preprocessing for every split, evaluation that refuses what it cannot
score honestly (images a checkpoint trained on, another dataset's classes, inputs the model cannot take, results
it would overwrite), and bad settings or data stopped in one line (exit 2, no traceback)."""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from pipeline_args import TINY, img, small_heads
from safetensors.torch import save_file

from patchplace.data import DataError, ShardDataset, SplitWriter
from patchplace.data.codecs import encode_png
from patchplace.data.memory import InMemorySplit, MemoryReader
from patchplace.export.evaluate import OnnxModel
from patchplace.export.exporter import image_preprocessing
from patchplace.models import create_model, load_pretrained, save_pretrained, timm_transform
from patchplace.pipelines import config as pipeline_config
from patchplace.pipelines import (
    engine,
    evaluate,
    finetune,
    pretrain,
)
from patchplace.research import controls

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # end to end: real runs of the pipelines

# evaluate.py with every part but the classification off (each call stays well under a second)
QUICK = ["data.batch_size=16", "data.num_workers=0", "eval.linear_probe=false", "eval.knn=false",
         "eval.position_probe=false", "eval.consistency_ratios=[]", "eval.max_eval_samples=8",
         "eval.probe_train_samples=8"]


def error_line(capsys) -> str:
    """The one ``error:`` line a refused command printed (and no traceback)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


@pytest.fixture(scope="module")
def checkpoints(shards, tmp_path_factory) -> dict[str, Path]:
    """Classifiers fine-tuned from scratch for one step on the toy train split: ``all`` trained on every image,
    ``held`` with data.holdout=12 (data.holdout_seed=0) kept out of it."""
    root = tmp_path_factory.mktemp("ckpt")
    common = [*TINY, "optim.max_steps=1", "finetune.mixup=0", "finetune.cutmix=0"]
    assert finetune.main([*img(shards), *common, f"run.output={root / 'all'}"]) == 0
    assert finetune.main([f"data.train={shards / 'img' / 'train'}", "data.val=holdout", "data.holdout=12", *common,
                          f"run.output={root / 'held'}"]) == 0
    return {"all": root / "all" / "checkpoint", "held": root / "held" / "checkpoint"}


# ---------------------------------------------------------------------------------------------- 1. preprocessing
def val_batch(shards: Path, checkpoint: Path, out: Path, val: Path, *extra: str) -> torch.Tensor:
    """The first data.val batch of evaluate.py's data path (what its classification scores)."""
    _, _, data = engine.start(evaluate.EvaluateConfig, "", [
        f"data.train={shards / 'img' / 'train'}", f"data.val={val}", "data.batch_size=64", "data.num_workers=0",
        f"model.checkpoint={checkpoint}", f"run.output={out}", *extra], augment=False, split_train=False)
    return next(iter(data.val.batches(64, epoch=0)))[0].cpu()


def test_every_split_is_normalized_with_the_checkpoints_training_statistics(shards, checkpoints, tmp_path):
    """evaluate.py's input equals, bit for bit, what the exported model is given (the ONNX evaluator's padding and
    normalization from model.json) and what timm's transform of the checkpoint gives, in memory and streaming; a
    test split whose manifest carries other statistics (its own, or any) changes nothing. Before, data.val was
    normalized with its own manifest's statistics (computed_on: test)."""
    checkpoint, test = checkpoints["all"], shards / "img" / "test"
    backbone, metadata = load_pretrained(checkpoint)
    train_stats = json.loads((shards / "img" / "train" / "manifest.json").read_text())["normalization"]
    assert metadata["normalization"] == train_stats
    assert json.loads((test / "manifest.json").read_text())["normalization"] != train_stats
    raw = InMemorySplit.load(test).inputs
    sidecar = image_preprocessing(backbone, metadata)  # what model.json records
    onnx_side = SimpleNamespace(height=sidecar["height"], width=sidecar["width"],
                                mean=torch.tensor(sidecar["mean"]).view(1, -1, 1, 1),
                                std=torch.tensor(sidecar["std"]).view(1, -1, 1, 1))
    deployed = OnnxModel.normalize(onnx_side, OnnxModel.pad(onnx_side, raw))
    timm_side = torch.stack([timm_transform(checkpoint)(image) for image in raw])
    assert torch.equal(timm_side, deployed)
    memory = val_batch(shards, checkpoint, tmp_path / "a", test)
    streamed = val_batch(shards, checkpoint, tmp_path / "b", test, "data.in_memory=false")
    assert torch.equal(memory, deployed) and torch.equal(streamed, deployed)
    other = tmp_path / "other"
    shutil.copytree(test, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["normalization"] = {"mean": [0.9], "std": [0.05], "computed_on": "test"}
    (other / "manifest.json").write_text(json.dumps(manifest))
    assert torch.equal(val_batch(shards, checkpoint, tmp_path / "c", other), deployed)
    # from scratch: every split gets the train split's statistics, which the checkpoint then records
    _, _, data = engine.start(finetune.FinetuneConfig, "", [*img(shards), "data.num_workers=0",
                                                            f"run.output={tmp_path / 'd'}"])
    assert data.normalization == train_stats and torch.equal(data.val.transform.mean.flatten().cpu(),
                                                             torch.tensor(train_stats["mean"]))


# ---------------------------------------------------------------------------------------------- 2. hold-out
def test_evaluation_refuses_the_images_a_checkpoint_trained_on(shards, checkpoints, tmp_path, capsys):
    """A checkpoint records its hold-out (split, size, seed); data.val=holdout is scored only on samples it held
    out, data.val never on the split it trained on: neither is scored."""
    train = f"data.train={shards / 'img' / 'train'}"
    holdout = [train, "data.val=holdout", "data.holdout=12", *QUICK]
    assert evaluate.main([*holdout, f"model.checkpoint={checkpoints['all']}", f"run.output={tmp_path / 'a'}"]) == 2
    line = error_line(capsys)
    assert "data.val=holdout (data.holdout=12, data.holdout_seed=0): 12 of its 12 images are ones " in line, line
    assert "it held out nothing (data.holdout=0) of toy/train" in line and "a test split" in line, line
    assert evaluate.main([*holdout, "data.holdout_seed=1", f"model.checkpoint={checkpoints['held']}",
                          f"run.output={tmp_path / 'b'}"]) == 2
    assert "evaluate it on data.holdout=12 data.holdout_seed=0, or on a test split" in error_line(capsys)
    assert evaluate.main([train, f"data.val={shards / 'img' / 'train'}", *QUICK,
                          f"model.checkpoint={checkpoints['held']}", f"run.output={tmp_path / 'c'}"]) == 2
    assert "is toy/train, the split " in error_line(capsys)
    assert not any((tmp_path / name / "results.json").exists() for name in "abc")
    assert evaluate.main([*holdout, f"model.checkpoint={checkpoints['held']}", f"run.output={tmp_path / 'd'}"]) == 0
    assert json.loads((tmp_path / "d" / "results.json").read_text())["classification"]["count"] == 12
    record = json.loads((checkpoints["held"] / "config.json").read_text())["metadata"]["data"]
    assert record["split"] == "train" and record["holdout"] == {"size": 12, "seed": 0}


# ---------------------------------------------------------------------------------------------- 3. classes
def test_a_classifier_is_not_scored_on_another_datasets_classes(shards, checkpoints, tmp_path, capsys):
    """A 3-class model on another 3-class dataset: one line naming both class lists (before: a top-1, exit 0)."""
    with SplitWriter(tmp_path, "test", dataset="other", modality="image", classes=["x", "y", "z"],
                     info={"image_size": [28, 28], "channels": 1}, source="t", recipe="t", recipe_version=1) as w:
        for i in range(6):
            w.add_image(f"{i}", i % 3, np.full((28, 28), 40 * i, np.uint8))
    split = tmp_path / "test"
    assert evaluate.main([f"data.train={split}", f"data.val={split}", *QUICK, f"model.checkpoint={checkpoints['all']}",
                          f"run.output={tmp_path / 'ev'}"]) == 2
    assert error_line(capsys) == (
        f"error: {checkpoints['all']} classifies [a, b, c] (toy) but other/test holds [x, y, z] (label 0 is 'a' for "
        "the model, 'x' in the data): its top-1 would compare unrelated labels; evaluate it on toy, or fine-tune it "
        "on this data first")
    assert not (tmp_path / "ev" / "results.json").exists()


# ---------------------------------------------------------------------------------------------- 4. batch size
def test_a_batch_larger_than_the_train_split_is_refused_and_throughput_counts_real_samples(shards, tmp_path, capsys,
                                                                                          monkeypatch):
    """data.batch_size=100000 on 64 samples is refused (no such batch can be formed, no global batch recorded);
    the logged samples/s counts the samples read, not the asked batch (a short last batch too)."""
    common = ["method=supervised", *img(shards), *TINY]
    assert pretrain.main([*common, "data.batch_size=100000", "optim.max_steps=2", f"run.output={tmp_path / 'a'}"]) == 2
    assert error_line(capsys) == (
        "error: data.batch_size=100000 asks for 100000 samples per optimizer step on each of 1 process(es) (global "
        "batch 100000), but data.train (toy/train) gives each process 64 samples per epoch: no such batch can be "
        "formed; set data.batch_size <= 64 (or train on more data)")
    assert not (tmp_path / "a").exists(), "a refused run leaves no folder behind"
    # a clock that ticks once per training sample read: a rate that counts real samples is exactly 1 per second
    clock, batches = [0.0], MemoryReader.batches

    def counted(self, batch_size, epoch, skip=0):
        for batch in batches(self, batch_size, epoch, skip):
            clock[0] += len(batch[0]) if self.shuffle else 0
            yield batch

    monkeypatch.setattr(MemoryReader, "batches", counted)
    monkeypatch.setattr(engine.logs, "time", SimpleNamespace(perf_counter=lambda: clock[0]))  # the rates' clock
    # batches of 48 then 16 (the epoch's rest), then 48: steps 2 and 3 read 64 samples, not 2 x 48
    assert pretrain.main([*common, "data.batch_size=48", "optim.max_steps=3", f"run.output={tmp_path / 'b'}"]) == 0
    log = [json.loads(line) for line in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [r["samples_per_s"] for r in log if "samples_per_s" in r] == [1.0, 1.0]


# ---------------------------------------------------------------------------------------------- 5. channels
def replace_member(shard: Path, name: str, data: bytes) -> None:
    members = []
    with tarfile.open(shard) as tar:
        for info in tar.getmembers():
            members.append((info, data if info.name == name else tar.extractfile(info).read()))
    with tarfile.open(shard, "w") as tar:
        for info, payload in members:
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))


def test_colour_images_in_a_gray_split_are_refused_naming_the_shard_and_sample(tmp_path):
    """Reading converted an RGB PNG of a 1-channel split to gray without a word; SplitWriter.write skipped the
    checks of add_image (size, channels) and the normalization statistics."""
    rng = np.random.default_rng(0)
    gray, rgb = rng.integers(0, 256, (28, 28), np.uint8), rng.integers(0, 256, (28, 28, 3), np.uint8)
    kwargs = dict(dataset="toy", modality="image", classes=["a", "b"], info={"image_size": [28, 28], "channels": 1},
                  source="t", recipe="t", recipe_version=1)
    for payload, message in ((encode_png(rgb), r"sample 1 \(toy/train\): a colour image \(PIL mode RGB\) in a "
                                               "split whose manifest declares 1 channel"),
                             (encode_png(gray[:20]), "sample 1: a 20x28 image with 1 channel"),
                             (b"junk", "cannot decode image")):
        with pytest.raises(DataError, match=message), SplitWriter(tmp_path / "bad", "train", **kwargs) as w:
            w.write("0", 0, encode_png(gray))
            w.write("1", 1, payload)
        assert not (tmp_path / "bad" / "train").exists()
    with SplitWriter(tmp_path / "ok", "train", **kwargs) as w:
        w.write("0", 0, encode_png(gray))
        w.add_image("1", 1, gray)
    assert w.manifest.normalization["mean"] == [round(float(gray.mean()) / 255, 6)], "write() counts its pixels"
    shard = tmp_path / "ok" / "train" / "train-000000.tar"
    replace_member(shard, "1.png", encode_png(rgb))
    with pytest.raises(DataError, match=rf"sample {shard}:1: a colour image \(PIL mode RGB\) in a split whose "
                                        "manifest declares 1 channel"):
        list(ShardDataset(tmp_path / "ok" / "train", verify=False))


# ---------------------------------------------------------------------------------------------- 6. exponents
def test_floats_written_with_an_exponent_are_floats_in_every_section(shards, tmp_path, capsys):
    """objective.mask_ratio=1e-9 reached the objective as the string '1e-9' (YAML 1.1): a TypeError traceback."""
    assert pretrain.main(["method=mae", *img(shards), *TINY, *small_heads("mae"), "objective.mask_ratio=1e-9",
                          "optim.max_steps=1", f"run.output={tmp_path / 'mae'}"]) == 2
    assert error_line(capsys).startswith("error: mask_ratio=1e-09 masks none of the 64 patches")
    config = tmp_path / "c.yaml"
    config.write_text("method: mae\nobjective: {mask_ratio: 5e-1, norm_pix_loss: true}\noptim: {lr: 1e-3, "
                      "betas: [9e-1, 0.95]}\nmodel: {overrides: {drop_path_rate: 1E-1}}\n")
    cfg = pipeline_config.load(pretrain.PretrainConfig, str(config), ["data.memory_budget_mb=2e3",
                                                                      f"data.train={shards / 'img' / 'train'}",
                                                                      f"data.val={shards / 'img' / 'test'}"])
    assert cfg.objective.mask_ratio == 0.5 and cfg.optim.lr == 1e-3 and cfg.optim.betas == (0.9, 0.95)
    assert cfg.model.overrides["drop_path_rate"] == 0.1 and cfg.data.memory_budget_mb == 2000.0
    assert pipeline_config.parse_yaml("[10, 1_000, 0x10, no, 1e, .5]") == [10, 1000, 16, "no", "1e", 0.5]


# ---------------------------------------------------------------------------------------------- 7. evaluate.py
def test_checkpoints_evaluate_cannot_run_are_one_line(shards, checkpoints, tmp_path, capsys):
    """A speech or RGB checkpoint on gray images, logits that overflow, NaN objective weights: each a traceback
    before."""
    args = [*img(shards), *QUICK]
    meta = {"classes": ["a", "b", "c"], "modality": "image", "pad_to": 32,
            "normalization": {"mean": [0.5] * 3, "std": [0.25] * 3}}
    speech = save_pretrained(create_model("audio_mp3", num_classes=3), tmp_path / "speech",
                             metadata={**meta, "modality": "audio", "normalization": None})
    rgb = save_pretrained(create_model("vit_micro", in_chans=3, num_classes=3), tmp_path / "rgb", metadata=meta)
    backbone, metadata = load_pretrained(checkpoints["all"])
    with torch.no_grad():  # finite weights whose products overflow float32
        backbone.head.weight.fill_(3e38)
    overflow = save_pretrained(backbone, tmp_path / "overflow", metadata=metadata)
    mp3 = save_pretrained(create_model("vit_micro", in_chans=1, pos_embed="none"), tmp_path / "mp3",
                          metadata={**metadata, "method": "mp3", "objective": {}})
    save_file({"head.bias": torch.full((64,), float("nan"))}, str(mp3 / "objective.safetensors"))
    expected = {
        speech: f"error: model.checkpoint={speech} is a model for audio but data.train (toy/train) holds image",
        rgb: f"error: data.train images have 1 channel(s) but model.checkpoint={rgb} takes 3",
        overflow: "error: the model's logits overflow (inf / NaN) on data.val although its weights and inputs are "
                  "finite",
        mp3: f"error: {mp3 / 'objective.safetensors'} holds non-finite weights (NaN / inf in 1 tensor(s), e.g. "
             "head.bias)"}
    for checkpoint, start in expected.items():
        out = tmp_path / f"ev-{checkpoint.name}"
        assert evaluate.main([*args, f"model.checkpoint={checkpoint}", f"run.output={out}"]) == 2, checkpoint
        line = error_line(capsys)
        assert line.startswith(start) and ("use " in line or "train again" in line), line
        assert not (out / "results.json").exists()


# ---------------------------------------------------------------------------------------------- 8. overwrite
def test_evaluate_does_not_overwrite_earlier_results_unless_told(shards, checkpoints, tmp_path, capsys):
    out = tmp_path / "ev"
    args = [*img(shards), *QUICK, f"run.output={out}"]
    assert evaluate.main([*args, f"model.checkpoint={checkpoints['all']}"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert evaluate.main([*args, f"model.checkpoint={checkpoints['held']}"]) == 2
    assert error_line(capsys) == (
        f"error: run.output {out} already holds the results of an evaluation of {checkpoints['all']} (results.json, "
        "report.md): choose another run.output, or replace them with run.overwrite=true")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before, "a refused evaluation changes no file"
    assert evaluate.main([*args, f"model.checkpoint={checkpoints['held']}", "run.overwrite=true"]) == 0
    assert json.loads((out / "results.json").read_text())["checkpoint"] == str(checkpoints["held"])


def test_an_evaluation_stage_retried_after_a_failed_attempt_replaces_its_files(shards, checkpoints, tmp_path):
    """A study / demo evaluation stage killed after writing results.json (no DONE) runs again on the next invocation,
    while a DONE written without ``run.overwrite=`` still marks the same stage done."""
    from patchplace.pipelines.stages import stage
    from patchplace.research.reproduction.runner import EVALUATE

    out = tmp_path / "eval"
    argv = [*EVALUATE, *img(shards), *QUICK, f"run.output={out}", f"model.checkpoint={checkpoints['held']}"]
    assert evaluate.main([*argv[:-1], f"model.checkpoint={checkpoints['all']}"]) == 0  # the killed attempt's files
    stage(out, evaluate.main, argv)
    assert json.loads((out / "results.json").read_text())["checkpoint"] == str(checkpoints["held"])
    done = json.loads((out / "DONE").read_text())
    (out / "DONE").write_text(json.dumps(done | {"argv": [a for a in argv if a != "run.overwrite=true"]}))
    assert stage(out, lambda _: 1, argv) == done["seconds"], "done before: not run again"


# ---------------------------------------------------------------------------------------------- 9. symlink
def test_a_dangling_run_output_link_names_the_link_and_its_target(shards, tmp_path, capsys):
    """The line names the link and its missing target, not 'File exists'."""
    link = tmp_path / "run"
    os.symlink("missing/run", link)
    assert pretrain.main(["method=supervised", *img(shards), *TINY, "optim.max_steps=1", f"run.output={link}"]) == 2
    assert error_line(capsys) == (
        f"error: run.output {link}: {link} is a symbolic link to {tmp_path / 'missing' / 'run'}, which does not "
        f"exist: create {tmp_path / 'missing' / 'run'} (or mount what it points into), or remove the link, or "
        "choose another run.output")
    assert not (tmp_path / "missing").exists()


# ---------------------------------------------------------------------------------------------- 10. controls
def test_controls_refuse_label_fractions_that_pick_the_same_samples(shards, tmp_path, capsys):
    """On 64 images (21-22 per class) 1% and 2% are both one image per class: two identical columns before."""
    assert controls.main([*img(shards), "data.batch_size=16", "data.num_workers=0", "model.preset=vit_micro",
                          "controls.label_fractions=[0.01,0.02]", "controls.probe_train_samples=0",
                          "controls.seeds=[0]", f"run.output={tmp_path / 'c'}"]) == 2
    assert error_line(capsys) == (
        "error: controls.label_fractions 0.01 and 0.02 pick the same 3 samples of data.train (toy/train: 64 samples, "
        "21-22 per class, at least 1 each): their columns would be one probe twice; drop one of them, or use a "
        "larger train split")
    assert not (tmp_path / "c" / "controls.json").exists()
