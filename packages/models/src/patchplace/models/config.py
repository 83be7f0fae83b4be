"""Backbone configuration: one validated dataclass for the ViT and the audio Transformer."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from .errors import ModelError

POS_EMBED_MODES = {
    "image": ("none", "learned", "sincos2d", "relbias2d"),
    "audio": ("none", "learned", "sincos1d"),
}
GLOBAL_POOLS = ("cls", "mean")
# Fields added after checkpoints of this format were first written: config.json carries them only when they differ from
# their default, so a checkpoint that does not use them is byte-identical to before and loads in earlier versions.
LATER_FIELDS = {"fc_norm": False}


@dataclass
class BackboneConfig:
    """Everything needed to rebuild a backbone (saved as ``config.json`` by ``save_pretrained``).

    Images use ``img_size`` / ``patch_size`` / ``in_chans`` (grid = img_size / patch_size); audio uses
    ``num_frames`` x ``in_features`` (one MFCC frame = one 1-D patch, MP3 §3.1).
    """

    modality: str = "image"
    img_size: int | tuple[int, int] = 32
    patch_size: int = 4
    in_chans: int = 3
    num_frames: int = 101
    in_features: int = 40
    embed_dim: int = 192
    depth: int = 6
    num_heads: int = 3
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    pos_embed: str = "learned"
    unknown_pos: bool = False  # MJP: a learnable unknown PE that replaces the PE of shuffled positions
    class_token: bool = True
    global_pool: str = "cls"
    # timm's fc_norm (VisionTransformer(global_pool='avg', fc_norm=True)): no final norm after the blocks, a LayerNorm
    # on the pooled feature instead — MAE's and DropPos's fine-tuning with --global_pool (MAE models_vit.py)
    fc_norm: bool = False
    num_classes: int = 0
    drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if isinstance(self.img_size, (list, tuple)):
            self.img_size = tuple(int(s) for s in self.img_size)

    # ------------------------------------------------------------------ derived shapes
    @property
    def image_hw(self) -> tuple[int, int]:
        s = self.img_size
        return (s, s) if isinstance(s, int) else (s[0], s[1])

    @property
    def grid(self) -> tuple[int, ...]:
        """(h, w) patch grid for images, (T,) for audio."""
        if self.modality == "audio":
            return (self.num_frames,)
        h, w = self.image_hw
        return (h // self.patch_size, w // self.patch_size)

    @property
    def num_patches(self) -> int:
        n = 1
        for g in self.grid:
            n *= g
        return n

    # ------------------------------------------------------------------ validation and (de)serialization
    def validate(self) -> BackboneConfig:
        if self.modality not in POS_EMBED_MODES:
            raise ModelError(f"modality must be one of {tuple(POS_EMBED_MODES)}, got {self.modality!r}")
        ints = ["patch_size", "in_chans", "embed_dim", "depth", "num_heads", "num_frames", "in_features"]
        for name in ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelError(f"{name} must be a positive int, got {value!r}")
        if self.modality == "image":
            h, w = self.image_hw
            if h < 1 or w < 1 or h % self.patch_size or w % self.patch_size:
                raise ModelError(f"img_size {h}x{w} is not divisible by patch_size {self.patch_size}: "
                                 "pad or resize the images (e.g. pad_to=32 for 28 px) or change patch_size")
        if self.embed_dim % self.num_heads:
            raise ModelError(f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}")
        modes = POS_EMBED_MODES[self.modality]
        if self.pos_embed not in modes:
            raise ModelError(f"pos_embed {self.pos_embed!r} is not available for {self.modality}; use one of {modes}")
        if self.pos_embed == "sincos2d" and self.embed_dim % 4:
            raise ModelError(f"sincos2d needs embed_dim divisible by 4, got {self.embed_dim}")
        if self.pos_embed == "sincos1d" and self.embed_dim % 2:
            raise ModelError(f"sincos1d needs an even embed_dim, got {self.embed_dim}")
        if self.global_pool not in GLOBAL_POOLS:
            raise ModelError(f"global_pool must be one of {GLOBAL_POOLS}, got {self.global_pool!r}")
        if not isinstance(self.fc_norm, bool):
            raise ModelError(f"fc_norm must be true or false, got {self.fc_norm!r}")
        if self.global_pool == "cls" and not self.class_token:
            raise ModelError("global_pool='cls' needs class_token=True; use global_pool='mean'")
        if self.num_classes < 0 or self.mlp_ratio <= 0:
            raise ModelError(f"num_classes must be >= 0 and mlp_ratio > 0, got {self.num_classes}, {self.mlp_ratio}")
        for name in ("drop_rate", "attn_drop_rate", "drop_path_rate"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ModelError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        return self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if isinstance(d["img_size"], tuple):
            d["img_size"] = list(d["img_size"])
        return {k: v for k, v in d.items() if k not in LATER_FIELDS or v != LATER_FIELDS[k]}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> BackboneConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ModelError(f"unknown backbone config field(s) {unknown}; known: {sorted(known)}")
        return cls(**raw).validate()
