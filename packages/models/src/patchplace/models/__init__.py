"""patchplace.models — ViT and audio Transformer backbones with every position mode the methods need.

PE modes ``none``, ``learned``, ``sincos2d``, ``sincos1d``, ``relbias2d``; attention with per-sample masks and
context-only keys/values (MP3); safetensors checkpoints; timm interop. See :mod:`patchplace.models.backbone` for
the protocol objectives build on. Modules import one way: errors, config, pos_embed, attention -> blocks,
timm_interop -> card -> hub -> backbone -> timm_backbone, registry (tests/test_import_graph.py).

The names below load on first use (PEP 562 ``__getattr__``, as scipy's subpackages): ``import patchplace.models``
imports no torch, so that ``python -m patchplace.models.convert --help`` answers in a fraction of a second.
"""

from __future__ import annotations

import importlib
from typing import Any

# {module of this package: the public names it defines}; each loads with its module on first use
_PUBLIC = {
    "attention": ("ATTENTION_KERNELS", "Attention", "attention_kernel", "gather_tokens", "get_attention_kernel",
                  "set_attention_kernel"),
    "backbone": ("AudioTransformer", "Backbone", "VisionTransformer", "build_backbone", "load_pretrained"),
    "config": ("POS_EMBED_MODES", "BackboneConfig"),
    "errors": ("ModelError",),
    "hub": ("read_config", "save_pretrained", "timm_data_config", "timm_transform", "update_metadata"),
    "pos_embed": ("RelativePositionBias2d", "sincos_1d", "sincos_2d"),
    "registry": ("PRESETS", "create_model", "list_models"),
    "timm_backbone": ("adopt_timm", "from_timm"),
    "timm_interop": ("is_timm_vit", "timm_kwargs", "to_timm_state_dict"),
}
_LAZY = {name: module for module, names in _PUBLIC.items() for name in names}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    """A public name (imported from its module on first use, then kept here) or a module of this package."""
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
