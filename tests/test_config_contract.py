"""The config contract enforces itself: every input a looser config would let through — a key given
twice, ``${...}`` interpolation, a NaN, a YAML error or an object tag, overrides a checkpoint cannot take, a run
folder given as the checkpoint, a hand-edited run record, an unknown export sidecar format, an over-long path — is
refused through the real entry points in one line naming the key or file and the fix (exit 2, no traceback) with
nothing written; fp16 on a CPU trains and is recorded as what it is (float32); ``--consistency-limit 0`` skips the
curves; a split smaller than one batch names its samples."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from pipeline_args import TINY, files_of, img, run_log

from patchplace.export import evaluate as ort_evaluate
from patchplace.export import export_checkpoint
from patchplace.models import create_model, save_pretrained
from patchplace.pipelines import config as pipeline_config
from patchplace.pipelines import evaluate, finetune, pretrain
from patchplace.pipelines.commands import FinetuneConfig

LONG = "a" * 300  # one name over the 255 bytes of every common Linux file system


def refused(capsys, code: int, *named: str) -> str:
    """Exit 2 and one ``error:`` line on stderr (no traceback) holding every text of ``named``; returns the line."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert all(text in lines[0] for text in named), lines[0]
    return lines[0]


def train_args(shards: Path, out: Path, *extra: str) -> list[str]:
    return ["method=supervised", *img(shards), *TINY, "optim.max_steps=2", f"run.output={out}", *extra]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A run folder (``run/checkpoint``: a saved backbone) of the test shards' shape: 32 px gray, 3 classes."""
    run = tmp_path_factory.mktemp("ckpt") / "run"
    torch.manual_seed(0)
    save_pretrained(create_model("vit_micro", in_chans=1, num_classes=3), run / "checkpoint",
                    metadata={"method": "supervised", "classes": ["a", "b", "c"], "pad_to": 32})
    return run


def test_a_key_given_twice_is_refused_in_a_file_and_in_an_override(shards, tmp_path, capsys):
    """PyYAML keeps the last of two equal keys: ``method: stop`` then ``method: mae`` trained MAE silently."""
    config = tmp_path / "twice.yaml"
    config.write_text("method: stop\noptim: {lr: 0.001}\nmethod: mae\n")
    out = tmp_path / "run"
    code = pretrain.main(["--config", str(config), *train_args(shards, out)[1:]])
    refused(capsys, code, f"config file {config}, line 3", "key 'method' is given twice (first at line 1",
            "keep one")
    code = pretrain.main(train_args(shards, out, "model.overrides={depth: 1, depth: 2}"))
    refused(capsys, code, "override 'model.overrides={depth: 1, depth: 2}'", "key 'depth' is given twice")
    assert not out.exists()


def test_interpolation_syntax_is_refused_naming_the_key_and_a_pipe_command_keeps_its_shell_variable(
        shards, tmp_path, capsys, monkeypatch):
    """``${data.train}/x`` was taken literally and created a folder of that name; a shell expands ``${VAR}`` in a
    ``pipe:`` command, which keeps it as written."""
    monkeypatch.chdir(tmp_path)
    code = pretrain.main(train_args(shards, Path("runs/x"), "run.output=${data.train}/x"))
    refused(capsys, code, "run.output=${data.train}/x: ${...} interpolation is not expanded", "write the value out")
    config = tmp_path / "c.yaml"
    config.write_text("data:\n  noise_split: ${HOME}/noise\n")
    code = pretrain.main(["--config", str(config), *train_args(shards, Path("runs/y"))])
    refused(capsys, code, f"data.noise_split=${{HOME}}/noise (in {config})")
    assert list(tmp_path.iterdir()) == [config]  # no ${data.train} folder, no runs/
    cfg = pipeline_config.load(pretrain.PretrainConfig, None, [*img(shards), "data.train_urls=pipe:cat ${D}/x.tar"])
    assert cfg.data.train_urls == "pipe:cat ${D}/x.tar"


@pytest.mark.parametrize("value, named", [
    (".nan", "optim.lr: .nan is not a value any field takes"),
    (".inf", "optim.lr must be > 0 (a finite number), got inf")])
def test_a_nan_or_infinite_lr_is_refused_naming_optim_lr(shards, tmp_path, capsys, value, named):
    """``optim.lr: .nan`` reached the optimizer and was blamed on optim.layer_decay."""
    code = finetune.main([*img(shards), *TINY, f"optim.lr={value}", f"run.output={tmp_path / 'run'}"])
    assert "layer_decay" not in refused(capsys, code, named)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("text, named", [
    (b"method: [mae\n", ["line 2, column 1: not valid YAML (", "fix the file"]),
    (b"method: !!python/object/apply:os.system ['touch MARKER']\n",
     ["line 1, column 9: the tag !!python/object/apply:os.system would build an object", "remove the tag"]),
    (b"method: mae\n\xff\n", ["is not UTF-8 text (byte 12)"])], ids=["syntax", "object-tag", "not-utf8"])
def test_a_yaml_error_is_one_line_naming_the_file_and_where(shards, tmp_path, capsys, monkeypatch, text, named):
    """A syntax error or a ``!!python/object`` tag was a 45-60-line traceback; the tag never runs."""
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "bad.yaml"
    config.write_bytes(text)
    code = pretrain.main(["--config", str(config), *train_args(shards, tmp_path / "run")])
    refused(capsys, code, f"config file {config}", *named)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]  # no run folder, no MARKER


def test_model_overrides_cannot_apply_to_a_checkpoint(shards, tmp_path, capsys, checkpoint):
    """``model.overrides={patch_size: 8}`` with a checkpoint was ignored while config.yaml recorded 8."""
    out = tmp_path / "run"
    code = finetune.main([*img(shards), *TINY, f"model.checkpoint={checkpoint / 'checkpoint'}",
                          "model.overrides={patch_size: 8}", f"run.output={out}"])
    refused(capsys, code, f"model.overrides={{patch_size: 8}} cannot apply to model.checkpoint={checkpoint}",
            "drop model.overrides")
    assert not out.exists()


def test_a_preset_override_must_name_the_checkpoints_own(shards, tmp_path, capsys, checkpoint):
    """``model.preset=vit_tiny`` beside a vit_micro checkpoint cannot apply (the checkpoint brings its architecture):
    refused. Taken: a preset of the checkpoint's size, the preset its config.json records, and a config file's preset
    (the file's from-scratch baseline, which a checkpoint on the command line replaces)."""
    out, ckpt = tmp_path / "run", checkpoint / "checkpoint"
    code = finetune.main([*img(shards), *TINY, f"model.checkpoint={ckpt}", "model.preset=vit_tiny",
                          f"run.output={out}"])
    refused(capsys, code, f"model.preset=vit_tiny cannot apply to model.checkpoint={ckpt}: a checkpoint brings its "
            "architecture; drop model.preset")
    assert not out.exists()

    def load(file: Path | None, folder: Path, *overrides: str) -> FinetuneConfig:
        return pipeline_config.load(FinetuneConfig, file and str(file), [*img(shards), f"model.checkpoint={folder}",
                                                                         *overrides])

    assert load(None, ckpt, "model.preset=vit_micro").model.preset == "vit_micro"  # its size
    scratch = tmp_path / "scratch.yaml"
    scratch.write_text("model: {preset: vit_tiny}\n")
    assert load(scratch, ckpt).model.preset == "vit_tiny"
    recorded = tmp_path / "recorded"
    shutil.copytree(ckpt, recorded)
    saved = json.loads((recorded / "config.json").read_text())
    (recorded / "config.json").write_text(json.dumps({**saved, "metadata": {**saved["metadata"], "preset": "vit_cpu"}}))
    assert load(None, recorded, "model.preset=vit_cpu").model.preset == "vit_cpu"
    with pytest.raises(pipeline_config.ConfigError, match=r"^model.preset=vit_micro cannot apply"):
        load(None, recorded, "model.preset=vit_micro")  # the recorded name wins over the size


def test_a_run_folder_given_as_the_checkpoint_names_its_checkpoint(shards, tmp_path, capsys, checkpoint):
    fix = f"use model.checkpoint={checkpoint / 'checkpoint'}"
    code = finetune.main([*img(shards), *TINY, f"model.checkpoint={checkpoint}", f"run.output={tmp_path / 'ft'}"])
    refused(capsys, code, f"model.checkpoint={checkpoint} is a training run's folder", fix)
    code = evaluate.main([*img(shards), "data.num_workers=0", f"model.checkpoint={checkpoint}",
                          f"run.output={tmp_path / 'ev'}"])
    refused(capsys, code, fix)
    assert list(tmp_path.iterdir()) == []


def test_a_refused_evaluation_leaves_no_run_output(shards, tmp_path, capsys):
    """A refusal after the run.output folders were created (here: a checkpoint folder without config.json) removes
    them again (before: an empty run.output stayed)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    code = evaluate.main([*img(shards), "data.num_workers=0", f"model.checkpoint={empty}",
                          f"run.output={tmp_path / 'new' / 'eval'}"])
    refused(capsys, code, f"no config.json in {empty}")
    assert not (tmp_path / "new").exists()


def test_a_path_too_long_for_the_file_system_is_one_line(shards, tmp_path, capsys, checkpoint):
    """A 300-character name was a 26-line OSError traceback (run.output, data.train, --config, evaluate.py's
    run.output)."""
    fix = "this file system takes names of at most"
    refused(capsys, pretrain.main(train_args(shards, tmp_path / LONG)), "run.output: the name aaaa", fix,
            "choose a shorter run.output")
    refused(capsys, pretrain.main(train_args(shards, tmp_path / "run", f"data.train={tmp_path / LONG}")),
            "data.train: the name aaaa", fix)
    refused(capsys, pretrain.main(["--config", str(tmp_path / f"{LONG}.yaml"), *train_args(shards, tmp_path)]),
            "--config: the name aaaa", fix)
    code = evaluate.main([*img(shards), f"model.checkpoint={checkpoint / 'checkpoint'}",
                          f"run.output={tmp_path / LONG}"])
    refused(capsys, code, "run.output: the name aaaa", fix)
    assert list(tmp_path.iterdir()) == []


def test_fp16_on_a_cpu_trains_float32_and_is_recorded_so(shards, tmp_path, capsys, monkeypatch):
    """Accelerate autocasts fp16 on GPUs only: on a CPU an fp16 run's losses and weights are bit-identical to
    float32's (measured here), so the run says so in one line and records compute.value=no (it recorded fp16)."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    for precision in ("no", "fp16"):
        assert pretrain.main(train_args(shards, tmp_path / precision, f"run.mixed_precision={precision}")) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("run.mixed_precision=fp16: ")]
    assert len(line) == 1 and "on this CPU the run trains in float32" in line[0], line
    assert [r["loss"] for r in run_log(tmp_path / "no")] == [r["loss"] for r in run_log(tmp_path / "fp16")]
    card = json.loads((tmp_path / "fp16" / "checkpoint" / "config.json").read_text())["metadata"]
    assert (card["compute"]["asked"], card["compute"]["value"]) == ("fp16", "no")
    assert "mixed_precision: fp16" in (tmp_path / "fp16" / "config.yaml").read_text()  # the config as asked


def test_a_resume_refuses_a_hand_edited_run_record(shards, tmp_path, capsys):
    """config.yaml edited to the lr of the resumed launch passed the comparison (two learning rates mixed
    silently): the checkpoint records the config it trained with, and a resume compares config.yaml with it."""
    out = tmp_path / "run"
    assert pretrain.main(train_args(shards, out, "run.checkpoint_every=1")) == 0
    saved = out / "config.yaml"
    text = saved.read_text()
    assert "  lr: 0.0015\n" in text
    saved.write_text(text.replace("  lr: 0.0015\n", "  lr: 0.01\n"))
    before = files_of(out)
    code = pretrain.main(train_args(shards, out, "optim.lr=0.01", "run.resume=true"))
    refused(capsys, code, f"{saved} was edited after the run wrote it: optim.lr (0.0015 -> 0.01)",
            "restore those values")
    assert files_of(out) == before
    saved.unlink()  # no config.yaml: the checkpoint's record is what the launch is compared with
    code = pretrain.main(train_args(shards, out, "optim.lr=0.01", "run.resume=true"))
    refused(capsys, code, "optim.lr (0.0015 -> 0.01) differ from what the step-2 checkpoint recorded")
    saved.write_text(text)
    assert pretrain.main(train_args(shards, out, "run.resume=true")) == 0  # restored: resumes (finished)


def test_a_split_smaller_than_one_batch_names_its_samples(shards, tmp_path, capsys):
    """Streamed under data.drop_last, the hint said "0 samples ... set data.batch_size <= 0"."""
    code = pretrain.main(train_args(shards, tmp_path / "run", "data.batch_size=100", "data.in_memory=false"))
    refused(capsys, code, "gives each process 64 samples per epoch", "set data.batch_size <= 64")
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def exported(checkpoint, tmp_path_factory) -> Path:
    model = tmp_path_factory.mktemp("onnx") / "model.onnx"
    export_checkpoint(checkpoint / "checkpoint", model)
    return model


def ort_args(model: Path, shards: Path, out: Path, *extra: str) -> list[str]:
    return [str(model), "--data", str(shards / "img" / "test"), "--out", str(out), "--robustness-limit", "0",
            "--latency-repeats", "0", "--batch-size", "16", *extra]


def test_an_unknown_sidecar_format_is_refused(exported, shards, tmp_path, capsys):
    """model.json's ``format`` was never read: a ``patchplace.export/2`` sidecar was evaluated as /1."""
    pair = tmp_path / "pair"
    pair.mkdir()
    (pair / "model.onnx").write_bytes(exported.read_bytes())
    sidecar = json.loads(exported.with_suffix(".json").read_text())
    assert sidecar["format"] == "patchplace.export/1"
    (pair / "model.json").write_text(json.dumps({**sidecar, "format": "patchplace.export/2"}))
    code = ort_evaluate.main(ort_args(pair / "model.onnx", shards, tmp_path / "out"))
    refused(capsys, code, f"{pair / 'model.json'} has format 'patchplace.export/2'", "reads patchplace.export/1",
            "re-export the checkpoint")
    assert not (tmp_path / "out").exists()


def test_the_onnx_evaluator_skips_the_curves_at_consistency_limit_0_and_refuses_a_long_out(
        exported, shards, tmp_path, capsys):
    """``--consistency-limit 0`` was a traceback (an empty batch); it skips the curves, as the other limits' 0."""
    out = tmp_path / "out"
    assert ort_evaluate.main(ort_args(exported, shards, out, "--consistency-limit", "0")) == 0
    results = json.loads((out / "results.json").read_text())
    assert "consistency" not in results and np.isfinite(results["accuracy"]["top1"])
    assert "consistency" not in (out / "results.md").read_text() and not (out / "consistency.png").exists()
    refused(capsys, ort_evaluate.main(ort_args(exported, shards, out, "--consistency-limit", "-1")),
            "--consistency-limit and --robustness-limit count images: give 0 (skip) or more")
    refused(capsys, ort_evaluate.main(ort_args(exported, shards, tmp_path / LONG)),
            f"{tmp_path / LONG}: a name in this path is longer than the file system takes", "choose a shorter path")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
