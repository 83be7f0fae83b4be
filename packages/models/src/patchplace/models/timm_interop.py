"""Weights to and from timm's ``VisionTransformer`` (``timm.create_model('vit_small_patch16_224', ...)`` names).

Parameter names already match timm's except the learned PE table (``pos_table`` here, ``pos_embed`` in timm).
Supported timm features: class token or not, ``global_pool`` ``token`` / ``avg`` **with** ``fc_norm=False``
(timm's default for ``avg`` moves the final norm after pooling, which this backbone does not do), learned or no
PE, qkv bias. Register tokens, LayerScale, q/k norm, ``no_embed_class`` and pre-norm are refused by name.
A ``sincos2d`` table exports as timm's (learned) ``pos_embed`` with identical values; ``relbias2d`` has no timm
``VisionTransformer`` equivalent. :func:`adopt_timm` lets the objectives train a timm ViT in place.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .backbone import Backbone, VisionTransformer
from .config import BackboneConfig
from .errors import ModelError


def timm_kwargs(config: BackboneConfig) -> dict[str, Any]:
    """Keyword arguments that build the equivalent ``timm.models.vision_transformer.VisionTransformer``."""
    if config.modality != "image" or config.pos_embed == "relbias2d":
        raise ModelError(f"no timm VisionTransformer equivalent for {config.modality} / {config.pos_embed}")
    return dict(img_size=config.image_hw, patch_size=config.patch_size, in_chans=config.in_chans,
                num_classes=config.num_classes, global_pool="token" if config.global_pool == "cls" else "avg",
                embed_dim=config.embed_dim, depth=config.depth, num_heads=config.num_heads,
                mlp_ratio=config.mlp_ratio, qkv_bias=config.qkv_bias, class_token=config.class_token,
                fc_norm=False, pos_embed="none" if config.pos_embed == "none" else "learn")


def to_timm_state_dict(model: Backbone) -> dict[str, torch.Tensor]:
    """State dict loadable by ``VisionTransformer(**timm_kwargs(model.config))``."""
    timm_kwargs(model.config)  # refuses what timm cannot express
    state = {k: v for k, v in model.state_dict().items() if k != "pos_table"}
    if model.pos_table is not None:
        state["pos_embed"] = model.pos_table.detach().clone()
    return state


def _refuse(timm_model: nn.Module) -> None:
    checks = {
        "register tokens": getattr(timm_model, "reg_token", None) is not None,
        "no_embed_class": getattr(timm_model, "no_embed_class", False),
        "dynamic_img_size": getattr(timm_model, "dynamic_img_size", False),
        "norm_pre": not isinstance(getattr(timm_model, "norm_pre", nn.Identity()), nn.Identity),
        "fc_norm (create it with fc_norm=False)": not isinstance(getattr(timm_model, "fc_norm", nn.Identity()),
                                                                 nn.Identity),
        "attention pooling": timm_model.global_pool not in ("token", "avg"),
    }
    block = timm_model.blocks[0]
    checks["LayerScale"] = not isinstance(block.ls1, nn.Identity)
    checks["q/k norm"] = not isinstance(block.attn.q_norm, nn.Identity)
    bad = [name for name, hit in checks.items() if hit]
    if bad:
        raise ModelError(f"this timm VisionTransformer uses {', '.join(bad)}, which patchplace backbones do not")


def from_timm(timm_model: nn.Module, **overrides: Any) -> VisionTransformer:
    """A :class:`VisionTransformer` with the architecture and weights of a timm ``VisionTransformer``.

    >>> t = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=10)
    >>> model = from_timm(t)            # same outputs as t (tested at 1e-5)
    """
    _refuse(timm_model)
    blocks = timm_model.blocks
    config = BackboneConfig(
        modality="image", img_size=tuple(timm_model.patch_embed.img_size),
        patch_size=timm_model.patch_embed.patch_size[0], in_chans=timm_model.patch_embed.proj.in_channels,
        embed_dim=timm_model.embed_dim, depth=len(blocks), num_heads=blocks[0].attn.num_heads,
        mlp_ratio=blocks[0].mlp.fc1.out_features / timm_model.embed_dim,
        qkv_bias=blocks[0].attn.qkv.bias is not None,
        pos_embed="none" if timm_model.pos_embed is None else "learned",
        class_token=timm_model.cls_token is not None,
        global_pool="cls" if timm_model.global_pool == "token" else "mean",
        num_classes=timm_model.num_classes, norm_eps=timm_model.norm.eps)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = VisionTransformer(config)
    state = dict(timm_model.state_dict())
    if "pos_embed" in state:
        state["pos_table"] = state.pop("pos_embed")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ModelError(f"timm weights do not map onto the backbone: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    return model


def is_timm_vit(model: nn.Module) -> bool:
    """A timm ``VisionTransformer`` (not a patchplace backbone)."""
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    return isinstance(model, TimmViT)


def adopt_timm(timm_model: nn.Module, pos_embed: str | None = None) -> VisionTransformer:
    """A patchplace backbone that **shares** the parameters of a timm ``VisionTransformer``: an objective trains
    the timm model in place (its ``state_dict`` after training is the trained one). What the backbone cannot
    express is refused as in :func:`from_timm`.

    ``pos_embed``: the PE the objective needs. ``None`` keeps timm's learned table (shared). ``"sincos2d"``
    (MAE, DropPos, I-JEPA / StoP, RandSAC) writes the fixed 2-D sin-cos table into timm's ``pos_embed`` and freezes
    it — timm can hold it only as a (frozen) learned table, the backbone holds it as fixed. ``"none"`` (MP3) runs
    without PE: timm's ``pos_embed`` is left out of the forward and untouched (MP3 fine-tunes with a fresh PE).
    """
    from dataclasses import replace

    model = from_timm(timm_model)
    shared = dict(timm_model.named_parameters())
    for name, _ in list(model.named_parameters()):
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._parameters[attr] = shared["pos_embed" if name == "pos_table" else name]  # the same Parameter
    if pos_embed is not None and pos_embed != model.config.pos_embed:
        if pos_embed not in ("sincos2d", "none"):
            raise ModelError(f"adopt_timm: pos_embed must be None, 'sincos2d' or 'none', got {pos_embed!r}")
        model.config = replace(model.config, pos_embed=pos_embed).validate()
        model._build_pos_embed(pos_embed)
        if pos_embed == "sincos2d" and timm_model.pos_embed is not None:
            with torch.no_grad():
                timm_model.pos_embed.copy_(model.pos_table.to(timm_model.pos_embed.dtype))
            timm_model.pos_embed.requires_grad_(False)
    return model
