"""The papers' optimization recipe knobs (``optim.warmup_steps / warmup_epochs / start_lr / final_lr / warmup_mode /
schedule / step_every / step_gamma / weight_decay_end / optimizer``, ``run.model_ema``), each against the library or
paper that defines it: timm's ``CosineLRScheduler`` (warm-up + cosine), torch's ``StepLR`` (step decay), I-JEPA's
``CosineWDSchedule`` formula (arXiv 2301.08243), timm's ``ModelEmaV3`` (DeiT's model EMA), torch's ``Adam``; then
through pretrain.py / finetune.py on the test shards."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fault_driver import sigterm_at
from pipeline_args import TINY, img, run_log, state_dir
from safetensors.torch import load_file
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV3
from torch import nn

from patchplace.finetune import build_optimizer
from patchplace.models import load_pretrained
from patchplace.pipelines import finetune, pretrain
from patchplace.pipelines.config import ConfigError
from patchplace.pipelines.engine import StepSchedule, WeightsEma, make_optimizer, warmup_cosine
from patchplace.pipelines.engine.budget import BatchPlan, start_line
from patchplace.pipelines.engine.schedules import cosine_weight_decay, lr_factor, warmup_length
from patchplace.pipelines.sections import OptimSection, RunSection

ROOT = Path(__file__).resolve().parents[1]
FT_CONFIG = str(ROOT / "pipelines" / "configs" / "finetune_fashion_mnist.yaml")


class Toy(nn.Module):
    """A backbone-holding objective: decayed weights, no-decay norms / biases, a BatchNorm's buffers (float running
    stats and the integer batch count, which ModelEmaV3 copies)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.LayerNorm(8))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def groups_optimizer(scales: list[float], lr: float) -> torch.optim.Optimizer:
    """An optimizer with one group per layer-decay ``lr_scale``, at ``lr x scale`` (as build_optimizer sets them)."""
    params = [{"params": [nn.Parameter(torch.zeros(1))], "lr": lr * s, "lr_scale": s} for s in scales]
    return torch.optim.SGD(params, lr=lr)


# ---------------------------------------------------------------------------------------------- lr schedules
@pytest.mark.parametrize(("total", "fraction", "ratio"), [(8, 0.5, 0.0), (100, 0.05, 0.01), (37, 0.0, 0.1)])
def test_the_defaults_keep_the_warmup_cosine_float_for_float(total, fraction, ratio):
    cfg = OptimSection(warmup_fraction=fraction, min_lr_ratio=ratio)
    factor = lr_factor(cfg, total, warmup_length(cfg, per_epoch=7, total=total), peak_lr=1e-3)
    before = warmup_cosine(total, fraction, ratio)
    assert [factor(s) for s in range(total + 3)] == [before(s) for s in range(total + 3)]


def test_warmup_length_takes_steps_then_epochs_then_the_fraction():
    assert warmup_length(OptimSection(warmup_fraction=0.1), per_epoch=10, total=200) == 20
    assert warmup_length(OptimSection(warmup_epochs=1.5), per_epoch=10, total=200) == 15
    assert warmup_length(OptimSection(warmup_epochs=1.5, warmup_steps=4), per_epoch=10, total=200) == 4
    assert warmup_length(OptimSection(warmup_steps=0), per_epoch=10, total=200) == 0


@pytest.mark.parametrize(("start", "final", "warmup"), [(2e-4, 1e-6, 5), (0.0, 1e-5, 4), (2e-4, 1e-4, 0)])
def test_warmup_from_start_lr_then_cosine_to_final_lr_is_timms_cosine_scheduler(start, final, warmup):
    """I-JEPA / StoP's start_lr 2e-4 -> lr 8e-4 -> final_lr; timm's ``warmup_lr_init`` / ``lr_min`` with the warm-up
    before the cosine (``warmup_prefix``), stepped per update; every layer-decay group at its ``lr_scale``."""
    total, peak, scales = 30, 8e-4, [1.0, 0.75, 0.5625]
    cfg = OptimSection(lr=peak, start_lr=start, final_lr=final)
    ours = groups_optimizer(scales, peak)
    schedule = StepSchedule(ours, lr_factor(cfg, total, warmup, peak))
    theirs = torch.optim.SGD([{"params": [nn.Parameter(torch.zeros(1))], "lr": peak, "lr_scale": s} for s in scales])
    timm = CosineLRScheduler(theirs, t_initial=total - warmup, lr_min=final, warmup_t=warmup,
                             warmup_lr_init=start, warmup_prefix=True, t_in_epochs=False)
    for step in range(total):
        timm.step_update(step)
        schedule.set(step)
        expected = [g["lr"] for g in theirs.param_groups]
        assert [g["lr"] for g in ours.param_groups] == pytest.approx(expected, rel=1e-12, abs=1e-18), step
    schedule.set(0)  # the first step: start_lr (timm's warmup_lr_init), or the peak without a warm-up
    assert [g["lr"] for g in ours.param_groups] == pytest.approx([(start if warmup else peak) * s for s in scales],
                                                                 rel=1e-12)
    schedule.set(total + 5)  # beyond the budget: held at final_lr
    assert [g["lr"] for g in ours.param_groups] == pytest.approx([final * s for s in scales], rel=1e-12)


def test_constant_warmup_then_step_decay_is_mp3_speech_and_torchs_step_lr():
    """MP3 §4.3 ("Position Prediction as an Effective Pretraining Strategy", arXiv 2207.07611): 500 steps at 1e-4,
    then 1e-3 halved every 10K steps; after the warm-up, torch's StepLR on the same peak."""
    cfg = OptimSection(lr=1e-3, start_lr=1e-4, warmup_mode="constant", warmup_steps=500, schedule="step",
                       step_every=10_000, step_gamma=0.5)
    factor = lr_factor(cfg, total=40_000, warmup=500, peak_lr=1e-3)
    assert [1e-3 * factor(s) for s in (0, 499)] == pytest.approx([1e-4, 1e-4], rel=1e-12)
    assert [1e-3 * factor(s) for s in (500, 10_499, 10_500, 20_500, 39_999)] == pytest.approx(
        [1e-3, 1e-3, 5e-4, 2.5e-4, 1.25e-4], rel=1e-12)
    small = replace(cfg, warmup_steps=5, step_every=7, step_gamma=0.3)
    warmup, total = 5, 40
    ours = groups_optimizer([1.0, 0.5], 1e-3)
    schedule = StepSchedule(ours, lr_factor(small, total, warmup, 1e-3))
    theirs = groups_optimizer([1.0, 0.5], 1e-3)
    step_lr = torch.optim.lr_scheduler.StepLR(theirs, step_size=7, gamma=0.3)
    for step in range(total):
        schedule.set(step)
        if step < warmup:
            assert [g["lr"] for g in ours.param_groups] == pytest.approx([1e-4, 0.5e-4], rel=1e-12)
            continue
        assert [g["lr"] for g in ours.param_groups] == pytest.approx([g["lr"] for g in theirs.param_groups],
                                                                     rel=1e-12), step
        theirs.step()
        step_lr.step()


def test_the_constant_schedule_holds_the_peak_after_the_warmup():
    factor = lr_factor(OptimSection(schedule="constant"), total=20, warmup=4, peak_lr=1e-3)
    assert [factor(s) for s in range(20)] == [0.25, 0.5, 0.75, 1.0] + [1.0] * 16


# ---------------------------------------------------------------------------------------------- weight decay
def ijepa_wd(step: int, total: int, ref: float, final: float) -> float:
    """I-JEPA's CosineWDSchedule.step() (src/utils/schedulers.py), its counter ``_step`` = optimizer steps done
    including this one: ``final + (ref - final) * 0.5 * (1 + cos(pi * _step / T))``, clamped at final."""
    t = step + 1
    wd = final + (ref - final) * 0.5 * (1.0 + math.cos(math.pi * t / total))
    return max(final, wd) if final <= ref else min(final, wd)


def test_the_weight_decay_cosine_is_ijepas_on_the_decaying_groups_only():
    total = 25
    optimizer = build_optimizer(Toy(), lr=1e-3, weight_decay=0.04)
    decays = [g["weight_decay"] > 0 for g in optimizer.param_groups]
    assert any(decays) and not all(decays), "timm's groups: decayed weights, and norms / biases without decay"
    schedule = StepSchedule(optimizer, lambda step: 1.0, cosine_weight_decay(total, 0.04, 0.4))
    for step in range(total + 2):
        schedule.set(step)
        for group, decayed in zip(optimizer.param_groups, decays, strict=True):
            expected = ijepa_wd(min(step, total - 1), total, 0.04, 0.4) if decayed else 0.0
            assert group["weight_decay"] == pytest.approx(expected, rel=1e-12, abs=0.0), (step, decayed)
    assert [g["weight_decay"] for g in optimizer.param_groups if g["weight_decay"]] == pytest.approx([0.4])


# ---------------------------------------------------------------------------------------------- optimizer
def test_adam_is_torchs_adam_on_adamws_groups():
    model = Toy()
    adamw = make_optimizer(model, OptimSection(weight_decay=0.0))
    adam = make_optimizer(model, OptimSection(optimizer="adam", weight_decay=0.0, betas=(0.9, 0.98)))
    assert type(adam) is torch.optim.Adam and type(adamw) is torch.optim.AdamW
    assert [[id(p) for p in g["params"]] for g in adam.param_groups] == \
        [[id(p) for p in g["params"]] for g in adamw.param_groups]
    assert adam.defaults["betas"] == (0.9, 0.98) and all(g["weight_decay"] == 0 for g in adam.param_groups)


@pytest.mark.parametrize(("section", "fields", "message"), [
    (OptimSection, {"optimizer": "sgd"}, "optim.optimizer must be one of adamw, adam"),
    (OptimSection, {"optimizer": "adam"}, "optim.optimizer=adam takes no weight decay"),
    (OptimSection, {"weight_decay": 0.0, "weight_decay_end": 0.4}, "optim.weight_decay_end must be >= 0 with"),
    (OptimSection, {"weight_decay_end": -1.0}, "optim.weight_decay_end must be >= 0"),
    (OptimSection, {"schedule": "linear"}, "optim.schedule must be one of cosine, step, constant"),
    (OptimSection, {"schedule": "step"}, "optim.schedule=step needs optim.step_every >= 1"),
    (OptimSection, {"step_every": 10}, "optim.step_every is read by optim.schedule=step only"),
    (OptimSection, {"schedule": "step", "step_every": 10, "step_gamma": 0.0}, r"optim.step_gamma must be in \(0, 1\]"),
    (OptimSection, {"warmup_mode": "cosine"}, "optim.warmup_mode must be one of linear, constant"),
    (OptimSection, {"warmup_mode": "constant"}, "optim.warmup_mode=constant .* set optim.start_lr"),
    (OptimSection, {"warmup_steps": -1}, "optim.warmup_steps must be >= 0"),
    (OptimSection, {"warmup_epochs": -0.5}, "optim.warmup_epochs must be a number >= 0"),
    (OptimSection, {"start_lr": -1e-4}, "optim.start_lr must be an lr >= 0"),
    (OptimSection, {"final_lr": float("nan")}, "optim.final_lr must be an lr >= 0"),
    (OptimSection, {"schedule": "constant", "final_lr": 1e-6}, "optim.final_lr is where the cosine ends"),
    (RunSection, {"model_ema": 1.0}, r"run.model_ema must be a decay in \(0, 1\)"),
])
def test_each_recipe_field_is_refused_in_one_line_naming_it(section, fields, message):
    with pytest.raises(ConfigError, match=message) as caught:
        section(**fields).validate()
    assert "\n" not in str(caught.value)


def test_several_processes_print_the_batch_the_peak_lr_and_the_schedule(capsys):
    """One line at the start of a run on several processes (here a stand-in accelerator with 4 processes)."""
    acc = SimpleNamespace(num_processes=4, is_main_process=True, print=print)
    optim = OptimSection(lr=1e-3, lr_scaling="linear", warmup_epochs=2, start_lr=1e-5, final_lr=1e-6,
                         weight_decay_end=0.4)
    plan = BatchPlan(per_process=64, global_batch=256, lr_base_batch=64, peak_lr=4e-3)
    start_line(acc, optim, plan, 50, 1000)
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["4 processes x 64 samples per step (data.batch_size x run.grad_accum) = global batch 256; peak lr "
                   "0.004 (optim.lr 0.001, optim.lr_scaling=linear from global batch 64); warm-up 100 steps (linear "
                   "from 1e-05), then cosine to 1e-06, 1000 steps in all; weight decay cosine 0.05 -> 0.4"], out


def test_one_process_prints_the_same_line():
    """1 process: the same line, "1 process", the lr scaled from its base batch as under several."""
    printed = []
    acc = SimpleNamespace(num_processes=1, is_main_process=True, print=printed.append)
    optim = OptimSection(lr=1e-3, lr_scaling="sqrt", lr_base_batch=16, warmup_steps=5)
    plan = BatchPlan(per_process=64, global_batch=64, lr_base_batch=16, peak_lr=2e-3)
    start_line(acc, optim, plan, 50, 1000)
    assert printed == ["1 process x 64 samples per step (data.batch_size x run.grad_accum) = global batch 64; peak lr "
                       "0.002 (optim.lr 0.001, optim.lr_scaling=sqrt from global batch 16); warm-up 5 steps (linear), "
                       "then cosine to lr x 0.01, 1000 steps in all"], printed


# ---------------------------------------------------------------------------------------------- model EMA
def test_the_ema_after_k_steps_is_timms_model_ema_v3_over_the_same_weights():
    """WeightsEma over k optimizer steps = a fresh timm ModelEmaV3 fed the recorded weights of each step = the
    closed form ``d^k w0 + sum_i (1 - d) d^(k - i) w_i`` (parameters and float buffers; the int buffer copied)."""
    torch.manual_seed(0)
    model, decay, k = Toy(), 0.9, 6
    initial = {n: v.clone() for n, v in model.state_dict().items()}
    ema = WeightsEma(model, decay, model.backbone)
    assert ema.backbone_name == "backbone" and not any(p.requires_grad for p in ema.module.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    seen = []
    for _ in range(k):
        model.train()
        model(torch.randn(16, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update(model)
        seen.append({n: v.clone() for n, v in model.state_dict().items()})
    replay = Toy()
    replay.load_state_dict(initial)
    timm_ema = ModelEmaV3(replay, decay=decay)
    for state in seen:
        replay.load_state_dict(state)
        timm_ema.update(replay)
    ours = ema.module.state_dict()
    for name, value in timm_ema.module.state_dict().items():
        assert torch.equal(ours[name], value), name
        if value.is_floating_point():
            closed = decay ** k * initial[name] + sum((1 - decay) * decay ** (k - 1 - i) * s[name]
                                                      for i, s in enumerate(seen))
            torch.testing.assert_close(ours[name], closed, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(ours[name], seen[-1][name]), name
    assert ema.backbone is ema.module.backbone


# ---------------------------------------------------------------------------------------------- pipelines
def recorded_groups(monkeypatch) -> list[list[tuple[float, float]]]:
    """[(lr, weight_decay) of every group] as each StepSchedule.set left them, step by step."""
    seen: list[list[tuple[float, float]]] = []
    original = StepSchedule.set

    def set_and_record(self, step):
        factor = original(self, step)
        seen.append([(g["lr"], g["weight_decay"]) for g in self.optimizer.param_groups])
        return factor

    monkeypatch.setattr(StepSchedule, "set", set_and_record)
    return seen


def test_pretraining_applies_the_warmup_end_lr_and_the_final_weight_decay(shards, tmp_path, monkeypatch, capsys):
    """start_lr 1e-4 over 3 warm-up steps to lr 1e-3 then cosine to final_lr 1e-5; weight decay 0.04 -> 0.4: what
    the param groups held at each step, what log.jsonl says (lr, wd) and the optimizer state saved at the end; the
    start line, once on this 1 process."""
    seen = recorded_groups(monkeypatch)
    out, total = tmp_path / "sup", 8
    assert pretrain.main(["method=supervised", *img(shards), *TINY, f"optim.max_steps={total}", "optim.lr=1e-3",
                          "optim.warmup_steps=3", "optim.start_lr=1e-4", "optim.final_lr=1e-5",
                          "optim.weight_decay=0.04", "optim.weight_decay_end=0.4", f"run.output={out}"]) == 0
    started = [line for line in capsys.readouterr().out.splitlines() if "samples per step" in line]
    assert started == ["1 process x 8 samples per step (data.batch_size x run.grad_accum) = global batch 8; peak lr "
                       "0.001 (optim.lr 0.001, optim.lr_scaling=none); warm-up 3 steps (linear from 0.0001), then "
                       "cosine to 1e-05, 8 steps in all; weight decay cosine 0.04 -> 0.4"], started
    assert len(seen) == total
    decays = [wd > 0 for _, wd in seen[0]]
    assert any(decays) and not all(decays)
    assert [lr for lr, _ in seen[0]] == pytest.approx([1e-4] * len(decays)), "the first warm-up step: start_lr"
    assert [lr for lr, _ in seen[2]] == pytest.approx([1e-4 + 2 / 3 * 9e-4] * len(decays))
    assert [lr for lr, _ in seen[3]] == pytest.approx([1e-3] * len(decays)), "the warm-up's end: the peak"
    assert [wd for (_, wd), d in zip(seen[-1], decays, strict=True) if d] == pytest.approx([0.4] * sum(decays))
    assert [wd for (_, wd), d in zip(seen[-1], decays, strict=True) if not d] == [0.0] * (len(decays) - sum(decays))
    log = run_log(out)
    assert [r["lr"] for r in log] == pytest.approx([max(lr for lr, _ in groups) for groups in seen], rel=1e-12)
    assert [r["wd"] for r in log] == pytest.approx([max(wd for _, wd in groups) for groups in seen], rel=1e-12)
    assert log[-1]["wd"] == pytest.approx(0.4)
    saved = torch.load(state_dir(out) / "optimizer.bin", weights_only=False)["param_groups"]
    assert sorted({g["weight_decay"] for g in saved}) == pytest.approx([0.0, 0.4])


def test_finetuning_reads_the_same_knobs(shards, tmp_path, monkeypatch):
    """finetune.py (from scratch, layer decay 0.75): a constant warm-up at start_lr then a step decay, Adam; every
    group at its lr_scale of the same schedule; the model EMA saved and evaluated (top-1) beside the weights."""
    seen = recorded_groups(monkeypatch)
    out = tmp_path / "ft"
    assert finetune.main(["--config", FT_CONFIG, *img(shards), *TINY, "optim.max_steps=6", "optim.lr=1e-3",
                          "optim.optimizer=adam", "optim.weight_decay=0", "optim.warmup_steps=2",
                          "optim.warmup_mode=constant", "optim.start_lr=1e-4", "optim.schedule=step",
                          "optim.step_every=2", "run.model_ema=0.5", f"run.output={out}"]) == 0
    scales = [lr / 1e-4 for lr, _ in seen[0]]
    assert len(set(scales)) > 2, "layer decay: groups at distinct scales"
    for step, factor in enumerate([0.1, 0.1, 1.0, 1.0, 0.5, 0.5]):
        assert [lr for lr, _ in seen[step]] == pytest.approx([1e-3 * factor * s for s in scales], rel=1e-12), step
    records = run_log(out, everything=True)
    ema_eval = [r["eval_ema"] for r in records if "eval_ema" in r]
    assert len(ema_eval) == 1 and 0 <= ema_eval[0]["top1"] <= 1
    _, metadata = load_pretrained(out / "ema")
    assert metadata["model_ema"] == 0.5 and metadata["metrics"]["top1"] == ema_eval[0]["top1"]
    assert metadata["step"] == 6 and metadata["method"].startswith("finetune:")


def test_the_model_ema_resumes_exactly_and_is_saved_beside_the_checkpoint(shards, tmp_path):
    """run.model_ema through pretrain.py: a run stopped by SIGTERM at step 3 of 6 and resumed ends with the EMA
    (state/model_ema.safetensors and output/ema/) of the straight run, tensor for tensor; the EMA differs from the
    trained weights and is evaluated at the end (log.jsonl's eval_ema)."""
    args = ["method=supervised", *img(shards), *TINY, "optim.max_steps=6", "run.model_ema=0.7"]
    assert pretrain.main([*args, f"run.output={tmp_path / 'straight'}"]) == 0
    with sigterm_at(3):
        assert pretrain.main([*args, f"run.output={tmp_path / 'cut'}"]) == 143
    cut_state = load_file(str(state_dir(tmp_path / "cut") / "model_ema.safetensors"))
    assert cut_state, "the EMA is in the checkpoint's state"
    assert pretrain.main([*args, f"run.output={tmp_path / 'cut'}", "run.resume=true"]) == 0
    straight, resumed = (load_file(str(state_dir(tmp_path / name) / "model_ema.safetensors"))
                         for name in ("straight", "cut"))
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert not all(torch.equal(cut_state[k], straight[k]) for k in straight), "the EMA moved after the resume"
    a, b = (load_file(str(tmp_path / name / "ema" / "model.safetensors")) for name in ("straight", "cut"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    trained = load_file(str(tmp_path / "straight" / "checkpoint" / "model.safetensors"))
    assert trained.keys() == a.keys() and not all(torch.equal(trained[k], a[k]) for k in a)
    ema_evals = [r for r in run_log(tmp_path / "straight", everything=True) if "eval_ema" in r]
    assert len(ema_evals) == 1 and ema_evals[0]["step"] == 6 and "loss" in ema_evals[0]["eval_ema"]
    card = json.loads((tmp_path / "straight" / "ema" / "config.json").read_text())["metadata"]
    assert card["model_ema"] == 0.7 and card["metrics"] == {k: v for k, v in ema_evals[0]["eval_ema"].items()
                                                            if isinstance(v, int | float | str)}
