"""Pretrain a backbone with one of the methods, on WebDataset shards, with Accelerate.

    accelerate launch pipelines/pretrain.py --config pipelines/configs/mp3_fashion_mnist.yaml [section.field=value ...]
    python pipelines/pretrain.py --config pipelines/configs/mp3_fashion_mnist.yaml optim.epochs=0.1

Methods: those registered in ``patchplace.objectives`` (``--help`` lists them; each objective's file declares its
own). MJP is a supervised training recipe (jigsaw + unknown PE + DAL, with labels); it runs here, from scratch, like
``supervised``. The backbone (``checkpoint/``) is what ``finetune.py`` and ``evaluate.py`` start from.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # `python -m patchplace.pipelines.pretrain`, before the imports below load torch:
    # cli answers --help from the torch-free config classes (as for pipelines/pretrain.py, byte for byte) and runs
    # anything else through this module imported by its name
    from patchplace.pipelines import cli

    sys.exit(cli.main("pretrain"))

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from patchplace.finetune import build_mixup
from patchplace.models import create_model, load_pretrained
from patchplace.objectives import get_method
from patchplace.pipelines.commands import PretrainConfig
from patchplace.pipelines.config import ConfigError
from patchplace.pipelines.engine import (
    USER_ERRORS,
    Data,
    NonFiniteOutput,
    Trainer,
    check_inputs,
    command_line,
    data_metadata,
    pair_mixing,
    report,
    say,
    start,
)
from patchplace.pipelines.engine.inputs import frame_count


def build_objective(cfg: PretrainConfig, num_classes: int, in_chans: int, modality: str, data: Data | None = None):
    """Backbone (preset + overrides, PE mode of the method) and the objective around it; with ``data``, the
    backbone is first checked against what the reader yields."""
    spec = get_method(cfg.method)
    if cfg.model.checkpoint:
        backbone, _ = load_pretrained(cfg.model.checkpoint)
        source = f"model.checkpoint={cfg.model.checkpoint}"
    else:
        overrides = {"pos_embed": spec.pos_embed, "num_classes": num_classes if spec.needs_head else 0,
                     **({"in_chans": in_chans} if modality == "image" else frame_count(data)),
                     **cfg.model.overrides}
        backbone = create_model(cfg.model.preset, **overrides)
        source = f"model.preset={cfg.model.preset}"
    if data is not None:
        check_inputs(backbone, data, source)
    return spec.build(backbone, cfg.objective), backbone


def build_mixup_transform(cfg: PretrainConfig, num_classes: int, modality: str,
                          objective: nn.Module) -> Callable | None:
    """timm Mixup / CutMix of the training batches (data.mixup, data.cutmix) for a method trained with labels — the
    DeiT recipe MJP trains with ("Masked Jigsaw Puzzle: A Versatile Position Embedding for Vision Transformers",
    arXiv 2205.12551) — with the objective's label smoothing folded into the soft targets; None when both are off.
    An odd batch passes unmixed (timm mixes pairs), the first one with a warning."""
    d = cfg.data
    if not (d.mixup or d.cutmix):
        return None
    if modality != "image":
        raise ConfigError(f"data.mixup={d.mixup} / data.cutmix={d.cutmix} mix images only; this data is {modality}: "
                          "set both to 0")
    smoothing = getattr(cfg.objective_config(), "label_smoothing", 0.0)  # cfg.objective itself once validated
    mixup = build_mixup(num_classes, mixup_alpha=d.mixup, cutmix_alpha=d.cutmix, prob=d.mixup_prob,
                        switch_prob=d.mixup_switch_prob, label_smoothing=smoothing)
    return pair_mixing(mixup, objective, "data.mixup/cutmix")


@torch.no_grad()
def validate_objective(objective: nn.Module, data: Data, batch_size: int, device: torch.device,
                       seed: int = 0) -> dict[str, Any]:
    """The objective's own metrics on ``data.val`` (eval mode): the sample-weighted mean of every scalar its forward
    returns — the loss, and e.g. MP3 / DropPos position accuracy, I-JEPA's context size; supervised and MJP's
    classification accuracy as ``top1``. Masks come from a generator seeded with ``seed`` (the same draws at every
    evaluation) and the global RNG is restored after, so evaluating changes nothing of the training run."""
    was_training = objective.training
    objective.eval()
    sums: dict[str, float] = {}
    count = 0
    takes_generator = "generator" in inspect.signature(objective.forward).parameters
    generator = torch.Generator().manual_seed(seed)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for x, y in data.val.batches(batch_size, epoch=0):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                if data.frontend is not None:
                    x = data.frontend(x)
                out = objective((x, y), **({"generator": generator} if takes_generator else {}))
                n = len(y)
                for key, value in out.items():
                    if torch.is_tensor(value) and value.numel() == 1:
                        sums[key] = sums.get(key, 0.0) + float(value) * n
                count += n
    finally:
        objective.train(was_training)
    if not count:
        return {"count": 0}
    result = {("top1" if key == "acc" else key): value / count for key, value in sums.items()}
    if not math.isfinite(result.get("loss", 0.0)):
        raise NonFiniteOutput("the objective's validation loss is not finite (NaN / inf) on data.val: its weights "
                              "hold NaN / inf; use an earlier checkpoint or a lower optim.lr")
    return {**result, "count": count}


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, accelerator, data = start(PretrainConfig, __doc__, argv)
        m = data.manifest
        objective, backbone = build_objective(cfg, m.num_classes, int(m.info.get("channels", 1)), m.modality, data)
        paper = get_method(cfg.method).paper  # the model card's reference (patchplace.models knows no method)
        metadata = {"method": cfg.method, "objective": cfg.objective_values(), **({"paper": paper} if paper else {}),
                    **({} if cfg.model.checkpoint else {"preset": cfg.model.preset}),  # what model.preset checks
                    **data_metadata(data, cfg.data)}

        def evaluate(model: nn.Module, step: int) -> dict[str, Any]:  # run.eval_every and the end of training
            result = validate_objective(model, data, cfg.data.batch_size, accelerator.device, cfg.run.seed)
            shown = ", ".join(f"{k} {v:.4f}" for k, v in result.items() if k != "count")
            say(f"step {step}: val {shown} ({result['count']} samples)")
            return result

        batch_transform = build_mixup_transform(cfg, m.num_classes, m.modality, objective)
        # the encoder the paper evaluates is the checkpoint's backbone (I-JEPA / StoP: the EMA target encoder,
        # with the context encoder trained beside it in checkpoint/context_encoder/)
        evaluated = objective.evaluated_encoder
        others = {} if evaluated is backbone else {"context_encoder": backbone}
        metadata["encoder"] = get_method(cfg.method).evaluated_encoder
        trainer = Trainer(accelerator, objective, evaluated, data, cfg.optim, cfg.run, metadata=metadata, config=cfg,
                          evaluate=evaluate if data.val is not None else None, batch_transform=batch_transform,
                          command=command_line(__file__, argv), others=others)
    except USER_ERRORS as exc:
        return report(exc)
    _, code = trainer.train(cfg.data.batch_size)
    if code:
        return code
    if accelerator.is_main_process:
        print(f"checkpoint: {cfg.run.output}/checkpoint")
    return 0
