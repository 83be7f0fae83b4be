"""Named presets and ``create_model`` (timm-style registry)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .backbone import Backbone, build_backbone
from .config import BackboneConfig
from .errors import ModelError

_IMAGENET = dict(img_size=224, patch_size=16, in_chans=3)
_CPU = dict(img_size=32, patch_size=4, in_chans=3, depth=6)
PRESETS: dict[str, BackboneConfig] = {
    "vit_tiny": BackboneConfig(**_IMAGENET, embed_dim=192, depth=12, num_heads=3),
    "vit_small": BackboneConfig(**_IMAGENET, embed_dim=384, depth=12, num_heads=6),
    "vit_base": BackboneConfig(**_IMAGENET, embed_dim=768, depth=12, num_heads=12),
    # ViT-H/14 ("An Image is Worth 16x16 Words", arXiv 2010.11929, Table 1), I-JEPA's largest encoder: no class
    # token, average pooling (timm's vit_huge_patch14_gap_224, the layout of I-JEPA's released weights)
    "vit_huge_14": BackboneConfig(img_size=224, patch_size=14, in_chans=3, embed_dim=1280, depth=32, num_heads=16,
                                  class_token=False, global_pool="mean"),
    # CPU-sized ViTs for 28/32 px images with patch 4 (an 8 x 8 grid, the MP3 CIFAR setting).
    "vit_cpu": BackboneConfig(**_CPU, embed_dim=192, num_heads=3),  # ~2.7M parameters
    "vit_cpu_narrow": BackboneConfig(**_CPU, embed_dim=128, num_heads=4),  # ~1.2M parameters
    "vit_micro": BackboneConfig(img_size=32, patch_size=4, in_chans=3, embed_dim=32, depth=2, num_heads=2),  # tests
    # MP3 §4.3 speech model: 8 layers, d = 32, FFN 64, dropout 0.1, ~70K parameters, 101 MFCC frames x 40.
    # Heads are not stated in the paper; 4 (8 dims each) is our choice. "A dropout of 0.1" is read as the
    # Transformer's (residual / hidden) dropout, with no dropout on the attention weights (fairseq's defaults,
    # --dropout 0.1 --attention-dropout 0): attention dropout forces SDPA's math path, whose Bernoulli draw over
    # every 101 x 101 attention map made a training step ~1.9x slower on CPU.
    "audio_mp3": BackboneConfig(modality="audio", num_frames=101, in_features=40, embed_dim=32, depth=8,
                                num_heads=4, mlp_ratio=2.0, pos_embed="sincos1d", drop_rate=0.1,
                                attn_drop_rate=0.0, num_classes=12),
}


def list_models() -> list[str]:
    return sorted(PRESETS)


def create_model(name: str, **overrides: Any) -> Backbone:
    """Build preset ``name`` with config ``overrides`` (e.g. ``in_chans=1, pos_embed="none", num_classes=10``)."""
    if name not in PRESETS:
        raise ModelError(f"unknown model {name!r}; available: {', '.join(list_models())}")
    try:
        config = replace(PRESETS[name], **overrides)
    except TypeError as exc:
        raise ModelError(f"bad override for {name}: {exc}") from exc
    return build_backbone(config)
