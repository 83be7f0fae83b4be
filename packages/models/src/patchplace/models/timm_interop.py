"""Weights to and from timm's ``VisionTransformer`` (``timm.create_model('vit_small_patch16_224', ...)`` names).

Parameter names already match timm's except the learned PE table (``pos_table`` here, ``pos_embed`` in timm).
Supported timm features: class token or not, ``global_pool`` ``token`` / ``avg``, with or without ``fc_norm``
(the final norm moved after pooling: ``BackboneConfig.fc_norm``, MAE's fine-tuning ``--global_pool``; timm's
``fc_norm=None`` means "on for ``avg``", so the kwargs always name it), learned or no PE, qkv bias. Register tokens,
LayerScale, q/k norm, ``no_embed_class`` and pre-norm are refused by name.
A ``sincos2d`` table exports as timm's (learned) ``pos_embed`` with identical values and comes back from
:func:`from_timm` as ``sincos2d`` while its values are still the fixed table. ``relbias2d`` (BEiT's per-layer
relative position bias, with a class token) maps onto timm's ``Beit`` (``use_rel_pos_bias=True``, no absolute PE,
no LayerScale); BEiT has no key bias, which is exact: a key bias adds ``q . b_k`` to every logit of a query, which
the softmax cancels (and its gradient is zero), so it is dropped. Checkpoint layouts (:func:`timm_layout`) say
which timm model a checkpoint directory loads into; :func:`timm_preprocessing` says which ``pretrained_cfg`` makes
timm's eval transform reproduce ours.

This module works on configs, state dicts and timm models only: it imports no backbone class, so that
:mod:`~patchplace.models.hub` (checkpoint files) can use it and :mod:`~patchplace.models.backbone` can use both.
The functions that build a backbone from a timm model (``from_timm``, ``adopt_timm``) live in ``timm_backbone.py``.
Imports go one way: errors, config, pos_embed -> timm_interop -> card -> hub -> backbone -> timm_backbone, registry.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .config import BackboneConfig
from .errors import ModelError
from .pos_embed import sincos_2d


def timm_kwargs(config: BackboneConfig) -> dict[str, Any]:
    """Keyword arguments that build the equivalent ``timm.models.vision_transformer.VisionTransformer``."""
    if config.modality != "image" or config.pos_embed == "relbias2d":
        raise ModelError(f"no timm VisionTransformer equivalent for {config.modality} / {config.pos_embed}")
    return dict(img_size=config.image_hw, patch_size=config.patch_size, in_chans=config.in_chans,
                num_classes=config.num_classes, global_pool="token" if config.global_pool == "cls" else "avg",
                embed_dim=config.embed_dim, depth=config.depth, num_heads=config.num_heads,
                mlp_ratio=config.mlp_ratio, qkv_bias=config.qkv_bias, class_token=config.class_token,
                fc_norm=config.fc_norm, pos_embed="none" if config.pos_embed == "none" else "learn")


def beit_kwargs(config: BackboneConfig) -> dict[str, Any]:
    """Keyword arguments of the equivalent ``timm.models.beit.Beit`` for a ``relbias2d`` image backbone."""
    if config.modality != "image" or config.pos_embed != "relbias2d" or not config.class_token:
        raise ModelError(f"no timm Beit equivalent for {config.modality} / {config.pos_embed} / class_token="
                         f"{config.class_token} (Beit: relbias2d with a class token)")
    return dict(img_size=config.image_hw, patch_size=config.patch_size, in_chans=config.in_chans,
                num_classes=config.num_classes, global_pool="token" if config.global_pool == "cls" else "avg",
                use_fc_norm=config.fc_norm, embed_dim=config.embed_dim, depth=config.depth, num_heads=config.num_heads,
                mlp_ratio=config.mlp_ratio, qkv_bias=config.qkv_bias, use_abs_pos_emb=False,
                use_rel_pos_bias=True, use_shared_rel_pos_bias=False,
                init_values=0.0)  # 0, not None: timm drops None kwargs and BEiT-base defaults to LayerScale 0.1


# What a checkpoint directory's model.safetensors holds: timm ViT keys, timm Beit keys, or ours (no timm model).
TIMM_ARCHITECTURES = {"timm_vit": "vit_base_patch16_224", "timm_beit": "beit_base_patch16_224"}


def timm_layout(config: BackboneConfig) -> str:
    """``timm_vit`` / ``timm_beit`` when timm can build this backbone, else ``patchplace``."""
    for layout, kwargs in (("timm_vit", timm_kwargs), ("timm_beit", beit_kwargs)):
        try:
            kwargs(config)
            return layout
        except ModelError:
            pass
    return "patchplace"


def timm_model_args(config: BackboneConfig) -> dict[str, Any]:
    """``create_model`` keyword arguments of the layout (they override every size of the registered name)."""
    kwargs = timm_kwargs(config) if timm_layout(config) == "timm_vit" else beit_kwargs(config)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()}


def eval_preprocessing(config: BackboneConfig, metadata: dict[str, Any]) -> dict[str, Any]:
    """What patchplace's eval transform (``patchplace.data.ImageTransform``, ``train=False``) does for a checkpoint:
    uint8 images of ``native`` size -> zero-pad (centered) to ``pad_to`` -> bicubic resize of the short side to
    ``size`` + center crop (a no-op when the padded side is ``size``) -> /255 -> normalize with ``mean`` / ``std``.
    ``native`` is ``metadata["native_size"]`` (None where the checkpoint does not record it), ``normalized`` says
    whether the statistics are recorded (else 0.5 / 0.5 stand in); ``crop_pct``: an unpadded checkpoint's recorded
    eval crop (ImageNet's 0.875: resize the short side to ``size / crop_pct``, centre-crop), else 1."""
    if config.modality != "image":
        raise ModelError(f"an {config.modality} backbone: its inputs come from patchplace.data's front end (MFCC "
                         "frames), not an image transform")
    norm = metadata.get("normalization") or {}
    native = metadata.get("native_size")
    channels = config.in_chans
    pad_to = int(metadata["pad_to"]) if metadata.get("pad_to") else None
    return {"channels": channels, "native": tuple(int(v) for v in native) if native else None,
            "pad_to": pad_to, "size": tuple(config.image_hw),
            "crop_pct": 1.0 if pad_to else float(metadata.get("crop_pct") or 1.0),
            "mean": [float(v) for v in norm.get("mean", [0.5] * channels)],
            "std": [float(v) for v in norm.get("std", [0.5] * channels)], "normalized": bool(norm)}


def describe_preprocessing(config: BackboneConfig, metadata: dict[str, Any]) -> str:
    """One line for the model card and ``pretrained_cfg.notes``: the eval preprocessing, step by step."""
    p = eval_preprocessing(config, metadata)
    h, w = p["size"]
    native = "x".join(map(str, p["native"])) + " px images" if p["native"] else "images"
    steps = [f"zero-pad {native} to {p['pad_to']}x{p['pad_to']} (centered)" if p["pad_to"] else None,
             f"bicubic resize of the short side to {math.floor(h / p['crop_pct'])} + center crop to {h}x{w}"
             if p["crop_pct"] != 1 else
             f"bicubic resize + center crop to {h}x{w}" if (p["pad_to"] and (p["pad_to"], p["pad_to"]) != (h, w))
             or (not p["pad_to"] and p["native"] not in (None, (h, w))) else None,
             "scale to [0, 1]", f"normalize mean {p['mean']} std {p['std']}"
             + ("" if p["normalized"] else " (not recorded in the checkpoint: assumed)")]
    return ", ".join(step for step in steps if step)


def timm_preprocessing(config: BackboneConfig, metadata: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """(the data fields of timm's ``pretrained_cfg``, why timm's eval transform cannot reproduce ours or None).

    timm's eval transform (``create_transform(**resolve_data_config({}, model=model))``, ``crop_mode="center"``)
    resizes the short side to ``floor(input / crop_pct)`` and center-crops to ``input``, and torchvision's center
    crop **zero-pads** an image smaller than the crop. So ``crop_pct = input / native`` (> 1) makes the resize a
    no-op on native-size images and the crop our centered zero padding: the same tensor, exactly (pixel 0 padded
    before /255 and normalize, as ours). What it cannot express: padding followed by a resize (``img_size`` other
    than ``pad_to``), padding to a non-square input, padding of images whose size the checkpoint does not record
    (``native_size``), and statistics the checkpoint does not record."""
    p = eval_preprocessing(config, metadata)
    h, w = p["size"]
    fields: dict[str, Any] = {"input_size": [p["channels"], h, w], "interpolation": "bicubic", "crop_pct": 1.0,
                              "crop_mode": "center", "mean": p["mean"], "std": p["std"]}
    pad, native = p["pad_to"], p["native"]
    if not p["normalized"]:
        return fields, "the checkpoint records no normalization statistics (mean / std 0.5 assumed)"
    if not pad or (native is not None and native == (h, w)):
        fields["crop_pct"] = p["crop_pct"]  # unpadded: timm resizes to floor(input / crop_pct) and crops, as ours
        return fields, None
    if h != w or pad != h:
        return fields, (f"it zero-pads to {pad}x{pad} and then resizes to {h}x{w}; timm's transform resizes first "
                        "and pads after")
    if native is None:
        return fields, (f"it zero-pads to {pad}x{pad} images whose size the checkpoint does not record "
                        "(metadata.native_size, written since)")
    if max(native) > pad:
        return fields, f"its {native[0]}x{native[1]} images are larger than pad_to={pad}"
    short = min(native)
    crop_pct = h / short
    if math.floor(h / crop_pct) != short:  # timm's own arithmetic: floor(input / crop_pct) must be the short side
        crop_pct = h / (short + 0.5)
    fields["crop_pct"] = crop_pct
    return fields, None


def to_timm_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """State dict of a patchplace backbone loadable (strictly) by ``VisionTransformer(**timm_kwargs(model.config))``
    or, for ``relbias2d``, ``Beit(**beit_kwargs(model.config))``. The MJP unknown PE is not a timm parameter: see
    :func:`split_extras`."""
    layout = timm_layout(model.config)
    if layout == "patchplace":
        timm_kwargs(model.config)  # the refusal, by name
    state = {k: v.detach().clone() for k, v in model.state_dict().items()
             if k not in ("pos_table", "unknown_pos_embed")}
    if layout == "timm_beit":
        return _to_beit(state, model.config.embed_dim)
    if model.pos_table is not None:
        state["pos_embed"] = model.pos_table.detach().clone()
    return state


def _to_beit(state: dict[str, torch.Tensor], dim: int) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        if key.endswith("attn.qkv.bias"):  # q and v biases; the key bias is dropped (exact, see the module doc)
            out[key.replace("qkv.bias", "q_bias")] = value[:dim]
            out[key.replace("qkv.bias", "v_bias")] = value[2 * dim:]
        elif key.endswith("rel_pos_bias.relative_position_bias_table"):
            out[key.replace("rel_pos_bias.", "attn.")] = value
        elif not key.endswith("relative_position_index"):
            out[key] = value
    return out


def from_timm_state_dict(state: dict[str, torch.Tensor], config: BackboneConfig) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_timm_state_dict` (our parameter names; fixed tables and buffers left out)."""
    out = {}
    for key, value in state.items():
        if key == "pos_embed":
            if config.pos_embed == "learned":
                out["pos_table"] = value
        elif key.endswith("attn.q_bias"):
            v = state[key.replace("q_bias", "v_bias")]
            out[key.replace("q_bias", "qkv.bias")] = torch.cat([value, torch.zeros_like(value), v])
        elif key.endswith("attn.relative_position_bias_table"):
            out[key.replace("attn.", "rel_pos_bias.")] = value
        elif not key.endswith(("attn.v_bias", "relative_position_index")):
            out[key] = value
    return out


def split_extras(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(timm-loadable part, patchplace-only parameters): the MJP unknown PE is used only under the jigsaw."""
    extras = {k: v for k, v in state.items() if k == "unknown_pos_embed"}
    return {k: v for k, v in state.items() if k not in extras}, extras


def _refuse(timm_model: nn.Module) -> None:
    checks = {
        "register tokens": getattr(timm_model, "reg_token", None) is not None,
        "no_embed_class": getattr(timm_model, "no_embed_class", False),
        "dynamic_img_size": getattr(timm_model, "dynamic_img_size", False),
        "norm_pre": not isinstance(getattr(timm_model, "norm_pre", nn.Identity()), nn.Identity),
        "attention pooling": timm_model.global_pool not in ("token", "avg"),
    }
    block = timm_model.blocks[0]
    checks["LayerScale"] = not isinstance(block.ls1, nn.Identity)
    checks["q/k norm"] = not isinstance(block.attn.q_norm, nn.Identity)
    bad = [name for name, hit in checks.items() if hit]
    if bad:
        raise ModelError(f"this timm VisionTransformer uses {', '.join(bad)}, which patchplace backbones do not")


def timm_config(timm_model: nn.Module) -> BackboneConfig:
    """The :class:`BackboneConfig` of a timm ``VisionTransformer``; what the backbone cannot express is refused by
    name (``ModelError``). :func:`~patchplace.models.timm_backbone.from_timm` builds the backbone with its weights."""
    _refuse(timm_model)
    blocks = timm_model.blocks
    return BackboneConfig(
        modality="image", img_size=tuple(timm_model.patch_embed.img_size),
        patch_size=timm_model.patch_embed.patch_size[0], in_chans=timm_model.patch_embed.proj.in_channels,
        embed_dim=timm_model.embed_dim, depth=len(blocks), num_heads=blocks[0].attn.num_heads,
        mlp_ratio=blocks[0].mlp.fc1.out_features / timm_model.embed_dim,
        qkv_bias=blocks[0].attn.qkv.bias is not None,
        pos_embed=_pos_embed_mode(timm_model),
        class_token=timm_model.cls_token is not None,
        global_pool="cls" if timm_model.global_pool == "token" else "mean", fc_norm=_has_fc_norm(timm_model),
        num_classes=timm_model.num_classes, norm_eps=_final_norm(timm_model).eps)


def _has_fc_norm(timm_model: nn.Module) -> bool:
    """timm's ``fc_norm``: the final norm after pooling (``fc_norm`` a LayerNorm, ``norm`` an identity)."""
    return not isinstance(getattr(timm_model, "fc_norm", nn.Identity()), nn.Identity)


def _final_norm(timm_model: nn.Module) -> nn.Module:
    """The one LayerNorm after the blocks: ``fc_norm`` (after pooling) or ``norm`` (before); both or neither refused."""
    norms = [m for m in (timm_model.norm, getattr(timm_model, "fc_norm", nn.Identity()))
             if not isinstance(m, nn.Identity)]
    if len(norms) != 1:
        raise ModelError(f"this timm VisionTransformer has {len(norms)} final norms (norm and fc_norm); patchplace "
                         "backbones have exactly one, before or after pooling")
    return norms[0]


def _pos_embed_mode(timm_model: nn.Module) -> str:
    """``none``, or ``sincos2d`` when timm's table still holds the fixed 2-D sin-cos values (a patchplace
    ``sincos2d`` checkpoint loaded into timm), else ``learned``."""
    table = timm_model.pos_embed
    if table is None:
        return "none"
    grid, prefix = tuple(timm_model.patch_embed.grid_size), getattr(timm_model, "num_prefix_tokens", 0)
    return pos_embed_mode_of(table[0], grid, prefix)[0]


def pos_embed_mode_of(table: torch.Tensor, grid: tuple[int, int], prefix: int) -> tuple[str, float | None]:
    """(``sincos2d`` or ``learned``, the max difference to the fixed table) of an additive PE table ``(prefix + h * w,
    D)``: ``sincos2d`` when it holds MAE's fixed 2-D sin-cos values with zero class-token rows (``allclose``, atol
    1e-6) — the table of a pretraining that froze it (MAE, DropPos, I-JEPA / StoP) — else ``learned`` (a trained
    table: DeiT, MJP, a fine-tuned MAE). The difference is None where the shapes differ."""
    table = table.detach().float().cpu()
    if table.shape[-1] % 4:
        return "learned", None
    fixed = torch.cat([torch.zeros(prefix, table.shape[-1]), sincos_2d(grid, table.shape[-1])])
    if fixed.shape != table.shape:
        return "learned", None
    same = torch.allclose(table, fixed, atol=1e-6)  # the rtol too: values near 1 may differ in their last bits
    return ("sincos2d" if same else "learned"), float((table - fixed).abs().max())


def is_timm_vit(model: nn.Module) -> bool:
    """A timm ``VisionTransformer`` (not a patchplace backbone)."""
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    return isinstance(model, TimmViT)
