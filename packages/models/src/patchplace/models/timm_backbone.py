"""Backbones out of a timm ``VisionTransformer``: :func:`from_timm` (a copy of its weights) and :func:`adopt_timm`
(its parameters shared, so an objective trains the timm model in place); timm's names are
:mod:`.timm_interop`'s."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .backbone import VisionTransformer
from .errors import ModelError
from .timm_interop import from_timm_state_dict, timm_config


def from_timm(timm_model: nn.Module, **overrides: Any) -> VisionTransformer:
    """A :class:`VisionTransformer` with the architecture and weights of a timm ``VisionTransformer``.

    >>> t = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=10)
    >>> model = from_timm(t)            # same outputs as t (tested at 1e-5)
    """
    config = timm_config(timm_model)  # refuses what the backbone cannot express, by name
    for key, value in overrides.items():
        setattr(config, key, value)
    model = VisionTransformer(config)
    missing, unexpected = model.load_state_dict(from_timm_state_dict(timm_model.state_dict(), config), strict=False)
    if missing or unexpected:
        raise ModelError(f"timm weights do not map onto the backbone: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    return model


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
