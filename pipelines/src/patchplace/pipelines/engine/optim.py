"""The optimizer and its lr schedule: AdamW on the objective's parameter groups, the warm-up + cosine factor set
before every optimizer step (:class:`StepSchedule`), ``run.compile``'s regional compilation,
``run.activation_checkpointing``, and the objective and
optimizer prepared for DDP (:func:`prepare_model`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from accelerate.utils import DistributedDataParallelKwargs
from timm.optim import create_optimizer_v2
from torch import nn

from patchplace.models.backbone import Block, CheckpointedBlock, set_grad_checkpointing
from patchplace.pipelines.config import ConfigError
from patchplace.pipelines.engine.schedules import lr_factor, warmup_length, weight_decay_schedule
from patchplace.pipelines.sections import OptimSection


def make_optimizer(model: nn.Module, cfg: OptimSection, lr: float | None = None,
                   device: torch.device | None = None) -> torch.optim.Optimizer:
    """``optim.optimizer`` (AdamW; ``adam``: MP3's speech recipe) through timm's ``create_optimizer_v2`` on the
    objective's own parameter groups (its ``group_matcher`` / ``no_weight_decay``): no weight decay on 1-D tensors
    (norms, biases) nor on PEs, class / mask / unknown tokens, relative bias tables; ``optim.layer_decay``: block i
    gets lr scale layer_decay^(depth - i) (BEiT / MAE ``param_groups_lrd``), written into each group's lr up front so
    the schedule's factor keeps the ratios. ``lr``: the peak lr (default ``cfg.lr``; the Trainer passes it scaled to
    the global batch). ``optim.fused`` null: the fused kernel when ``device`` (where the run trains) is a GPU. A
    layer decay without effect (no ``group_matcher``, or every parameter in one layer) is a :class:`ConfigError`."""
    fused = cfg.fused if cfg.fused is not None else (device is not None and device.type == "cuda")
    lr, decay = cfg.lr if lr is None else lr, cfg.layer_decay
    decays = decay is not None and decay != 1.0
    if decays and not hasattr(model, "group_matcher"):
        raise ConfigError(f"optim.layer_decay: layer_decay={decay} needs parameter groups: {type(model).__name__} has "
                          "no group_matcher() (wrap the backbone in a patchplace objective, or set layer_decay=null)")
    optimizer = create_optimizer_v2(model, cfg.optimizer, lr=lr, weight_decay=cfg.weight_decay, layer_decay=decay,
                                    betas=cfg.betas, **({"fused": True} if fused else {}))
    if decays and len({group.get("lr_scale", 1.0) for group in optimizer.param_groups}) < 2:
        raise ConfigError(f"optim.layer_decay: layer_decay={decay} has no effect on {type(model).__name__}: all "
                          "parameters fell into one layer")
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    return optimizer


def parameter_groups(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, dict[str, Any]]:
    """``{parameter name: {"lr_scale", "weight_decay", "shape"}}`` of an optimizer built on ``model`` (what each
    parameter really gets: a run's ``optimizer.json``). Parameters the optimizer does not hold are left out."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names.get(id(p), f"<unnamed {tuple(p.shape)}>"): {
        "lr_scale": float(group.get("lr_scale", 1.0)), "weight_decay": float(group["weight_decay"]),
        "shape": list(p.shape)} for group in optimizer.param_groups for p in group["params"]}


def compile_objective(model: nn.Module, mode: str, scope: str = "blocks",
                      say: Callable[[str], None] | None = None) -> int:
    """``run.compile`` / ``run.compile_scope``: ``blocks`` compiles every Transformer block of ``model`` in place
    (``nn.Module.compile``: regional compilation, the blocks of the backbone and of any decoder / predictor);
    ``step`` compiles the objective's whole forward, and through AOTAutograd its backward, as one graph
    (``fullgraph=True``: a graph break is an error, not a slow step); with ``reduce-overhead`` the step is replayed
    as a CUDA graph. Parameter names and checkpoints are unchanged either way. Returns how many modules were
    compiled (``say``: a line naming them)."""
    if mode == "no":
        return 0
    kwargs = {"backend": "aot_eager"} if mode == "aot_eager" else {"mode": mode}
    if scope == "step":
        model.compile(fullgraph=True, dynamic=False, **kwargs)  # static shapes: what a CUDA graph replays
        if say is not None:
            say(f"run.compile={mode}: the objective's step compiled as one graph (the first step compiles it)")
        return 1
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for block in blocks:
        block.compile(**kwargs)
    if blocks and say is not None:
        say(f"run.compile={mode}: {len(blocks)} Transformer blocks compiled (the first steps compile them)")
    return len(blocks)


def checkpoint_activations(model: nn.Module, enable: bool, say: Callable[[str], None] | None = None) -> int:
    """``run.activation_checkpointing``: every Transformer block of ``model`` (backbone, decoders, predictors)
    recomputes its activations in the backward (:func:`patchplace.models.backbone.set_grad_checkpointing`); returns
    how many of them train (``say``: a line naming them; a frozen block, e.g. I-JEPA's EMA target encoder's, runs
    without autograd and recomputes nothing)."""
    if not enable:
        return 0
    set_grad_checkpointing(model, True)
    blocks = [m for m in model.modules() if isinstance(m, CheckpointedBlock)]
    count = sum(any(p.requires_grad for p in block.parameters()) for block in blocks)
    if say is not None:
        say(f"run.activation_checkpointing: {count} Transformer blocks recompute their activations in the backward")
    return count


def warmup_cosine(total_steps: int, warmup_fraction: float, min_ratio: float) -> Callable[[int], float]:
    """The lr factor of optimizer step ``step`` (0-based): linear warm-up, then cosine down to ``min_ratio``."""
    warmup = round(warmup_fraction * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, total_steps - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))

    return factor


class StepSchedule:
    """The lr of every parameter group as a function of the optimizer step alone: ``base lr x factor(step)``, set
    before each optimizer step (as nanoGPT's ``get_lr(it)``). Nothing to checkpoint, and nothing a wrapper can step
    twice: Accelerate's scheduler wrapper steps a prepared scheduler once per *process* per optimizer step
    (``split_batches=False``), which would run the schedule P times too fast under P processes."""

    def __init__(self, optimizer: torch.optim.Optimizer, factor: Callable[[int], float],
                 weight_decay: Callable[[int], float] | None = None) -> None:
        self.optimizer, self.factor, self.weight_decay = optimizer, factor, weight_decay
        for group in optimizer.param_groups:  # peak lr x the group's layer-decay scale (torch's name for it)
            group.setdefault("initial_lr", group["lr"])
        self.base = [group["initial_lr"] for group in optimizer.param_groups]
        # optim.weight_decay_end: the groups built with a weight decay follow it; norms, biases, PEs, tokens stay 0
        self.decays = [group["weight_decay"] > 0 for group in optimizer.param_groups]

    @classmethod
    def of_run(cls, optimizer: torch.optim.Optimizer, cfg: OptimSection, per_epoch: int, total: int,
               peak_lr: float) -> StepSchedule:
        """The run's warm-up + lr schedule (and weight-decay schedule) over ``total`` steps (``schedules.py``)."""
        warmup = warmup_length(cfg, per_epoch, total)
        return cls(optimizer, lr_factor(cfg, total, warmup, peak_lr), weight_decay_schedule(cfg, total))

    def set(self, step: int) -> float:
        """Give every group its lr (and, with a weight-decay schedule, the decaying groups their weight decay) for
        optimizer step ``step`` (0-based); returns the lr factor."""
        factor = self.factor(step)
        for group, base in zip(self.optimizer.param_groups, self.base, strict=True):
            group["lr"] = base * factor
        if self.weight_decay is not None:  # (AdamW reads each group's weight_decay at every step)
            decay = self.weight_decay(step)
            for group, decays in zip(self.optimizer.param_groups, self.decays, strict=True):
                if decays:
                    group["weight_decay"] = decay
        return factor


def prepare_model(acc: Any, objective: nn.Module, optimizer: torch.optim.Optimizer,
                  find_unused: bool | None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``acc.prepare`` of the objective and its optimizer, DDP with ``find_unused_parameters`` per
    ``run.find_unused_parameters`` (null, auto: only objectives that may leave a parameter without gradient, MJP's
    ``leaves_parameters_unused``). The schedule is not prepared: Accelerate's wrapper would step it once per process
    (:class:`StepSchedule`)."""
    if find_unused is None:
        find_unused = bool(getattr(objective, "leaves_parameters_unused", False))
    acc.ddp_handler = DistributedDataParallelKwargs(find_unused_parameters=find_unused)
    from patchplace.pipelines.engine.launch import shard_layers  # run.fsdp: its wrap units, from the objective

    shard_layers(acc, objective)
    return acc.prepare(objective, optimizer)
