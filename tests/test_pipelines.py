"""Pipelines end to end on tiny shards the test writes: configs, every method, fine-tune, evaluate, resume,
and the demo orchestration (multi-process runs: test_ddp.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from patchplace.export.__main__ import main as export_main
from patchplace.export.evaluate import main as ort_evaluate_main

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "pipelines"))

import config as pipeline_config  # noqa: E402
import demo  # noqa: E402
import evaluate  # noqa: E402
import finetune  # noqa: E402
import pretrain  # noqa: E402
import stages  # noqa: E402
import study  # noqa: E402

from tests.pipeline_args import SMALL_HEADS, TINY, audio, img, state_dir  # noqa: E402


def test_every_shipped_config_loads_and_validates(shards):
    classes = {"finetune": finetune.FinetuneConfig, "evaluate": evaluate.EvaluateConfig}
    for path in sorted((ROOT / "pipelines" / "configs").glob("*.yaml")):
        if path.name.startswith("study"):
            cfg = pipeline_config.load(study.StudyConfig, str(path), [])
            assert set(cfg.groups) == set(study.GROUPS), "the shipped study runs every group"
            continue
        kind = next((k for k in classes if path.name.startswith(k)), "pretrain")
        data = audio(shards) if "spoken" in path.name else img(shards)
        extra = ["model.checkpoint=unused"] if kind == "evaluate" else []
        cfg = pipeline_config.load(classes.get(kind, pretrain.PretrainConfig), str(path), data + extra)
        assert Path(cfg.data.train).is_dir(), path


@pytest.mark.parametrize(("overrides", "message"), [
    (["optim.lrr=1"], r"unknown config key\(s\) \['optim.lrr'\]"),
    (["optim.lr=-1"], "optim.lr must be > 0"),
    (["method=mp4"], "method 'mp4' is not one of"),
    (["objective.eta=1.5"], r"eta must be in \[0, 1\)"),
    (["data.train=/nowhere/train"], "data.train: no manifest.json in /nowhere/train"),
    (["data.batch_size=many"], "data.batch_size: expected int"),
    (["optim.max_steps=-5"], r"optim.max_steps must be >= 1 \(or null"),  # trained 0 steps with exit 0 before
])
def test_bad_configs_fail_with_one_line(shards, capsys, overrides, message):
    assert pretrain.main([*img(shards), *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and __import__("re").search(message, err), err


def test_overrides_read_yes_no_on_off_as_words_and_only_true_false_as_bools(shards):
    """YAML 1.1 would read ``run.mixed_precision=no`` as False and fail the str field (seen on the first GPU run)."""
    cfg = pipeline_config.load(pretrain.PretrainConfig, None, [*img(shards), "run.mixed_precision=no",
                                                               "run.resume=true", "run.tensorboard=False"])
    assert cfg.run.mixed_precision == "no" and cfg.run.resume is True and cfg.run.tensorboard is False
    with pytest.raises(pipeline_config.ConfigError, match=r"run\.resume: expected bool, got 'yes'"):
        pipeline_config.load(pretrain.PretrainConfig, None, [*img(shards), "run.resume=yes"])


def test_a_section_given_in_part_keeps_the_pipelines_defaults_for_the_rest(shards):
    """``optim.max_steps=5`` used to rebuild OptimSection from the class defaults: pretraining silently ran at lr 1e-3
    and betas (0.9, 0.999) instead of its 1.5e-3 and (0.9, 0.95), and the speech config (which sets no betas) too."""
    cfg = pipeline_config.load(pretrain.PretrainConfig, None, [*img(shards), "optim.max_steps=5", "run.seed=3"])
    assert (cfg.optim.lr, cfg.optim.betas, cfg.optim.max_steps) == (1.5e-3, (0.9, 0.95), 5)
    assert (cfg.run.output, cfg.run.seed) == ("runs/pretrain", 3)
    speech = pipeline_config.load(pretrain.PretrainConfig, str(ROOT / "pipelines" / "configs" /
                                                               "mp3_speech_spoken_keywords.yaml"), audio(shards))
    assert (speech.optim.lr, speech.optim.betas) == (1e-3, (0.9, 0.95))
    ft = pipeline_config.load(finetune.FinetuneConfig, None, [*img(shards), "optim.epochs=2"])
    assert (ft.optim.lr, ft.optim.layer_decay, ft.run.output) == (1e-3, 0.75, "runs/finetune")


def test_stages_in_one_process_may_each_ask_for_their_own_mixed_precision(shards, tmp_path):
    """Accelerate keeps one process-wide state; the demo, the study and these tests run stages in one process."""
    for i, precision in enumerate(["no", "bf16", "no"]):
        assert pretrain.main(["method=supervised", *img(shards), *TINY, "optim.max_steps=1",
                              f"run.mixed_precision={precision}", f"run.output={tmp_path / str(i)}"]) == 0
        config = (tmp_path / str(i) / "config.yaml").read_text()
        assert f"mixed_precision: {precision if precision != 'no' else repr('no')}" in config


def test_help_lists_every_field_with_its_default(capsys):
    with pytest.raises(SystemExit):
        pretrain.main(["--help"])
    out = capsys.readouterr().out
    assert "optim.lr = 0.0015" in out and "data.pad_to = 32" in out and "run.resume = False" in out


@pytest.mark.parametrize("precision", ["no", "bf16"])
@pytest.mark.parametrize("method", sorted(pretrain.METHODS))
def test_every_method_pretrains_end_to_end(shards, tmp_path, method, precision):
    """fp32 and bf16 (CPU autocast through Accelerate) for every method."""
    data = audio(shards) if method == "mp3_speech" else img(shards)
    model = ["model.preset=audio_mp3", "data.batch_size=8"] if method == "mp3_speech" else []
    out = tmp_path / method
    assert pretrain.main([f"method={method}", *data, *TINY, *model, *SMALL_HEADS.get(method, []),
                          "optim.max_steps=3", f"run.mixed_precision={precision}", f"run.output={out}"]) == 0
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3] and all(np.isfinite(r["loss"]) for r in log)
    config = json.loads((out / "checkpoint" / "config.json").read_text())
    assert config["metadata"]["method"] == method and config["metadata"]["data"]["dataset"] in ("toy", "kws")
    expected = "patch_mean" if method in ("mp3", "mp3_speech", "ijepa", "stop", "randsac") else "cls"
    assert config["metadata"]["probe_feature"] == expected, "the checkpoint records the feature its training trained"


def test_pretrain_finetune_evaluate_chain(shards, tmp_path):
    assert pretrain.main(["method=mp3", *img(shards), *TINY, "optim.max_steps=3",
                          f"run.output={tmp_path / 'pre'}"]) == 0
    assert finetune.main([*img(shards), *TINY, "optim.max_steps=3", f"run.output={tmp_path / 'ft'}",
                          f"model.checkpoint={tmp_path / 'pre' / 'checkpoint'}", "finetune.pos_embed=relbias2d"]) == 0
    ft_config = json.loads((tmp_path / "ft" / "checkpoint" / "config.json").read_text())
    assert ft_config["backbone"]["pos_embed"] == "relbias2d" and ft_config["backbone"]["num_classes"] == 3
    assert evaluate.main([*img(shards), "data.batch_size=8", "data.num_workers=0", f"run.output={tmp_path / 'ev'}",
                          f"model.checkpoint={tmp_path / 'ft' / 'checkpoint'}", "eval.probe_train_samples=32",
                          "eval.probe_epochs=2", "eval.max_eval_samples=16"]) == 0
    results = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert results["classification"]["count"] == 32 and set(results["consistency"]) == {
        "0.03", "0.09", "0.15", "0.27", "0.5"}
    assert len(results["knn_per_layer"]) == 2 and 0 <= results["position_probe"]["top1"] <= 1
    assert results["linear_probe_low_label"]["train_samples"] == 3  # 1% of 32, at least one per class
    assert results["probe_feature"] == "cls"  # the fine-tuned head reads the class token
    # The ONNX Runtime evaluator reports the same consistency / Diff. Norm for the same model and images.
    assert export_main([str(tmp_path / "ft" / "checkpoint"), "--out", str(tmp_path / "m.onnx")]) == 0
    assert ort_evaluate_main([str(tmp_path / "m.onnx"), "--data", str(shards / "img" / "test"), "--out",
                              str(tmp_path / "ort"), "--consistency-limit", "16", "--robustness-limit", "0",
                              "--latency-repeats", "0", "--batch-size", "5"]) == 0
    ort = json.loads((tmp_path / "ort" / "results.json").read_text())
    assert ort["accuracy"]["top1"] == results["classification"]["top1"]
    for gamma, value in results["consistency"].items():
        assert ort["consistency"][gamma]["consistency"] == value["consistency"], gamma
        assert ort["consistency"][gamma]["diff_norm"] == pytest.approx(value["diff_norm"], rel=1e-4, abs=1e-6)
    assert evaluate.main([*img(shards), "data.batch_size=8", "data.num_workers=0", f"run.output={tmp_path / 'ev2'}",
                          f"model.checkpoint={tmp_path / 'pre' / 'checkpoint'}", "eval.probe_train_samples=32",
                          "eval.probe_epochs=2", "eval.max_eval_samples=16"]) == 0
    results = json.loads((tmp_path / "ev2" / "results.json").read_text())
    assert results["probe_feature"] == "patch_mean"  # MP3 never trained the class token
    assert set(results["mp3_position_accuracy"]) == {"0.0", "0.25", "0.5", "0.75", "0.9"}
    assert (tmp_path / "ev2" / "mp3_reassembled.png").stat().st_size > 1000


def test_evaluate_privacy_attacks_an_mjp_checkpoint_and_refuses_a_backbone(shards, tmp_path, capsys):
    # 64 patch tokens: APRIL's least squares (MJP App. G) needs embed_dim well above 64 to be well conditioned.
    assert pretrain.main(["method=mjp", *img(shards), *TINY, "model.overrides={embed_dim: 128, num_heads: 2}",
                          "objective.ratio=0.27", "optim.max_steps=2", f"run.output={tmp_path / 'mjp'}"]) == 0
    common = [*img(shards), "data.batch_size=8", "data.num_workers=0", "eval.probe_train_samples=16",
              "eval.probe_epochs=1", "eval.max_eval_samples=8", "eval.consistency_ratios=[]",
              "privacy.images=2", "privacy.steps=3"]
    assert evaluate.main(["--privacy", *common, f"run.output={tmp_path / 'ev'}",
                          f"model.checkpoint={tmp_path / 'mjp' / 'checkpoint'}"]) == 0
    privacy = json.loads((tmp_path / "ev" / "results.json").read_text())["privacy"]
    assert privacy["images"] == 2 and privacy["labels"] == [0, 1] and privacy["unknown_pe_given"]
    assert set(privacy["metrics"]) == {"gradient_matching", "analytic", "random"}
    analytic = privacy["metrics"]["analytic"]
    assert analytic["a"]["psnr"] > 40 > analytic["c"]["psnr"], analytic  # x leaks; x~ is not x
    assert "| analytic | a |" in (tmp_path / "ev" / "report.md").read_text()
    assert (tmp_path / "ev" / "privacy.png").stat().st_size > 1000
    assert pretrain.main(["method=mp3", *img(shards), *TINY, "optim.max_steps=1",
                          f"run.output={tmp_path / 'mp3'}"]) == 0
    capsys.readouterr()
    assert evaluate.main(["--privacy", *common, f"run.output={tmp_path / 'ev2'}",
                          f"model.checkpoint={tmp_path / 'mp3' / 'checkpoint'}"]) == 2
    assert "--privacy needs an image classifier" in capsys.readouterr().err
    assert evaluate.main([*common, "privacy.ratio=1.5", "model.checkpoint=x"]) == 2


@pytest.mark.parametrize("workers", [0, 1])
def test_a_resumed_run_ends_with_the_same_weights(shards, tmp_path, workers):
    args = ["method=stop", *img(shards), *TINY, *SMALL_HEADS["stop"], f"data.num_workers={workers}",
            "optim.max_steps=6"]
    assert pretrain.main([*args, f"run.output={tmp_path / 'straight'}"]) == 0
    assert pretrain.main([*args, f"run.output={tmp_path / 'cut'}", "run.stop_after=4"]) == 0
    assert json.loads((state_dir(tmp_path / "cut") / "trainer.json").read_text()) == {"step": 4}
    assert pretrain.main([*args, f"run.output={tmp_path / 'cut'}", "run.resume=true"]) == 0
    for name in ("model.safetensors", "objective.safetensors"):
        a, b = (load_file(str(tmp_path / run / "checkpoint" / name)) for run in ("straight", "cut"))
        assert a.keys() == b.keys() and all(np.allclose(a[k].numpy(), b[k].numpy(), atol=1e-6) for k in a)


def test_demo_runs_every_stage_and_resumes(shards, tmp_path):
    args = ["--out", str(tmp_path / "demo"), "--preset", "vit_micro", "--pretrain-epochs", "1",
            "--finetune-epochs", "1", *img(shards), "data.num_workers=0", "data.batch_size=16", "run.tensorboard=false",
            "eval.probe_train_samples=32", "eval.probe_epochs=2", "eval.max_eval_samples=16",
            "--ort-robustness-limit", "2", "--ort-latency-repeats", "1"]
    assert demo.main(args) == 0
    report = (tmp_path / "demo" / "report.md").read_text()
    assert "test top-1" in report and (tmp_path / "demo" / "losses.png").is_file()
    assert "max |ONNX Runtime - PyTorch|" in report and (tmp_path / "demo" / "export" / "model.onnx").is_file()
    assert "ONNX Runtime (CPUExecutionProvider): test top-1" in report
    first = (tmp_path / "demo" / "pretrain" / "DONE").read_text()
    assert demo.main(args) == 0 and (tmp_path / "demo" / "pretrain" / "DONE").read_text() == first  # skipped


def test_study_runs_every_stage_resumes_and_reports(shards, tmp_path, capsys):
    """The main table, MP3 Table 3 (fine-tunes of the main pretraining), speech with two seeds and the RandSAC
    ablations probed only, on tiny data."""
    args = ["--config", str(ROOT / "pipelines" / "configs" / "study_fashion_mnist.yaml"), f"runs={tmp_path / 'runs'}",
            f"results={tmp_path / 'results'}", "preset=vit_micro", "pretrain_epochs=0.25", "finetune_epochs=0.25",
            "batch_size=8", "num_workers=0", f"fashion_mnist={shards / 'img'}", f"spoken_keywords={shards / 'audio'}",
            "groups=[main,mp3_pe,speech,randsac]", "probe_only=[randsac]", "probe_train_samples=32",
            "probe_val_samples=32", "probe_epochs=2",
            "curve_samples=16", "ort_consistency_samples=8", "robustness_samples=2", "test_samples=32",
            "speech_pretrain_epochs=1",
            "speech_finetune_epochs=1", "speech_seeds=[0,1]", "overrides=[data.shuffle_buffer=16]",
            "speech_overrides=[data.batch_size=8]", "privacy_steps=3"]
    assert study.main(args) == 0
    result = json.loads((tmp_path / "results" / "study.json").read_text())
    rows = result["results"]
    assert set(rows) == {r.name for r in study.RUNS if r.group in ("main", "mp3_pe", "speech", "randsac")}
    raster = rows["randsac_raster"][0]  # probe-only ablation: pretrained and probed, not fine-tuned
    assert raster["top1"] is None and raster["finetune_epochs"] == 0 and "linear_probe" in raster
    assert not (tmp_path / "runs" / "seed0" / "randsac_raster" / "finetune").exists()
    sup, mp3 = rows["supervised"][0], rows["mp3"][0]
    assert sup["pretrain_epochs"] == 0 and sup["finetune_epochs"] == 0.5, "supervised: the same total epochs"
    assert mp3["pretrain_epochs"] == 0.25 and mp3["finetune_pe"] == "learned"
    assert sup["mce"] == pytest.approx(1.0), "mCE is normalized by the supervised run"
    for name in ("supervised", "mp3", "mjp", "stop"):  # ONNX Runtime and PyTorch agree on the same 32 images
        assert abs(rows[name][0]["top1_ort"] - rows[name][0]["top1"]) <= 1 / 32, name
    assert "position_accuracy" in mp3 and "mp3_eta_curve" in mp3 and "droppos_grid" in rows["droppos"][0]
    assert "linear_probe_1pct" in rows["stop"][0] and "consistency" in rows["mjp"][0]
    runs = tmp_path / "runs" / "seed0"
    assert not (runs / "mp3_ft_none" / "pretrain").exists(), "MP3 Table 3 rows fine-tune the main MP3 pretraining"
    assert (runs / "mp3_ft_none" / "finetune" / "DONE").is_file()
    assert [m["seed"] for m in rows["speech_mp3"]] == [0, 1]
    text = (tmp_path / "results" / "study.md").read_text()
    assert "Hardware: " in text and "| MP3 | 0 |" in text and " ± " in text  # two speech seeds: mean ± std
    claim = next(line for line in text.splitlines() if line.startswith("| MP3 Table 3: MP3 pretraining"))
    assert any(word in claim for word in ("agrees", "contradicts", "tie")), claim
    assert "| DropPos gamma 0.5 | not run |" in text
    privacy = rows["supervised"][0]["privacy"]  # MJP Table 5 on the 3 toy classes, one image each
    assert rows["supervised"][0]["privacy_setup"]["images"] == 3 and set(privacy["analytic"]) == {"a", "b", "c"}
    assert set(rows["supervised_nope"][0]["privacy"]) == {"gradient_matching", "random"}, "no PE: no APRIL"
    assert "## MJP: gradient inversion" in text and "| supervised, no PE | 0 | gradient matching | (a) |" in text
    assert "| MJP gamma 0.27 | not run |" in text
    for figure in ("study_main.png", "study_mp3_eta.png", "study_mjp_consistency.png", "study_privacy.png"):
        assert (tmp_path / "results" / figure).is_file(), figure
    capsys.readouterr()
    assert study.main(args) == 0  # resumes: every stage is skipped
    out = capsys.readouterr().out
    assert "done before, skipping" in out and "] --config" not in out


def test_study_splits_groups_over_jobs_and_stages_refuse_a_busy_directory(tmp_path):
    buckets = study.split_groups(study.GROUPS, 2)
    assert sorted(g for b in buckets for g in b) == sorted(study.GROUPS) and len(buckets) == 2
    host = next(b for b in buckets if "main" in b)
    assert host.index("mp3_pe") > host.index("main"), "mp3_pe fine-tunes main's MP3 pretraining"
    order = ("randsac", "main", "mjp", "mp3_pe", "speech", "droppos", "mp3_eta")
    for bucket in study.split_groups(order, 3):  # every process keeps the priority order given
        assert bucket == sorted(bucket, key=lambda g: order.index(g) if g != "mp3_pe" else 1.5), bucket
    with pytest.raises(pipeline_config.ConfigError, match="probe_only"):
        pipeline_config.load(study.StudyConfig, None, ["probe_only=[main]"])
    (tmp_path / "LOCK").write_text(str(os.getppid()))  # a live process holds the stage
    with pytest.raises(stages.StageError, match="is being run by process"):
        stages.stage(tmp_path, lambda argv: 0, [])
    (tmp_path / "LOCK").write_text("999999999")  # its process is gone: taken over
    assert stages.stage(tmp_path, lambda argv: 0, []) >= 0 and (tmp_path / "DONE").is_file()
    assert not (tmp_path / "LOCK").exists()
    with pytest.raises(stages.StageError, match="failed"):
        stages.stage(tmp_path / "x", lambda argv: 1, [])
    assert not (tmp_path / "x" / "DONE").exists() and not (tmp_path / "x" / "LOCK").exists()


def test_study_merges_earlier_results_at_the_same_budget_only(tmp_path, capsys):
    """Seeds accumulate: rows of an earlier study.json (another machine, runs/ cleaned) join the rows measured now;
    measured rows win, mCE is recomputed over the merged table, and another budget is not reused."""
    cfg = pipeline_config.load(study.StudyConfig, None, [f"runs={tmp_path / 'runs'}", f"results={tmp_path}"])

    def row(seed: int, top1: float, error: float) -> dict:
        return {"seed": seed, "top1": top1, "corruption_errors": {"noise": error}, "mce": 9.0}

    earlier = {"harness": study.HARNESS_VERSION, "config": dataclasses.asdict(cfg),
               "commands": ["python pipelines/study.py seeds=[0]"],
               "results": {"supervised": [row(0, 0.5, 0.4), row(1, 0.6, 0.5)], "mp3": [row(0, 0.7, 0.2)]}}
    (tmp_path / "study.json").write_text(json.dumps(earlier))
    rows = study.collect(study.Study(cfg))
    assert study.commands_so_far(cfg, ["seeds=[1]"]) == ["python pipelines/study.py seeds=[0]",
                                                         "python pipelines/study.py seeds=[1]"]
    assert study.commands_so_far(cfg, ["--report-only"]) == earlier["commands"]
    assert [m["seed"] for m in rows["supervised"]] == [0, 1] and rows["mp3"][0]["top1"] == 0.7
    assert rows["mp3"][0]["mce"] == pytest.approx(0.5) and rows["supervised"][1]["mce"] == pytest.approx(1.0)
    assert rows["mp3"][0]["source"] == str(tmp_path / "study.json")
    assert " ± " in study.stat(rows["supervised"], "top1")  # two seeds: mean ± std

    del earlier["harness"]  # measured by the harness before issue 16 (no version recorded): not merged
    (tmp_path / "study.json").write_text(json.dumps(earlier))
    assert study.collect(study.Study(cfg)) == {}
    assert "harness differ" in capsys.readouterr().out
    earlier["harness"] = study.HARNESS_VERSION
    earlier["config"]["pretrain_epochs"] = 5.0  # measured at another budget: not merged
    (tmp_path / "study.json").write_text(json.dumps(earlier))
    assert study.collect(study.Study(cfg)) == {}
    assert "pretrain_epochs differ" in capsys.readouterr().out
    assert study.commands_so_far(cfg, ["seeds=[1]"]) == ["python pipelines/study.py seeds=[1]"]


def test_study_claims_compare_runs_on_the_seeds_they_share():
    """A 3-seed run against a 1-seed ablation is compared on the shared seed; a mean difference inside the spread
    of the per-seed differences is a tie, not a verdict."""
    three, one = {0: 0.50, 1: 0.60, 2: 0.70}, {0: 0.52}
    assert study.verdict(three, one, paper_says_higher=True) == "**contradicts** (-2.0 pt, seed 0)"
    assert study.verdict({0: 0.50, 1: 0.625}, {0: 0.45, 1: 0.65}, True) == "tie (+1.2 ± 5.3 pt, seeds 0,1)"
    assert study.verdict({0: 0.60, 1: 0.61}, {0: 0.50, 1: 0.52}, True) == "agrees (+9.5 ± 0.7 pt, seeds 0,1)"
    assert study.verdict({1: 0.6}, {0: 0.5}, True).endswith("unpaired seeds)")
    assert study.verdict({}, one, True) == "not run"
    assert study.on_par(three, one).startswith("**contradicts**") and study.on_par({0: 0.525}, one).startswith("agrees")
    assert study.verdict({0: 9.0}, {0: 97.0}, False, noise=1.0, scale=1, unit="dB PSNR") == \
        "agrees (-88.0 dB PSNR, seed 0)"
