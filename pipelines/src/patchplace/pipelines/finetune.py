"""Fine-tune a pretrained backbone (or train the supervised baseline from scratch) with the fine-tuning recipe:
fresh head, PE mode for fine-tuning, layer-wise lr decay, label smoothing, Mixup / CutMix, drop path.

    accelerate launch pipelines/finetune.py --config pipelines/configs/finetune_fashion_mnist.yaml \\
        model.checkpoint=runs/mp3/checkpoint finetune.pos_embed=learned
    python pipelines/finetune.py --config pipelines/configs/finetune_fashion_mnist.yaml   # supervised baseline

MP3 backbones are pretrained without PE: ``finetune.pos_embed`` adds one (learned / relbias2d / sincos2d / none),
keeping every other weight (MP3 Table 3); ``finetune.pos_embed_init=sincos2d`` starts a learned PE from the fixed
2-D sin-cos values (MAE's fine-tuning). ``finetune.global_pool`` (cls | mean | mean_fc_norm, MAE's ``--global_pool``:
the final norm moved after pooling) is the feature the head reads; left null it follows the checkpoint's method
(its recorded ``finetune_pool``: the class token for MP3 §3.3, MJP and supervised, average pooling for MAE, DropPos,
I-JEPA, StoP and RandSAC). Top-1 / top-5 on ``data.val`` are logged at every evaluation.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # `python -m patchplace.pipelines.finetune`, before the imports below load torch:
    # cli answers --help from the torch-free config classes (as for pipelines/finetune.py, byte for byte) and runs
    # anything else through this module imported by its name
    from patchplace.pipelines import cli

    sys.exit(cli.main("finetune"))

import json
from collections.abc import Callable
from pathlib import Path

from patchplace.finetune import build_mixup, prepare_for_finetune
from patchplace.models import Backbone, ModelError, create_model, load_pretrained
from patchplace.objectives import Supervised, SupervisedConfig
from patchplace.pipelines.commands import POOL_WORDS, POOLS, FinetuneConfig, FinetuneSection
from patchplace.pipelines.config import ConfigError
from patchplace.pipelines.engine import (
    USER_ERRORS,
    Data,
    Trainer,
    check_inputs,
    classify,
    command_line,
    data_metadata,
    pair_mixing,
    report,
    say,
    start,
)
from patchplace.pipelines.engine.inputs import frame_count


def weights_sha256(checkpoint: str | None) -> str | None:
    """What the fine-tuning started from, without a local path in the checkpoint: its weights' sha256."""
    if checkpoint is None:
        return None
    import hashlib

    return "sha256:" + hashlib.sha256((Path(checkpoint) / "model.safetensors").read_bytes()).hexdigest()


def checkpoint_path(checkpoint: str | None) -> str | None:
    """The path fine-tuning started from, for the model card's base model: relative to the working directory when
    it lies below it (save_pretrained keeps only the last component of an absolute path: checkpoints are shared)."""
    if checkpoint is None:
        return None
    path = Path(checkpoint).absolute()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else checkpoint


def build_backbone(cfg: FinetuneConfig, num_classes: int, in_chans: int, modality: str, data: Data | None = None):
    """The checkpoint (or a fresh ``model.preset``) prepared for fine-tuning; with ``data``, first checked against
    what the reader yields (before its PE / head are changed, so a mismatch names the real cause)."""
    if cfg.model.checkpoint:
        backbone, metadata = load_pretrained(cfg.model.checkpoint)
        source = f"model.checkpoint={cfg.model.checkpoint}"
    else:
        extra = {"in_chans": in_chans} if modality == "image" else frame_count(data)
        backbone, metadata = create_model(cfg.model.preset, **extra, **cfg.model.overrides), {"method": "scratch"}
        source = f"model.preset={cfg.model.preset}"
    if data is not None:
        if cfg.model.checkpoint:
            at_data_size(backbone, data, source)
        check_inputs(backbone, data, source)
    ft = cfg.finetune
    pool, why = finetune_pool(ft.global_pool, backbone, metadata, bool(cfg.model.checkpoint))
    print(f"finetune.global_pool: {pool} ({why})")
    try:
        backbone = prepare_for_finetune(backbone, num_classes, pos_embed=ft.pos_embed, global_pool=split_pool(pool)[0],
                                        drop_path_rate=ft.drop_path, fc_norm=split_pool(pool)[1],
                                        pos_embed_init=ft.pos_embed_init)
    except ValueError as exc:  # a PE start the checkpoint cannot give (e.g. checkpoint on an MP3 backbone: no table)
        raise ConfigError(f"finetune.pos_embed_init: {exc}") from None
    return backbone, metadata


def split_pool(pool: str) -> tuple[str, bool]:
    """``finetune.global_pool`` -> (the backbone's ``global_pool``, ``fc_norm``)."""
    return pool.removesuffix("_fc_norm"), pool.endswith("_fc_norm")


def pool_of(backbone: Backbone) -> str:
    """The :data:`POOLS` name of a backbone's own pooling (``mean_fc_norm`` for mean + fc_norm)."""
    c = backbone.config
    return "mean_fc_norm" if c.fc_norm and c.global_pool == "mean" else c.global_pool


def finetune_pool(chosen: str | None, backbone: Backbone, metadata: dict, from_checkpoint: bool) -> tuple[str, str]:
    """The feature the head reads and why: ``finetune.global_pool`` when set; else the checkpoint's recorded
    ``finetune_pool`` (its method's own fine-tuning protocol), the backbone's ``global_pool`` for checkpoints from
    before it was recorded, and the class token (DeiT) from scratch."""
    if chosen is not None:
        return chosen, "set by finetune.global_pool"
    if not from_checkpoint:
        return "cls", "training from scratch: the class token, as DeiT"
    method, pool = metadata.get("method", "?"), metadata.get("finetune_pool")
    if pool is None:
        pool = pool_of(backbone)
        return pool, f"the checkpoint records no finetune_pool: its backbone's global_pool ({method} checkpoint)"
    if pool not in POOLS:
        raise ConfigError(f"the checkpoint's finetune_pool must be one of {POOLS}, got {pool!r}: set "
                          "finetune.global_pool")
    if pool == backbone.config.global_pool:  # a fine-tuned fc_norm checkpoint records its head's pooling: keep fc_norm
        pool = pool_of(backbone)
    return pool, f"the checkpoint's finetune_pool: {method} fine-tunes on {POOL_WORDS[pool]}"


def at_data_size(backbone, data: Data, source: str) -> None:
    """Fine-tune a checkpoint at the data's image side when it differs from the one it was trained at (same patch
    size): the patch grid grows or shrinks and the PE is resampled (``Backbone.set_image_size``)."""
    side = getattr(data.train.transform, "size", None)
    if backbone.config.modality != "image" or side is None or (side, side) == backbone.config.image_hw:
        return
    try:
        old, new = backbone.set_image_size(side)
    except ModelError as exc:
        raise ConfigError(f"{source} cannot be fine-tuned at {side} px (data.img_size / data.pad_to): {exc}") from None
    print(f"model: {source} was trained on a {old[0]}x{old[1]} patch grid; fine-tuning at {side} px = "
          f"{new[0]}x{new[1]} patches, its {backbone.config.pos_embed} PE resampled to the new grid")


def build_recipe(cfg: FinetuneSection, backbone, num_classes: int, modality: str) -> tuple[Supervised, Callable]:
    """The training objective (cross-entropy with ``label_smoothing``, or soft targets after mixup) and the batch
    transform (timm Mixup / CutMix) of the fine-tuning recipe."""
    objective = Supervised(backbone, SupervisedConfig(label_smoothing=cfg.label_smoothing))
    return objective, build_batch_transform(cfg, num_classes, modality, objective)


def build_batch_transform(cfg: FinetuneSection, num_classes: int, modality: str, objective) -> Callable:
    """timm Mixup / CutMix on training batches (images only). An odd batch cannot be mixed (timm pairs samples):
    it passes unmixed, and the first one says so."""
    if modality != "image" and (cfg.mixup > 0 or cfg.cutmix > 0):
        raise ConfigError(f"finetune.mixup={cfg.mixup} / finetune.cutmix={cfg.cutmix} mix images only; this data is "
                          f"{modality}: set finetune.mixup=0 finetune.cutmix=0")
    mixup = build_mixup(num_classes, mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, prob=cfg.mixup_prob,
                        label_smoothing=cfg.label_smoothing) if modality == "image" else None
    return pair_mixing(mixup, objective, "finetune.mixup/cutmix")


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, accelerator, data = start(FinetuneConfig, __doc__, argv)
        m = data.manifest
        backbone, pretrained = build_backbone(cfg, m.num_classes, int(m.info.get("channels", 1)), m.modality, data)
        objective, batch_transform = build_recipe(cfg.finetune, backbone, m.num_classes, m.modality)

        def evaluate(model, step):  # model: the trained objective, or run.model_ema's average of it
            result = classify(model.backbone, data.val, cfg.data.batch_size, accelerator.device, data.frontend)
            say(f"step {step}: val top-1 {result['top1']:.4f} top-5 {result['top5']:.4f} ({result['count']} "
                "samples)")
            return {k: v for k, v in result.items() if k != "confusion"}

        preset = pretrained.get("preset") if cfg.model.checkpoint else cfg.model.preset  # the architecture's name
        metadata = {"method": f"finetune:{pretrained.get('method', '?')}", **({"preset": preset} if preset else {}),
                    "pretrained": weights_sha256(cfg.model.checkpoint), "pretrain_metadata": pretrained,
                    "pretrained_from": checkpoint_path(cfg.model.checkpoint), **data_metadata(data, cfg.data)}
        trainer = Trainer(accelerator, objective, backbone, data, cfg.optim, cfg.run, metadata=metadata, config=cfg,
                          batch_transform=batch_transform, evaluate=evaluate, command=command_line(__file__, argv))
    except USER_ERRORS as exc:
        return report(exc)
    final, code = trainer.train(cfg.data.batch_size)
    if code:
        return code
    if accelerator.is_main_process:
        # with early stopping, best/ is the folder to evaluate (the validation's best step), checkpoint/ the last step
        best = Path(cfg.run.output) / "best"
        print(json.dumps({"final": final, "checkpoint": f"{cfg.run.output}/checkpoint",
                          **({"best": str(best)} if best.is_dir() else {})}))
    return 0
