"""Turning a pretrained backbone into a classifier: head, PE mode, drop path, optimizer groups, mixup."""

from __future__ import annotations

from dataclasses import replace

import torch
from timm.data import Mixup
from timm.layers import DropPath
from timm.optim import create_optimizer_v2
from torch import nn

from patchplace.models import Backbone, sincos_2d

# Where a learned PE table starts in fine-tuning: random (trunc-normal .02 when the PE mode changes, else the
# checkpoint's table kept) | sincos2d (the fixed 2-D sin-cos values, MAE's main_finetune) | checkpoint (the
# checkpoint's own additive table, learned or fixed).
POS_EMBED_INITS = ("random", "sincos2d", "checkpoint")


def prepare_for_finetune(backbone: Backbone, num_classes: int, *, pos_embed: str | None = None,
                         global_pool: str | None = None, drop_path_rate: float | None = None,
                         fc_norm: bool | None = None, pos_embed_init: str = "random") -> Backbone:
    """Fresh head for ``num_classes``; optionally a new PE mode (e.g. MP3: ``none`` -> ``learned`` / ``relbias2d``,
    all other weights kept) started as ``pos_embed_init`` says (:data:`POS_EMBED_INITS`), the final norm moved after
    pooling (``fc_norm=True``: a fresh ``fc_norm``, the final norm dropped, as MAE's fine-tuning; ``None`` keeps the
    backbone's) and stochastic depth (linearly increasing over blocks, as timm)."""
    previous = backbone.pos_table.detach().clone() if backbone.pos_table is not None else None
    if pos_embed is not None and pos_embed != backbone.config.pos_embed:
        backbone.set_pos_embed(pos_embed)
    if pos_embed_init != "random":
        start_pos_embed(backbone, pos_embed_init, previous)
    if fc_norm is not None:
        backbone.set_fc_norm(fc_norm)
    backbone.reset_classifier(num_classes, global_pool)
    if drop_path_rate is not None:
        set_drop_path(backbone, drop_path_rate)
    return backbone


@torch.no_grad()
def start_pos_embed(backbone: Backbone, init: str, previous: torch.Tensor | None) -> None:
    """Write the starting values of a learned PE table (it stays trainable): ``sincos2d``, the fixed 2-D sin-cos
    table with a zero class-token row (MAE's fine-tuning loads its pretrained fixed table into a learned
    ``pos_embed``: "Masked Autoencoders Are Scalable Vision Learners", arXiv:2111.06377, main_finetune.py), or
    ``checkpoint``, ``previous`` (the checkpoint's additive table before the PE mode changed)."""
    if init not in POS_EMBED_INITS:
        raise ValueError(f"pos_embed_init must be one of {POS_EMBED_INITS}, got {init!r}")
    c = backbone.config
    if c.pos_embed != "learned":
        raise ValueError(f"pos_embed_init={init} starts a learned PE table; this backbone's PE is {c.pos_embed!r}: "
                         "fine-tune with pos_embed=learned")
    table = backbone.pos_table
    if init == "sincos2d":
        if c.modality != "image":
            raise ValueError(f"pos_embed_init=sincos2d needs an image backbone (a 2-D grid), got {c.modality}")
        prefix = torch.zeros(backbone.num_prefix_tokens, c.embed_dim)  # the class-token row 0, as MAE's table
        values = torch.cat([prefix, sincos_2d(backbone.grid, c.embed_dim)])
    elif previous is None:
        raise ValueError("pos_embed_init=checkpoint: the checkpoint has no additive PE table (its PE is none or "
                         "relbias2d); use pos_embed_init=random or sincos2d")
    else:
        values = previous
    if tuple(values.reshape(1, -1, c.embed_dim).shape) != tuple(table.shape):
        raise ValueError(f"pos_embed_init={init}: a {tuple(values.shape)} table does not fit the {tuple(table.shape)} "
                         "learned PE")
    table.copy_(values.reshape(table.shape).to(table.device, table.dtype))


def set_drop_path(backbone: Backbone, rate: float) -> None:
    """Stochastic depth with rates linspace(0, rate, depth) on both residual branches of every block."""
    backbone.config = replace(backbone.config, drop_path_rate=rate).validate()
    rates = torch.linspace(0, rate, len(backbone.blocks)).tolist()
    for block, r in zip(backbone.blocks, rates, strict=True):
        block.drop_path1 = DropPath(r) if r > 0 else nn.Identity()
        block.drop_path2 = DropPath(r) if r > 0 else nn.Identity()


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float = 0.05, layer_decay: float | None = None,
                    betas: tuple[float, float] = (0.9, 0.999), fused: bool = False,
                    opt: str = "adamw") -> torch.optim.Optimizer:
    """AdamW through timm's ``create_optimizer_v2`` on ``model``'s own parameter groups (its ``group_matcher`` /
    ``no_weight_decay``: a backbone, or an objective wrapping one) — the one optimizer factory of the project.
    ``opt``: timm's optimizer name, ``"adam"`` for ``torch.optim.Adam`` on the same groups (MP3's speech recipe).

    * No weight decay on 1-D tensors (norms, biases) and on what ``model.no_weight_decay()`` names (PE tables, CLS,
      unknown PE, mask tokens, relative bias tables).
    * ``layer_decay``: layer-wise lr decay (BEiT / MAE ``param_groups_lrd``): block i gets ``lr_scale`` =
      layer_decay^(depth - i), the embeddings layer_decay^(depth + 1), the final norm and heads 1. timm stores the
      scale in each group and only timm's schedulers apply it; here every group's ``lr`` is set to ``lr * lr_scale``
      up front, so any PyTorch scheduler (``LambdaLR`` scales each group's initial lr) keeps the ratios.

    * ``fused``: PyTorch's fused AdamW kernel (one launch updates every parameter; same update rule): what a
      small model's step on a GPU waits for otherwise is kernel launches.

    Raises ``ValueError`` when ``layer_decay`` is asked of a model without a ``group_matcher`` or when every
    parameter lands in one layer — the knob would silently do nothing.
    """
    if layer_decay is not None and layer_decay != 1.0 and not hasattr(model, "group_matcher"):
        raise ValueError(f"layer_decay={layer_decay} needs parameter groups: {type(model).__name__} has no "
                         "group_matcher() (wrap the backbone in a patchplace objective, or set layer_decay=null)")
    optimizer = create_optimizer_v2(model, opt, lr=lr, weight_decay=weight_decay, layer_decay=layer_decay,
                                    betas=betas, **({"fused": True} if fused else {}))
    scales = {group.get("lr_scale", 1.0) for group in optimizer.param_groups}
    if layer_decay is not None and layer_decay != 1.0 and len(scales) < 2:
        raise ValueError(f"layer_decay={layer_decay} has no effect on {type(model).__name__}: all parameters fell "
                         "into one layer")
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    return optimizer


def finetune_optimizer(model: nn.Module, *, lr: float, weight_decay: float = 0.05, layer_decay: float | None = 0.75,
                       betas: tuple[float, float] = (0.9, 0.999)) -> torch.optim.Optimizer:
    """:func:`build_optimizer` with the fine-tuning recipe's layer decay 0.75 (BEiT / MAE) by default."""
    return build_optimizer(model, lr=lr, weight_decay=weight_decay, layer_decay=layer_decay, betas=betas)


def parameter_groups(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, dict[str, float]]:
    """``{parameter name: {"lr_scale", "weight_decay", "shape"}}`` of an optimizer built on ``model`` (what each
    parameter really gets; written to a run's ``optimizer.json``). Parameters the optimizer does not hold are left
    out."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            out[names.get(id(p), f"<unnamed {tuple(p.shape)}>")] = {"lr_scale": float(group.get("lr_scale", 1.0)),
                                                                   "weight_decay": float(group["weight_decay"]),
                                                                   "shape": list(p.shape)}
    return out


def build_mixup(num_classes: int, *, mixup_alpha: float = 0.8, cutmix_alpha: float = 1.0, prob: float = 1.0,
                label_smoothing: float = 0.1, switch_prob: float = 0.5) -> Mixup | None:
    """timm's batch-level Mixup / CutMix (soft targets, smoothing included); None when both alphas are 0.
    ``switch_prob``: with both alphas > 0, the probability of CutMix rather than Mixup (timm's default 0.5)."""
    if mixup_alpha <= 0 and cutmix_alpha <= 0:
        return None
    return Mixup(mixup_alpha=mixup_alpha, cutmix_alpha=cutmix_alpha, prob=prob, switch_prob=switch_prob,
                 label_smoothing=label_smoothing, num_classes=num_classes)
