"""patchplace.models.

ViT and audio Transformer backbones with every position-embedding mode the methods need (none, learned, sincos2d,
sincos1d, relbias2d), attention with per-sample masks and context-only keys/values (MP3), safetensors save/load and
timm interop.

The implementation lands with a later issue; this portion of the namespace exists so the layout is stable.
"""
