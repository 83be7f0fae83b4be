"""Pipelines end to end on tiny shards the test writes: configs, every method, fine-tune, evaluate, resume,
and the demo orchestration (multi-process runs: test_ddp.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from fault_driver import sigterm_at
from pipeline_args import TINY, audio, img, method_args, run_log, small_heads, state_dir
from safetensors.torch import load_file

from patchplace.data.memory import InMemorySplit
from patchplace.export.__main__ import main as export_main
from patchplace.export.evaluate import OnnxModel
from patchplace.export.evaluate import main as ort_evaluate_main
from patchplace.models import load_pretrained
from patchplace.objectives import get_method, list_methods, method_names
from patchplace.pipelines import config as pipeline_config
from patchplace.pipelines import (
    demo,
    evaluate,
    finetune,
    pretrain,
)
from patchplace.pipelines.config import ConfigError
from patchplace.pipelines.engine.budget import finite_mode
from patchplace.pipelines.engine.optim import make_optimizer
from patchplace.pipelines.sections import OptimSection, RunSection
from patchplace.research import recipes
from patchplace.research.reproduction import plan as study_plan

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # end to end: real runs of the pipelines


def test_every_shipped_config_loads_and_validates(shards):
    from patchplace.research import controls

    classes = {"finetune": finetune.FinetuneConfig, "evaluate": evaluate.EvaluateConfig,
               "controls": controls.ControlsConfig}
    # the at-scale recipes: their stage is in their cited data (imagenet_*_linprobe.yaml is an evaluate.py config)
    at_scale = {r.file: {"linprobe": "evaluate", "lowlabel": "evaluate"}.get(r.stage, r.stage)
                for r in recipes.load_recipes()}
    for path in sorted((ROOT / "pipelines" / "configs").glob("*.yaml")):
        if path.name.startswith("study"):
            cfg = pipeline_config.load(study_plan.StudyConfig, str(path), [])
            assert "main" in cfg.groups and cfg.protocol, path
            if path.name == "study_v5.yaml":  # the pre-registered protocol states its seeds and epochs
                from patchplace.research.reproduction.protocol import load_protocol
                from patchplace.research.reproduction.schedule import mismatch

                assert mismatch(cfg, load_protocol(ROOT / "research" / "protocols" / "study_v5.yaml")) is None
            continue
        kind = at_scale.get(path.name) or next((k for k in classes if path.name.startswith(k)), "pretrain")
        data = audio(shards) if "spoken" in path.name or path.name.startswith("speech_commands") else img(shards)
        extra = ["model.checkpoint=unused"] if kind == "evaluate" else []
        cfg = pipeline_config.load(classes.get(kind, pretrain.PretrainConfig), str(path), data + extra)
        assert Path(cfg.data.train).is_dir(), path


@pytest.mark.parametrize(("overrides", "message"), [
    (["optim.lrr=1"], r"unknown config key\(s\) \['optim.lrr'\]"),
    (["optim.lr=-1"], "optim.lr must be > 0"),
    (["method=mp4"], "method 'mp4' is not one of"),
    (["objective.eta=1.5"], r"^error: objective\.eta must be in \[0, 1\), got 1\.5$"),
    (["objective.eta=yes"], r"^error: objective\.eta: expected float, got 'yes'$"),  # (was a TypeError traceback)
    (["data.train=/nowhere/train"], "data.train: no manifest.json in /nowhere/train"),
    (["data.batch_size=many"], "data.batch_size: expected int"),
    (["optim.max_steps=-5"], r"optim.max_steps must be >= 1 \(or null"),  # 0 steps would train nothing
])
def test_bad_configs_fail_with_one_line(shards, capsys, overrides, message):
    assert pretrain.main([*img(shards), *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and __import__("re").search(message, err), err


def test_the_objective_section_is_the_methods_own_config_once_validated(shards, tmp_path):
    """``objective`` is the registered method's config object: the class's defaults, the registration's
    (``stop``: I-JEPA's with ``stop=True``), then the file's and the overrides' fields, typed as every section; an
    unknown or mistyped field is one line naming ``objective.<field>``."""
    file = tmp_path / "stop.yaml"
    file.write_text("method: stop\nobjective: {sigma: 0.5, target_scale: [0.1, 0.3]}\n")
    cfg = pipeline_config.load(pretrain.PretrainConfig, str(file), [*img(shards), "objective.min_keep=2"])
    assert cfg.objective == get_method("ijepa").config_cls(stop=True, sigma=0.5, target_scale=(0.1, 0.3), min_keep=2)
    assert cfg.objective_config() is cfg.objective and cfg.objective_values()["stop"] is True
    assert get_method("stop").config(cfg.objective) is cfg.objective, "the registry takes the built object"
    with pytest.raises(ValueError, match="method 'mp3' is configured by MP3Config, not IJEPAConfig"):
        get_method("mp3").config(cfg.objective)
    recorded = yaml.safe_load(yaml.safe_dump(pipeline_config.to_dict(cfg), sort_keys=False))["objective"]
    assert list(recorded) == list(cfg.objective_values()), "config.yaml records every field in force"
    assert (recorded["stop"], recorded["target_scale"], recorded["ema_end"]) == (True, [0.1, 0.3], 1.0)
    for overrides, message in (
            (["objective.sigmaa=0.5"], r"unknown config key\(s\) \['objective.sigmaa'\]; method=stop knows: "),
            (["objective.sigma=x"], r"objective.sigma: expected float, got 'x'"),
            (["objective.stop=1"], r"objective.stop: expected bool, got 1"),
            (["objective.sigma=-1"], r"objective.sigma \(a standard deviation\) must be >= 0, got -1.0")):
        with pytest.raises(pipeline_config.ConfigError, match=f"^{message}") as refused:
            pipeline_config.load(pretrain.PretrainConfig, str(file), [*img(shards), *overrides])
        assert "\n" not in str(refused.value)


@pytest.mark.parametrize(("method", "overrides", "message"), [
    ("droppos", ["objective.decoder_dim=512", "objective.decoder_heads=12"],
     "objective.decoder_dim 512 must be divisible by objective.decoder_heads 12"),
    ("stop", ["objective.noise_on=everywhere"],
     "objective.noise_on must be one of ('masked', 'context', 'both') and objective.covariance one of ('learned', "
     "'fixed'), got 'everywhere', 'learned'"),
])
def test_an_objective_refusal_names_every_field_it_mentions_as_its_key(shards, method, overrides, message):
    with pytest.raises(pipeline_config.ConfigError) as refused:
        pipeline_config.load(pretrain.PretrainConfig, None, [*img(shards), f"method={method}", *overrides])
    assert str(refused.value) == message


def test_a_run_recorded_with_the_given_objective_fields_only_still_resumes(shards, tmp_path, capsys):
    """config.yaml records every objective field in force; a run whose record holds the given ones only (written
    before it did) compares by its method's defaults: it resumes, and a changed field is named."""
    from patchplace.pipelines.engine.rundir import config_changes

    full = {"method": "stop", "objective": dict(vars(get_method("stop").config({"sigma": 0.5})))}  # as recorded now
    assert config_changes({"method": "stop", "objective": {"sigma": 0.5}}, full) == []
    assert config_changes({"method": "stop", "objective": {}}, full) == ["objective.sigma (0.25 -> 0.5)"]
    out, args = tmp_path / "run", [*method_args(shards, "mp3"), "optim.max_steps=2"]
    assert pretrain.main([*args, f"run.output={out}"]) == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["objective"] == {"eta": 0.75, "anchor_ratio": 0.0}, "every field in force"
    assert json.loads((out / "checkpoint" / "config.json").read_text())["metadata"]["objective"] == saved["objective"]
    (out / "config.yaml").write_text(yaml.safe_dump({**saved, "objective": {}}, sort_keys=False))  # an older record
    assert pretrain.main([*args, f"run.output={out}", "run.resume=true"]) == 0
    assert pretrain.main([*args, f"run.output={out}", "run.resume=true", "objective.eta=0.5"]) == 2
    assert "objective.eta (0.75 -> 0.5) differ from" in capsys.readouterr().err


def test_overrides_read_yes_no_on_off_as_words_and_only_true_false_as_bools(shards):
    """YAML 1.1 would read ``run.mixed_precision=no`` as False and fail the str field (seen on the first GPU run)."""
    cfg = pipeline_config.load(pretrain.PretrainConfig, None, [*img(shards), "run.mixed_precision=no",
                                                               "run.resume=true", "run.tensorboard=False"])
    assert cfg.run.mixed_precision == "no" and cfg.run.resume is True and cfg.run.tensorboard is False
    with pytest.raises(pipeline_config.ConfigError, match=r"run\.resume: expected bool, got 'yes'"):
        pipeline_config.load(pretrain.PretrainConfig, None, [*img(shards), "run.resume=yes"])


def test_a_section_given_in_part_keeps_the_pipelines_defaults_for_the_rest(shards):
    """``optim.max_steps=5`` keeps the rest of the pretraining OptimSection (lr 1.5e-3, betas (0.9, 0.95)), not the
    section class's defaults (lr 1e-3, betas (0.9, 0.999)), and so does the speech config (which sets no betas)."""
    cfg = pipeline_config.load(pretrain.PretrainConfig, None, [*img(shards), "optim.max_steps=5", "run.seed=3"])
    assert (cfg.optim.lr, cfg.optim.betas, cfg.optim.max_steps) == (1.5e-3, (0.9, 0.95), 5)
    assert (cfg.run.output, cfg.run.seed) == ("runs/pretrain", 3)
    speech = pipeline_config.load(pretrain.PretrainConfig, str(ROOT / "pipelines" / "configs" /
                                                               "mp3_speech_spoken_keywords.yaml"), audio(shards))
    assert (speech.optim.lr, speech.optim.betas) == (1e-3, (0.9, 0.95))
    ft = pipeline_config.load(finetune.FinetuneConfig, None, [*img(shards), "optim.epochs=2"])
    assert (ft.optim.lr, ft.optim.layer_decay, ft.run.output) == (1e-3, 0.75, "runs/finetune")


def test_config_values_keep_their_types_and_strings_stay_as_written(shards, tmp_path):
    """Tuple fields come back as tuples; a number with an exponent is a float in the free-form sections too; a
    string is taken as written (a pipe: URL's ${VAR} is no interpolation); a field nothing sets keeps its
    default object (config.yaml writes memory_budget_mb: 4096). A training config loads for evaluation: the training
    fields of its data / model / run sections are accepted and ignored."""
    cfg = pipeline_config.load(pretrain.PretrainConfig, None, [
        *img(shards), "run.keep_epochs=[0, 1]", "objective.eta=5e-1", "model.overrides={drop_path_rate: 1e-1}",
        "data.train_urls=pipe:cat ${DIR}/x.tar"])
    assert (cfg.run.keep_epochs, cfg.optim.betas, cfg.data.scale) == ((0.0, 1.0), (0.9, 0.95), (0.35, 1.0))
    assert cfg.objective == get_method("mp3").config_cls(eta=0.5) and cfg.model.overrides == {"drop_path_rate": 0.1}
    assert cfg.data.train_urls == "pipe:cat ${DIR}/x.tar"
    assert "  memory_budget_mb: 4096\n" in yaml.safe_dump(pipeline_config.to_dict(cfg), sort_keys=False)
    shared = tmp_path / "shared.yaml"
    shared.write_text("data: {hflip: 0.2, batch_size: 16}\nmodel: {preset: vit_tiny, attention: math}\n"
                      "run: {compile: default, mixed_precision: bf16, seed: 3}\n")
    ev = pipeline_config.load(evaluate.EvaluateConfig, str(shared), [*img(shards), "model.checkpoint=c"])
    assert (ev.data.batch_size, ev.model.attention, ev.run.seed, ev.run.mixed_precision) == (16, "math", 3, "no")
    assert ev.data.hflip == 0.0 and not hasattr(ev.run, "compile") and not hasattr(ev.model, "preset")
    with pytest.raises(pipeline_config.ConfigError, match=r"unknown config key\(s\) \['run.complie'\]"):
        pipeline_config.load(evaluate.EvaluateConfig, str(shared), [*img(shards), "run.complie=default"])


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_a_run_trains_at_its_mixed_precision_and_records_it(shards, tmp_path, precision):
    """One precision per process (Accelerate's state; ``conftest.fresh_accelerate_state`` gives each test its own),
    recorded in config.yaml."""
    assert pretrain.main(["method=supervised", *img(shards), *TINY, "optim.max_steps=1",
                          f"run.mixed_precision={precision}", f"run.output={tmp_path}"]) == 0
    config = (tmp_path / "config.yaml").read_text()
    assert f"mixed_precision: {precision if precision != 'no' else repr('no')}" in config


def test_the_attention_kernel_is_a_setting_that_changes_no_number(shards, tmp_path):
    """``model.attention=math`` (the materialised softmax) trains MP3 to the losses of the fused kernel; each
    stage of a process sets its own kernel (the math stage's choice does not stay for the next)."""
    from patchplace.models import get_attention_kernel

    losses = {}
    for kernel in ("math", "sdpa"):
        out = tmp_path / kernel
        assert pretrain.main(["method=mp3", *img(shards), *TINY, "optim.max_steps=3", f"model.attention={kernel}",
                              f"run.output={out}"]) == 0
        assert get_attention_kernel() == kernel
        losses[kernel] = [r["loss"] for r in run_log(out)]
    assert len(losses["math"]) == 3 and losses["math"] == pytest.approx(losses["sdpa"], rel=1e-4)


def test_compiled_blocks_and_the_fused_optimizer_train_to_the_same_losses_and_checkpoint_names(shards, tmp_path,
                                                                                               capsys):
    """The GPU speed knobs change no number: ``run.compile`` (every Transformer block compiled in place; aot_eager
    traces the blocks as inductor would, without generating code) and ``optim.fused`` (AdamW's fused kernel) train
    MAE (backbone and decoder blocks) to eager / foreach's losses and weights, under the same parameter names."""
    from patchplace.models.backbone import Block
    from patchplace.pipelines import engine

    runs = {"eager": [], "fast": ["run.compile=aot_eager", "optim.fused=true"]}
    for name, knobs in runs.items():
        assert pretrain.main(["method=mae", *img(shards), *TINY, *small_heads("mae"), "optim.max_steps=3", *knobs,
                              f"run.output={tmp_path / name}"]) == 0
    assert "run.compile=aot_eager: 3 Transformer blocks compiled" in capsys.readouterr().out  # 2 encoder, 1 decoder
    losses = {name: [r["loss"] for r in run_log(tmp_path / name)] for name in runs}
    assert len(losses["fast"]) == 3 and losses["fast"] == pytest.approx(losses["eager"], rel=1e-4)
    weights = {name: load_file(str(tmp_path / name / "checkpoint" / "model.safetensors")) for name in runs}
    assert weights["fast"].keys() == weights["eager"].keys()
    assert all(torch.allclose(weights["fast"][k], weights["eager"][k], atol=1e-5) for k in weights["eager"])
    model = torch.nn.Sequential(*(Block(16, 2, 2.0, True, 0.0, 0.0, 0.0, 1e-6) for _ in range(2)))
    assert engine.compile_objective(model, "no") == 0 and engine.compile_objective(model, "aot_eager") == 2
    assert all(b._compiled_call_impl is not None for b in model)  # compiled in place: same module, same names
    cfg = OptimSection()
    assert not engine.make_optimizer(model, cfg, device=torch.device("cpu")).defaults["fused"]  # null: GPU only
    assert engine.make_optimizer(model, cfg, device=torch.device("cuda")).defaults["fused"]
    cfg.fused = True
    assert engine.make_optimizer(model, cfg, device=torch.device("cpu")).defaults["fused"]


@pytest.mark.parametrize("method", ["ijepa", "stop"])
def test_ijepa_and_stop_checkpoints_hold_the_target_encoder_their_papers_evaluate(shards, tmp_path, method):
    """checkpoint/ is the EMA target encoder (what probes, fine-tuning and export read), the context encoder beside
    it in checkpoint/context_encoder/ (on request: model.checkpoint=RUN/checkpoint/context_encoder); the metadata
    says which; every other method's checkpoint is its trained backbone."""
    out = tmp_path / method
    assert pretrain.main([*method_args(shards, method), "optim.max_steps=3", f"run.output={out}"]) == 0
    state = load_file(str(state_dir(out) / "model.safetensors"))  # the whole objective, as Accelerate saved it
    target, meta = load_pretrained(out / "checkpoint")
    context, context_meta = load_pretrained(out / "checkpoint" / "context_encoder")
    assert meta["encoder"] == "target_encoder" and context_meta["encoder"] == "context_encoder"
    for name, tensor in target.state_dict().items():
        assert torch.equal(tensor, state[f"target_encoder.{name}"]), name
    for name, tensor in context.state_dict().items():
        assert torch.equal(tensor, state[f"backbone.{name}"]), name
    assert not all(torch.equal(target.state_dict()[k], v) for k, v in context.state_dict().items()), \
        "after 3 steps the EMA differs from the context encoder"
    mae = tmp_path / "mae"
    assert pretrain.main([*method_args(shards, "mae"), "optim.max_steps=1", f"run.output={mae}"]) == 0
    assert load_pretrained(mae / "checkpoint")[1]["encoder"] == "backbone"
    assert not (mae / "checkpoint" / "context_encoder").exists()


def test_the_finite_check_in_force_is_lazy_on_a_gpu_with_the_fused_adamw_only():
    """run.finite_check=auto: no host sync per step where the lazy check is exact (a fused AdamW skips a flagged
    step; fp16's scaler skips steps of its own), the per-step check elsewhere; lazy without a fused AdamW refused."""
    model = torch.nn.Linear(2, 2)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    fused = make_optimizer(model, OptimSection(), device=cuda)
    plain = make_optimizer(model, OptimSection(), device=cpu)
    auto = RunSection()
    assert auto.finite_check == "auto"
    assert finite_mode(auto, fused, cuda) == "lazy" and finite_mode(auto, plain, cpu) == "step"
    assert finite_mode(auto, fused, cpu) == "step"
    assert finite_mode(RunSection(mixed_precision="fp16"), fused, cuda) == "step"
    assert finite_mode(RunSection(finite_check="step"), fused, cuda) == "step"
    with pytest.raises(ConfigError, match=r"optim\.fused=true"):
        finite_mode(RunSection(finite_check="lazy"), plain, cpu)


@pytest.mark.parametrize("method", method_names())
def test_every_method_trains_its_whole_step_compiled_as_one_graph_as_eager(shards, tmp_path, capsys, method):
    """run.compile_scope=step: the objective's forward and backward as one fullgraph (a graph break would fail the
    run), the same losses and weights as eager (aot_eager draws the masks from the same random stream)."""
    runs = {"eager": [], "step": ["run.compile=aot_eager", "run.compile_scope=step"]}
    for name, knobs in runs.items():
        assert pretrain.main([*method_args(shards, method), "optim.max_steps=3", *knobs,
                              f"run.output={tmp_path / name}"]) == 0
    assert "the objective's step compiled as one graph" in capsys.readouterr().out
    losses = {name: [r["loss"] for r in run_log(tmp_path / name)] for name in runs}
    assert len(losses["step"]) == 3 and losses["step"] == pytest.approx(losses["eager"], rel=1e-4)
    weights = {name: load_file(str(tmp_path / name / "checkpoint" / "model.safetensors")) for name in runs}
    assert all(torch.allclose(weights["step"][k], weights["eager"][k], atol=1e-5) for k in weights["eager"])


@pytest.mark.parametrize(("method", "metric"), [("supervised", "top1"), ("mp3", "pos_acc"), ("mae", "loss")])
def test_pretraining_validates_on_eval_every_and_changes_nothing_of_the_run(shards, tmp_path, method, metric):
    """``run.eval_every`` evaluates the objective's own metrics on data.val (supervised / MJP: top-1) and logs
    them; the weights trained are bit-identical to a run that evaluates only at its end."""
    from safetensors.torch import load_file

    args = [f"method={method}", *img(shards), *TINY, *small_heads(method), "optim.max_steps=4"]
    for every in (1, 0):
        assert pretrain.main([*args, f"run.eval_every={every}", f"run.output={tmp_path / str(every)}"]) == 0
    evals = [r for r in map(json.loads, (tmp_path / "1" / "log.jsonl").read_text().splitlines()) if "eval" in r]
    assert [r["step"] for r in evals] == [1, 2, 3, 4] and all(metric in r["eval"] and "loss" in r["eval"]
                                                              for r in evals)
    assert evals[0]["eval"]["count"] > 0 and evals[0]["eval"] != evals[-1]["eval"], "it measures the weights"
    final = [r for r in map(json.loads, (tmp_path / "0" / "log.jsonl").read_text().splitlines()) if "eval" in r]
    assert [r["step"] for r in final] == [4] and final[0]["eval"] == evals[-1]["eval"], "the same draws each time"
    weights = [load_file(str(tmp_path / d / "checkpoint" / "model.safetensors")) for d in ("1", "0")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_help_lists_every_field_with_its_default(capsys):
    with pytest.raises(SystemExit):
        pretrain.main(["--help"])
    out = capsys.readouterr().out
    assert "optim.lr = 0.0015" in out and "data.pad_to = 32" in out and "run.resume = False" in out


@pytest.mark.parametrize("precision", ["no", "bf16"])
@pytest.mark.parametrize("method", method_names())
def test_every_method_pretrains_end_to_end(shards, tmp_path, method, precision):
    """fp32 and bf16 (CPU autocast through Accelerate) for every method."""
    out = tmp_path / method
    assert pretrain.main([*method_args(shards, method), "optim.max_steps=3", f"run.mixed_precision={precision}",
                          f"run.output={out}"]) == 0
    records, log = run_log(out, everything=True), run_log(out)
    assert [r["step"] for r in log] == [1, 2, 3] and all(np.isfinite(r["loss"]) for r in log)
    closing = [r for r in records if "eval" in r]  # the objective's own metrics on data.val at the end
    assert [r["step"] for r in closing] == [3] and np.isfinite(closing[0]["eval"]["loss"])
    assert config_metrics(out) == {k: v for k, v in closing[0]["eval"].items() if isinstance(v, int | float)}
    config = json.loads((out / "checkpoint" / "config.json").read_text())
    assert config["metadata"]["method"] == method and config["metadata"]["data"]["dataset"] in ("toy", "kws")
    spec, (backbone, _) = get_method(method), load_pretrained(out / "checkpoint")
    assert config["metadata"]["probe_feature"] == spec.probe_feature_for(backbone), \
        "the checkpoint records the feature its training trained"
    assert config["metadata"]["finetune_pool"] == spec.finetune_pool_for(backbone), \
        "and the pooling its method's own fine-tuning uses"
    assert config["metadata"].get("paper") == (spec.paper or None), "and its paper, for the model card"
    assert config["metadata"]["preset"] == yaml.safe_load((out / "config.yaml").read_text())["model"]["preset"], \
        "and the preset it was built from (what a command-line model.preset beside it is checked against)"


def config_metrics(out: Path) -> dict:
    return json.loads((out / "checkpoint" / "config.json").read_text())["metadata"].get("metrics")


def readme_snippet(name: str, **names) -> dict:
    """Run docs/interop.md's ``<!-- snippet: name -->`` python block (the routes the README links to) with
    ``names`` defined; -> its globals."""
    text = (ROOT / "docs" / "interop.md").read_text()
    code = text.split(f"<!-- snippet: {name} -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    scope = dict(names)
    exec(compile(code, f"docs/interop.md snippet {name}", "exec"), scope)
    return scope


def numpy_only_top1(onnx_path: Path, split: Path) -> tuple[float, np.ndarray]:
    """Top-1 of an exported classifier through the README's onnxruntime + numpy snippet, which reads nothing but
    the ONNX file's metadata_props (the raw uint8 images come from the shards)."""
    raw = InMemorySplit.load(split)
    scope = readme_snippet("onnxruntime", MODEL=str(onnx_path), images=raw.inputs.numpy())
    assert scope["classes"] == raw.manifest.classes and scope["pre"]["layout"] == "NCHW"
    truth = [raw.manifest.classes[i] for i in raw.labels.tolist()]
    return float(np.mean([p == t for p, t in zip(scope["predictions"], truth, strict=True)])), scope["x"]


def test_pretrain_finetune_evaluate_chain(shards, tmp_path):
    assert pretrain.main(["method=mp3", *img(shards), *TINY, "optim.max_steps=3",
                          f"run.output={tmp_path / 'pre'}"]) == 0
    assert finetune.main([*img(shards), *TINY, "optim.max_steps=3", f"run.output={tmp_path / 'ft'}",
                          f"model.checkpoint={tmp_path / 'pre' / 'checkpoint'}", "finetune.pos_embed=relbias2d"]) == 0
    ft_config = json.loads((tmp_path / "ft" / "checkpoint" / "config.json").read_text())
    assert ft_config["backbone"]["pos_embed"] == "relbias2d" and ft_config["backbone"]["num_classes"] == 3
    # self-describing checkpoint: recipe, the metrics of the closing evaluation, provenance without local paths,
    # and timm loads it (relbias2d -> timm's Beit) with our outputs
    last = [json.loads(line) for line in (tmp_path / "ft" / "log.jsonl").read_text().splitlines()][-1]["eval"]
    meta = ft_config["metadata"]
    assert meta["metrics"]["top1"] == last["top1"] and meta["recipe"]["optim"]["max_steps"] == 3
    assert meta["pretrained"].startswith("sha256:") and ft_config["architecture"] == "beit_base_patch16_224"
    card = (tmp_path / "ft" / "checkpoint" / "README.md").read_text()
    assert f"| top1 | {last['top1']} |" in card and "Position Prediction" in card
    for file in (tmp_path / "ft" / "checkpoint").iterdir():
        assert str(tmp_path) not in file.read_text(errors="ignore"), f"local path inside {file.name}"
    import timm

    ours = load_pretrained(tmp_path / "ft" / "checkpoint")[0].eval()
    theirs = timm.create_model(f"local-dir:{tmp_path / 'ft' / 'checkpoint'}", pretrained=True).eval()
    x = torch.randn(2, *theirs.pretrained_cfg["input_size"])
    torch.testing.assert_close(theirs(x), ours(x), atol=1e-5, rtol=0)
    scope = readme_snippet("timm", CHECKPOINT=str(tmp_path / "ft" / "checkpoint"))  # the README's blocks, as written
    torch.testing.assert_close(scope["same"](scope["x"]), scope["logits"], atol=1e-5, rtol=0)
    torch.testing.assert_close(scope["logits"], ours(scope["x"]), atol=1e-5, rtol=0)
    scope = readme_snippet("hub", CHECKPOINT=str(tmp_path / "ft" / "checkpoint"), OUT=str(tmp_path / "hub"))
    assert scope["metrics"]["top1"] == last["top1"]
    assert json.loads((tmp_path / "hub" / "config.json").read_text())["id2label"] == ft_config["id2label"]
    assert evaluate.main([*img(shards), "data.batch_size=8", "data.num_workers=0", f"run.output={tmp_path / 'ev'}",
                          f"model.checkpoint={tmp_path / 'ft' / 'checkpoint'}", "eval.probe_train_samples=32",
                          "eval.probe_epochs=2", "eval.max_eval_samples=16"]) == 0
    results = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert results["classification"]["count"] == 32 and set(results["consistency"]) == {
        "0.03", "0.09", "0.15", "0.27", "0.5"}
    assert len(results["knn_per_layer"]) == 2 and 0 <= results["position_probe"]["top1"] <= 1
    assert results["linear_probe_low_label"]["train_samples"] == 3  # 1% of 32, at least one per class
    assert results["probe_feature"] == "cls"  # the fine-tuned head reads the class token
    assert results["plots"] == ["evaluation.png"] and (tmp_path / "ev" / "evaluation.png").stat().st_size > 10_000
    # The ONNX Runtime evaluator reports the same consistency / Diff. Norm for the same model and images.
    assert export_main([str(tmp_path / "ft" / "checkpoint"), "--out", str(tmp_path / "m.onnx")]) == 0
    assert ort_evaluate_main([str(tmp_path / "m.onnx"), "--data", str(shards / "img" / "test"), "--out",
                              str(tmp_path / "ort"), "--consistency-limit", "16", "--robustness-limit", "0",
                              "--latency-repeats", "0", "--batch-size", "5"]) == 0
    ort = json.loads((tmp_path / "ort" / "results.json").read_text())
    assert ort["accuracy"]["top1"] == results["classification"]["top1"]
    # the .onnx file alone describes its preprocessing: onnxruntime + numpy get the evaluator's accuracy
    top1, pixels = numpy_only_top1(tmp_path / "m.onnx", shards / "img" / "test")
    evaluator = OnnxModel(tmp_path / "m.onnx")
    raw = InMemorySplit.load(shards / "img" / "test").inputs
    assert np.array_equal(pixels, evaluator.normalize(evaluator.pad(raw)).numpy()), "the same pixels, bit for bit"
    assert abs(top1 - ort["accuracy"]["top1"]) <= 1 / 32  # (one batch vs batches of 5: a near-tie may flip)
    for gamma, value in results["consistency"].items():
        assert ort["consistency"][gamma]["consistency"] == value["consistency"], gamma
        assert ort["consistency"][gamma]["diff_norm"] == pytest.approx(value["diff_norm"], rel=1e-4, abs=1e-6)
    assert evaluate.main([*img(shards), "data.batch_size=8", "data.num_workers=0", f"run.output={tmp_path / 'ev2'}",
                          f"model.checkpoint={tmp_path / 'pre' / 'checkpoint'}", "eval.probe_train_samples=32",
                          "eval.probe_epochs=2", "eval.max_eval_samples=16", "eval.label_fractions=[0.1,0.5]"]) == 0
    results = json.loads((tmp_path / "ev2" / "results.json").read_text())
    assert results["probe_feature"] == "mean"  # the patch mean of MP3's sequence, which holds the class token
    assert results["plots"] == ["evaluation.png", "mp3_position_accuracy.png", "mp3_reassembled.png"], \
        "a pretrained (headless) checkpoint gets the summary plot too, beside its method's own"
    # label-efficiency probes: the balanced subsets of the whole train split (64 images, 3 classes) fine-tuning uses
    subsets = results["linear_probe_label_fraction"]
    assert {k: v["train_samples"] for k, v in subsets.items()} == {"0.1": 6, "0.5": 31}
    # streamed, the same subsets: drawn from the labels of the stored features (the whole split, in manifest order)
    assert evaluate.main([*img(shards), "data.num_workers=0", f"run.output={tmp_path / 'ev3'}", "data.in_memory=false",
                          f"model.checkpoint={tmp_path / 'pre' / 'checkpoint'}", "eval.label_fractions=[0.1]",
                          "eval.knn=false", "eval.position_probe=false", "eval.linear_probe=false",
                          "eval.max_eval_samples=8"]) == 0
    streamed = json.loads((tmp_path / "ev3" / "results.json").read_text())["linear_probe_label_fraction"]
    assert streamed["0.1"]["train_samples"] == 6
    assert set(results["mp3_position_accuracy"]) == {"0.0", "0.25", "0.5", "0.55", "0.75", "0.9"}
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
    args = ["method=stop", *img(shards), *TINY, *small_heads("stop"), f"data.num_workers={workers}",
            "optim.max_steps=6"]
    assert pretrain.main([*args, f"run.output={tmp_path / 'straight'}"]) == 0
    with sigterm_at(4):
        assert pretrain.main([*args, f"run.output={tmp_path / 'cut'}"]) == 143
    assert json.loads((state_dir(tmp_path / "cut") / "trainer.json").read_text())["step"] == 4
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
    assert "Training precision: " in report  # --precision auto: what this machine trains in, and why
    # the same ViT from scratch for the same total epochs, beside the pretrained one
    assert "| supervised from scratch |" in report and "| MP3 pretraining + fine-tuning |" in report
    used = yaml.safe_load((tmp_path / "demo" / "supervised" / "config.yaml").read_text())
    assert used["optim"]["epochs"] == 2 and used["model"]["checkpoint"] is None
    tuned = yaml.safe_load((tmp_path / "demo" / "finetune" / "config.yaml").read_text())
    for config in (used, tuned):  # the same short-budget recipe and 8 px patches on both sides of the comparison
        assert config["finetune"]["mixup"] == 0 and config["finetune"]["cutmix"] == 0
        assert config["optim"]["layer_decay"] is None and config["data"]["scale"] == [0.8, 1.0]
    assert used["model"]["overrides"] == {"patch_size": 8}
    assert json.loads((tmp_path / "demo" / "finetune" / "checkpoint" / "config.json").read_text())[
        "backbone"]["patch_size"] == 8
    first = (tmp_path / "demo" / "pretrain" / "DONE").read_text()
    assert demo.main(args) == 0 and (tmp_path / "demo" / "pretrain" / "DONE").read_text() == first  # skipped




def test_tensorboard_scalars_are_namespaced_in_one_folder(shards, tmp_path):
    """Training scalars under train/, the trainer's evaluations under val/, the event files in <output>/tensorboard/
    (not tensorboard/tensorboard/)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = [a for a in TINY if not a.startswith("run.tensorboard")]
    assert finetune.main([*img(shards), *args, "optim.max_steps=4", "run.log_every=2", "run.eval_every=2",
                          "run.tensorboard=true", f"run.output={tmp_path / 'ft'}"]) == 0
    events = sorted((tmp_path / "ft" / "tensorboard").glob("events.out.tfevents.*"))
    assert events and not (tmp_path / "ft" / "tensorboard" / "tensorboard").exists()
    tags = EventAccumulator(str(events[0].parent)).Reload().Tags()["scalars"]
    assert {"train/loss", "train/lr", "val/top1", "val/top5"} <= set(tags), tags
    assert not [t for t in tags if "/" not in t], "every scalar is namespaced"


def test_help_describes_every_field_and_the_chosen_objectives_fields(capsys):
    """--help: each config field with its default and meaning (the comments of the config classes), and the
    objective fields of the method the command line picks (method=..., else the --config's, else mp3)."""
    from patchplace.pipelines.help import describe

    for cls in (pretrain.PretrainConfig, finetune.FinetuneConfig, evaluate.EvaluateConfig, study_plan.StudyConfig):
        bare = [line for line in describe(cls) if " # " not in line]
        assert not bare, f"{cls.__name__}: fields without a description: {bare}"
    for spec in list_methods():
        bare = [line for line in describe(spec.config()) if " # " not in line]
        assert not bare, f"{spec.name}: objective fields without a description: {bare}"
    for argv, method, line in (
            (["method=droppos"], "droppos", "objective.tau = 0.1"),
            (["--config", str(ROOT / "pipelines" / "configs" / "stop_fashion_mnist.yaml")], "stop",
             "objective.stop = True"),
            ([], "mp3", "objective.eta = 0.75")):
        with pytest.raises(SystemExit):
            pretrain.main([*argv, "--help"])
        out = capsys.readouterr().out
        assert f"objective fields of method={method}" in out and line in out, out[-600:]
        assert "data.label_fraction = None" in out and "# train on a fixed class-balanced fraction" in out


def test_finetune_and_export_at_another_resolution_resample_the_pe(shards, tmp_path, capsys):
    """Pretrained at 32 px, fine-tuned at 48 px (data.img_size: pad to 32, resize to 48): the 8 x 8 grid becomes
    12 x 12 with the PE resampled; exported at 48 px (its own size) and a 32 px checkpoint exported at 48."""
    assert pretrain.main(["method=droppos", *img(shards), *TINY, "optim.max_steps=2",
                          f"run.output={tmp_path / 'pre'}"]) == 0
    assert finetune.main([*img(shards), *TINY, "optim.max_steps=2", f"run.output={tmp_path / 'ft'}",
                          f"model.checkpoint={tmp_path / 'pre' / 'checkpoint'}", "finetune.pos_embed=null",
                          "data.img_size=48"]) == 0
    assert "trained on a 8x8 patch grid; fine-tuning at 48 px = 12x12 patches, its sincos2d PE" in \
        capsys.readouterr().out
    config = json.loads((tmp_path / "ft" / "checkpoint" / "config.json").read_text())
    assert config["backbone"]["img_size"] == 48 and config["metadata"]["img_size"] == 48
    assert export_main([str(tmp_path / "ft" / "checkpoint"), "--out", str(tmp_path / "ft.onnx"), "--data",
                        str(shards / "img" / "test"), "--samples", "8"]) == 0
    pre = json.loads((tmp_path / "ft.json").read_text())["preprocessing"]
    assert [s["op"] for s in pre["steps"]] == ["pad", "resize", "center_crop", "scale", "normalize"] and \
        pre["height"] == 48
    assert export_main([str(tmp_path / "pre" / "checkpoint"), "--kind", "features", "--img-size", "48", "--out",
                        str(tmp_path / "pre48.onnx")]) == 0
    assert json.loads((tmp_path / "pre48.json").read_text())["inputs"][0]["shape"] == ["batch", 1, 48, 48]
    assert export_main([str(tmp_path / "pre" / "checkpoint"), "--kind", "features", "--img-size", "50", "--out",
                        str(tmp_path / "bad.onnx")]) == 2
    assert "not divisible by patch_size" in capsys.readouterr().err and not (tmp_path / "bad.onnx").exists()


def help_text(main, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return capsys.readouterr().out


def test_help_shows_the_values_of_the_config_file_and_overrides(capsys):
    """--help with --config (and overrides) shows the values the command would run with, each marked with where
    it comes from; the others are the code defaults, unmarked."""
    mp3 = ROOT / "pipelines" / "configs" / "mp3_fashion_mnist.yaml"
    out = help_text(pretrain.main, ["--config", str(mp3), "optim.lr=3e-4"], capsys)
    assert f'changed where marked "(from file)" by --config {mp3}' in " ".join(out.split()), out[:1500]
    assert "  run.checkpoint_every = 200  (from file)" in out and "  optim.betas = (0.9, 0.95)  (from file)" in out
    assert "  optim.lr = 0.0003  (override) " in out and "  run.log_every = 10 " in out
    assert "run.output = 'runs/mp3_fashion_mnist'  (from file)" in out
    out = help_text(evaluate.main, ["--config", str(ROOT / "pipelines" / "configs" / "evaluate_fashion_mnist.yaml")],
                    capsys)
    assert "  data.batch_size = 256  (from file) " in out and "  eval.probe_epochs = 100  (from file) " in out
    out = help_text(pretrain.main, ["--config", "nowhere.yaml"], capsys)  # still help, with the defaults
    assert "(--config nowhere.yaml not applied: " in " ".join(out.split()) and "  optim.lr = 0.0015 " in out


@pytest.mark.parametrize("columns", ["80", "250"])
def test_every_help_line_fits_100_columns(capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", columns)
    configs = ROOT / "pipelines" / "configs"
    for main, argv in ((pretrain.main, []), (pretrain.main, ["--config", str(configs / "mp3_fashion_mnist.yaml"),
                                                              "model.overrides={embed_dim: 64, depth: 2}"]),
                       (pretrain.main, ["method=droppos"]), (finetune.main, []),
                       (finetune.main, ["--config", str(configs / "finetune_fashion_mnist.yaml")]),
                       (evaluate.main, []), (evaluate.main, ["--privacy"])):
        out = help_text(main, argv, capsys)
        long = [line for line in out.splitlines() if len(line) > 100]
        assert not long, f"{main.__module__} {argv}: {long}"
        # a wrapped meaning continues under its first line
        assert "  data.holdout = 0" in out and f"{'':44} # training never reads; data.val=holdout" in out
    from patchplace.research import benchmark, controls, study

    for main in (demo.main, controls.main, study.main, benchmark.main):  # the other entry points: width only
        long = [line for line in help_text(main, [], capsys).splitlines() if len(line) > 100]
        assert not long, f"{main.__module__}: {long}"


def test_evaluate_help_lists_only_what_evaluation_reads_and_its_usage_intact(capsys):
    out = help_text(evaluate.main, [], capsys)
    for unused in ("run.early_stop_patience", "run.log_every", "run.resume", "run.compile", "run.finite_check",
                   "data.hflip", "model.preset", "optim."):
        assert f"  {unused} =" not in out and f"  {unused}." not in out, unused
    assert "run.early_stop_patience" in out.split("not read by this command")[1], "named as ignored"
    assert "  run.output = 'runs/evaluate' " in out and "  data.batch_size = 128 " in out
    assert "  privacy.steps = 200 " in out and "  eval.knn = True " in out
    assert ("    python pipelines/evaluate.py --config pipelines/configs/evaluate_fashion_mnist.yaml \\\n"
            "        model.checkpoint=runs/x/checkpoint\n") in out, out[:800]
    unread = pipeline_config.unread_fields(evaluate.EvaluateConfig)
    assert {"run.compile", "run.finite_check", "model.preset", "data.hflip"} <= set(unread), unread
    assert not [f for f in unread if f"  {f} =" in out], "an unread field in --help"


def test_say_prints_clear_of_the_progress_bar(capsys):
    """engine.say: what the evaluate callbacks print while the Trainer's bar runs goes on its own line."""
    from tqdm.auto import tqdm

    from patchplace.pipelines import engine

    with tqdm(total=10, desc="mp3") as bar:
        bar.update(3)
        engine.say("step 3: val loss 0.5000 (8 samples)")
        bar.update(1)
    out, err = capsys.readouterr()
    assert out == "step 3: val loss 0.5000 (8 samples)\n" and "mp3" in err
