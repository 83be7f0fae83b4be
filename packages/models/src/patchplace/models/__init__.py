"""patchplace.models — ViT and audio Transformer backbones with every position mode the methods need.

PE modes ``none``, ``learned``, ``sincos2d``, ``sincos1d``, ``relbias2d``; attention with per-sample masks and
context-only keys/values (MP3); safetensors checkpoints; timm interop. See :mod:`patchplace.models.backbone` for
the protocol objectives build on. Modules import one way: errors, config, pos_embed, attention -> timm_interop ->
card -> hub -> backbone -> registry (tests/test_import_graph.py).
"""

from .attention import (
    ATTENTION_KERNELS,
    Attention,
    attention_kernel,
    gather_tokens,
    get_attention_kernel,
    set_attention_kernel,
)
from .backbone import (
    AudioTransformer,
    Backbone,
    VisionTransformer,
    adopt_timm,
    build_backbone,
    from_timm,
    load_pretrained,
)
from .config import POS_EMBED_MODES, BackboneConfig
from .errors import ModelError
from .hub import read_config, save_pretrained, timm_data_config, timm_transform, update_metadata
from .pos_embed import RelativePositionBias2d, sincos_1d, sincos_2d
from .registry import PRESETS, create_model, list_models
from .timm_interop import is_timm_vit, timm_kwargs, to_timm_state_dict

__all__ = [
    "ATTENTION_KERNELS",
    "POS_EMBED_MODES",
    "PRESETS",
    "Attention",
    "AudioTransformer",
    "Backbone",
    "BackboneConfig",
    "ModelError",
    "RelativePositionBias2d",
    "VisionTransformer",
    "adopt_timm",
    "attention_kernel",
    "build_backbone",
    "create_model",
    "from_timm",
    "gather_tokens",
    "get_attention_kernel",
    "is_timm_vit",
    "list_models",
    "load_pretrained",
    "read_config",
    "save_pretrained",
    "set_attention_kernel",
    "sincos_1d",
    "sincos_2d",
    "timm_data_config",
    "timm_kwargs",
    "timm_transform",
    "to_timm_state_dict",
    "update_metadata",
]
