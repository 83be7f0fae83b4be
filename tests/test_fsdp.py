"""run.fsdp: refused on CPUs in one line before anything is written; where torch shards on CPUs (FSDP2's
``fully_shard`` over gloo), every registered method's objective, sharded by Accelerate's own ``fsdp2_prepare_model``
with the plugin and wrap units the knob builds (:func:`shard`), trains as one unsharded
process on the whole batch does (gradients, AdamW's update, I-JEPA / StoP's EMA target) and exports the same full
weights; on a GPU (``pytest -m gpu``) a run.fsdp=full_shard run resumed from its checkpoint ends where an
uninterrupted one does."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from accelerate.utils import DistributedType
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from pipeline_args import method_args
from safetensors.torch import load_file

from patchplace.models import create_model
from patchplace.models.backbone import set_grad_checkpointing
from patchplace.objectives import get_method, method_names
from patchplace.pipelines import pretrain
from patchplace.pipelines.engine.checkpoints import Saved
from patchplace.pipelines.engine.launch import block_classes, fsdp_plugin, gathered, shard_layers
from patchplace.research.benchmarks.fsdp_memory import free_port

ROOT = Path(__file__).resolve().parents[1]
WORLD, PER_RANK, STEPS = 2, 2, 2
TEST_FIELDS = {"mjp": {"ratio": 0.15, "apply_prob": 1.0, "warmup_fraction": 0.0}}


def shard(objective: torch.nn.Module, rank: int, mode: str = "full_shard") -> torch.nn.Module:
    """``objective`` sharded in place as ``accelerator.prepare`` shards it under ``run.fsdp=mode``: the knob's plugin
    (``fsdp_plugin``), its wrap units (``shard_layers``), Accelerate's ``fsdp2_prepare_model`` (on an Accelerator
    stand-in: Accelerate runs DDP on CPUs; a process group must be running)."""
    acc = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=fsdp_plugin(mode)), torch_device_mesh=None,
                          distributed_type=DistributedType.FSDP, parallelism_config=None, mixed_precision="no",
                          is_main_process=rank == 0, device=torch.device("cpu"))
    shard_layers(acc, objective)
    return fsdp2_prepare_model(acc, objective)


def tiny_objective(name: str) -> torch.nn.Module:
    """Method ``name`` on a seeded tiny backbone of its modality, with a 1-block 32-wide decoder / predictor."""
    spec = get_method(name)
    torch.manual_seed(0)
    if spec.modality == "audio":
        backbone = create_model("audio_mp3", pos_embed=spec.pos_embed, num_classes=0, depth=2)
    else:
        backbone = create_model("vit_micro", in_chans=1, img_size=32, pos_embed=spec.pos_embed,
                                num_classes=3 if spec.needs_head else 0)
    names = {f.name for f in fields(spec.config_cls)}
    small = {f"{part}_{what}": value for part in ("decoder", "predictor") if f"{part}_dim" in names
             for what, value in (("dim", 32), ("depth", 1), ("heads", 2))}
    small.update({"min_keep": 2} if "min_keep" in names else {})
    return spec.objective_cls(backbone, spec.config({**small, **TEST_FIELDS.get(name, {})})).train()


def batch(objective: torch.nn.Module, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch (WORLD x PER_RANK samples), the same on every rank."""
    c = objective.backbone.config
    shape = (c.num_frames, c.in_features) if c.modality == "audio" else (c.in_chans, c.img_size, c.img_size)
    g = torch.Generator().manual_seed(step)
    return torch.randn(WORLD * PER_RANK, *shape, generator=g), torch.randint(0, 3, (WORLD * PER_RANK,), generator=g)


def loss_of(objective: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s loss at ``step``: its part of the batch, its own random stream (masks, noise)."""
    torch.manual_seed(1000 * step + rank)
    part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return objective((x[part], y[part]), progress=0.5)["loss"]


def compare(name: str, rank: int, checkpointing: bool = False) -> dict[str, float]:
    """The largest differences between the sharded objective on this rank and the unsharded reference fed every
    rank's part in turn: gradients, weights after each AdamW step (and EMA update), the exported backbone."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    reference, sharded = tiny_objective(name), tiny_objective(name)
    set_grad_checkpointing(sharded, checkpointing)
    shard(sharded, rank)
    assert all(isinstance(p, DTensor) and p.device_mesh.size() == WORLD for p in sharded.parameters()), name
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.05)
                  for m in (reference, sharded)]
    worst = {"loss": 0.0, "grad": 0.0, "weight": 0.0, "export": 0.0}
    for step in range(STEPS):
        x, y = batch(reference, step)
        losses = [loss_of(reference, x, y, r, step) for r in range(WORLD)]
        sum(losses).div(WORLD).backward()  # FSDP's reduce-scatter averages the ranks' gradients
        loss = loss_of(sharded, x, y, rank, step)
        loss.backward()
        worst["loss"] = max(worst["loss"], abs(loss.item() - losses[rank].item()))
        for (key, p), q in zip(sharded.named_parameters(), reference.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), f"{name}: {key} has a gradient on one side only"
            if p.grad is not None:
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                worst["grad"] = max(worst["grad"], (grad - q.grad).abs().max().item())
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for m in (reference, sharded):
            if hasattr(m, "update_target"):  # I-JEPA / StoP's EMA target, on the sharded weights in place
                m.update_target((step + 1) / STEPS)
        full = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True))
        for key, value in reference.state_dict().items():
            worst["weight"] = max(worst["weight"], (full[key] - value).abs().max().item())
    backbone = sharded.target_encoder if hasattr(sharded, "target_encoder") else sharded.backbone
    exported = gathered(SimpleNamespace(distributed_type=DistributedType.FSDP, is_main_process=rank == 0), Saved(
        sharded, backbone, {}, None, WORLD * PER_RANK, {}, {"context_encoder": sharded.backbone}))
    if rank == 0:
        want = reference.target_encoder if hasattr(reference, "target_encoder") else reference.backbone
        pairs = [(exported.backbone.state_dict(), want.state_dict()),
                 (exported.others["context_encoder"].state_dict(), reference.backbone.state_dict()),
                 (exported.objective.state_dict(), reference.state_dict())]
        worst["export"] = max((got[k] - v).abs().max().item() for got, ref in pairs for k, v in ref.items())
    return worst


def worker(rank: int, port: int, out: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        results = {name: compare(name, rank) for name in names}
        results["mae, activation checkpointing"] = compare("mae", rank, checkpointing=True)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(results))


@pytest.mark.slow
def test_every_method_trains_sharded_on_two_cpu_processes_as_unsharded(tmp_path):
    out = tmp_path / "results.json"
    # forked: the workers start with this process's imports (torch, timm, the objectives) instead of their own
    mp.start_processes(worker, args=(free_port(), str(out), method_names()), nprocs=WORLD, join=True,
                       start_method="fork")
    results = json.loads(out.read_text())
    assert set(results) == {*method_names(), "mae, activation checkpointing"}
    for name, worst in results.items():
        assert worst["loss"] < 1e-5 and worst["grad"] < 1e-5, (name, worst)
        # AdamW divides by sqrt(v): a near-zero gradient's last bits move its update, by far less than lr (1e-3)
        assert worst["weight"] < 2e-4 and worst["export"] < 2e-4, (name, worst)


def test_the_wrap_units_are_every_block_class_of_the_objective():
    for name in method_names():
        classes = block_classes(tiny_objective(name))
        assert "Block" in classes, name
        assert ("DecoderBlock" in classes) == (name == "randsac"), (name, classes)


def test_fsdp_is_refused_on_a_cpu_before_any_file(shards, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    out = tmp_path / "runs" / "fsdp"
    assert pretrain.main([*method_args(shards, "mae"), "optim.max_steps=1", "run.fsdp=full_shard",
                          f"run.output={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run.fsdp=full_shard" in err[0] and "DDP" in err[0] and "run.fsdp=off" in err[0]
    assert not (tmp_path / "runs").exists()


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoint" / "model.safetensors"))


def launched(*runs: list[str]) -> subprocess.CompletedProcess:
    """``tests/fsdp_driver.py`` on 2 CPU processes: ``runs`` one after the other in one launch, each pretrain.py on
    Accelerate's FSDP2 path under run.fsdp, on DDP without it (``run.sigterm_at=N``: rank 0 signalled during step
    N); the driver prints ``run <i> exited <code>`` after each."""
    command = [str(Path(sys.executable).with_name("accelerate")), "launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
               str(ROOT / "tests" / "fsdp_driver.py")]
    args = [arg for run in runs for arg in ("--then", *run)][1:]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"})


def exit_codes(result: subprocess.CompletedProcess) -> list[int]:
    return [int(code) for code in re.findall(r"^run \d+ exited (-?\d+)$", result.stdout, re.MULTILINE)]


@pytest.mark.slow
def test_the_engine_on_accelerates_fsdp_path_trains_evaluates_saves_and_resumes(shards, tmp_path):
    """The whole run under Accelerate's FSDP2 path on 2 CPU processes (I-JEPA: the EMA target, the context encoder
    folder): the losses and final weights of the DDP run; the evaluation on every rank; the checkpoint's full state;
    a SIGTERM during step 2 stops the ranks after step 3, and the resumed run ends with the uninterrupted run's
    weights. Two launches: the FSDP, DDP and stopped runs in the first (a stop ends its launch), the resume in the
    second."""
    args = [*method_args(shards, "ijepa"), "optim.max_steps=4"]
    sharded, stopped, ddp = tmp_path / "fsdp", tmp_path / "stopped", tmp_path / "ddp"
    first = launched([*args, "run.fsdp=full_shard", f"run.output={sharded}"], [*args, f"run.output={ddp}"],
                     [*args, "run.fsdp=full_shard", "run.sigterm_at=2", f"run.output={stopped}"])
    # (several processes agree on a stop one step late: the step-3 checkpoint)
    assert exit_codes(first) == [0, 0, 143], (first.stdout[-3000:], first.stderr[-3000:])
    assert first.returncode != 0 and "interrupted by SIGTERM at step 3" in first.stderr, first.stderr[-3000:]
    assert not (ddp / "checkpoints" / "step-00000004" / "state" / "pytorch_model_fsdp.bin").exists(), \
        "the DDP run of the shared launch ran on DDP"
    state = sharded / "checkpoints" / "step-00000004" / "state"
    assert {p.name for p in state.iterdir()} >= {"pytorch_model_fsdp.bin", "optimizer.bin", "random_states_0.pkl",
                                                 "random_states_1.pkl", "trainer.json"}
    logged = [[r for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())] for out in (sharded, ddp)]
    assert [r["step"] for r in logged[0] if "loss" in r] == [1, 2, 3, 4]
    for a, b in zip(*logged, strict=True):
        for key in ("loss", "eval"):
            if key in a:
                got, want = (a[key]["loss"], b[key]["loss"]) if key == "eval" else (a[key], b[key])
                assert got == pytest.approx(want, rel=1e-4), (key, a, b)
    for name in ("model.safetensors", "context_encoder/model.safetensors", "objective.safetensors"):
        fsdp_w, ddp_w = (load_file(str(out / "checkpoint" / name)) for out in (sharded, ddp))
        assert fsdp_w.keys() == ddp_w.keys()
        for key in ddp_w:
            torch.testing.assert_close(fsdp_w[key], ddp_w[key], rtol=0, atol=1e-4, msg=f"{name}: {key}")
    resumed = launched([*args, "run.fsdp=full_shard", "run.resume=true", f"run.output={stopped}"])
    assert resumed.returncode == 0 and exit_codes(resumed) == [0], resumed.stderr[-3000:]
    a, b = final_weights(sharded), final_weights(stopped)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pytest -m gpu)")
@pytest.mark.parametrize("method", ["mae", "ijepa"])
def test_a_sharded_run_resumed_ends_where_an_uninterrupted_one_does(shards, tmp_path, method):
    """run.fsdp=full_shard on one GPU process: a SIGTERM during step 2 of 4 saves the step-2 checkpoint (the full
    model and AdamW state, the gathered backbone folder); the resumed run ends with the uninterrupted run's weights."""
    from fault_driver import sigterm_at

    args = [*method_args(shards, method), "run.fsdp=full_shard", "optim.max_steps=4"]
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    assert pretrain.main([*args, f"run.output={whole}"]) == 0
    with sigterm_at(2):
        assert pretrain.main([*args, f"run.output={stopped}"]) == 143
    saved = sorted((stopped / "checkpoints").glob("step-*"))
    assert [json.loads((d / "state" / "trainer.json").read_text())["step"] for d in saved] == [2]
    assert pretrain.main([*args, "run.resume=true", f"run.output={stopped}"]) == 0
    a, b = final_weights(whole), final_weights(stopped)
    assert a.keys() == b.keys() and a
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=key)


def test_what_fsdp_cannot_shard_is_refused_before_training(monkeypatch):
    """Where CUDA is seen: run.model_ema's unsharded copy, and fine-tuning (its evaluation runs the backbone outside
    the sharded objective's forward)."""
    from patchplace.pipelines.config import ConfigError
    from patchplace.pipelines.engine.launch import check_fsdp
    from patchplace.pipelines.sections import RunSection

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_fsdp(RunSection(fsdp="full_shard"))
    with pytest.raises(ConfigError, match=re.escape("run.model_ema=0.999 with run.fsdp=shard_grad_op")):
        check_fsdp(RunSection(fsdp="shard_grad_op", model_ema=0.999))
    with pytest.raises(ConfigError, match=re.escape("run.fsdp=full_shard in finetune.py")):
        check_fsdp(RunSection(fsdp="full_shard"), fine_tunes=True)
    check_fsdp(RunSection(), fine_tunes=True)
