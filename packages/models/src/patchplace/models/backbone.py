"""ViT and audio Transformer backbones sharing one protocol (docs/design.md).

Protocol used by every objective (none of them copies the backbone):

* ``patch_embed(x) -> (B, N, D)`` tokens without position information; ``grid``: (h, w) or (T,);
* ``pos_embed(index=None)``: the additive PE of all patch positions (1, N, D), or of chosen positions
  ``index`` (B, M) -> (B, M, D) — zeros in modes without an additive table (``none``, ``relbias2d``);
  objectives build their own per-token PEs from it (unknown PE, [MASK] PE, stochastic PE);
* ``cls_token`` and ``prepend_cls(tokens)`` (adds the CLS token with its own PE);
* ``forward_tokens(tokens, *, attn_mask=None, context_index=None)``: blocks + final norm (an identity with
  ``fc_norm``, whose LayerNorm follows the pooling in ``forward_head``, as timm's);
* ``embed`` / ``forward_features`` / ``forward_head`` / ``forward``: the ordinary full-attention classifier path
  used for fine-tuning and export (no data-dependent Python control flow).

Parameter names follow timm's ``VisionTransformer`` (``patch_embed.proj``, ``blocks.i.attn.qkv``, ``mlp.fc1``,
``norm``, ``head``) except the learned PE table, which is ``pos_table`` (``pos_embed`` is the protocol method).

Its layers (patchifiers, the block, the init) are :mod:`.blocks`'. :func:`load_pretrained` (a checkpoint directory)
lives here, above the checkpoint files (:mod:`.hub`), which know no model class; the backbones out of a timm ViT
(:func:`~.timm_backbone.from_timm`, :func:`~.timm_backbone.adopt_timm`) live in :mod:`.timm_backbone`, above it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import PyTorchModelHubMixin
from timm.layers import trunc_normal_
from torch import nn

# the layers, re-exported here where the objectives and the engine import them
from .blocks import Block, CheckpointedBlock, FrameEmbed, PatchEmbed, _init_weights, set_grad_checkpointing
from .config import BackboneConfig
from .errors import ModelError
from .hub import WEIGHTS_NAME, check_finite, load_state, save_pretrained
from .pos_embed import RelativePositionBias2d, sincos_1d, sincos_2d

__all__ = ["AudioTransformer", "Backbone", "Block", "CheckpointedBlock", "FrameEmbed", "PatchEmbed",
           "VisionTransformer", "build_backbone", "load_pretrained", "set_grad_checkpointing"]


def _checking() -> bool:
    """True in eager mode; value checks (which read tensor data) are skipped while tracing / exporting."""
    return not (torch.jit.is_tracing() or torch.compiler.is_compiling() or torch.onnx.is_in_onnx_export())


class Backbone(nn.Module, PyTorchModelHubMixin, library_name="patchplace", tags=["patchplace"]):
    """Shared Transformer trunk; :class:`VisionTransformer` and :class:`AudioTransformer` add the patchifier.

    Hugging Face Hub conventions (``huggingface_hub.PyTorchModelHubMixin``): ``model.save_pretrained(dir,
    metadata=..., push_to_hub=False)``, ``Backbone.from_pretrained("dir" or "user/repo")``,
    ``model.push_to_hub("user/repo")`` — all in the checkpoint format of :mod:`patchplace.models.hub` (config.json
    with timm's fields, timm-keyed safetensors, model card). ``pretrained_metadata`` holds the loaded metadata.
    """

    pretrained_metadata: dict[str, Any] | None = None

    def __init__(self, config: BackboneConfig) -> None:
        super().__init__()
        self.config = config.validate()
        c = config
        self.patch_embed = self._make_patch_embed()
        self.num_prefix_tokens = 1 if c.class_token else 0
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.embed_dim)) if c.class_token else None
        self.pos_drop = nn.Dropout(c.drop_rate)
        rates = torch.linspace(0, c.drop_path_rate, c.depth).tolist()
        self.blocks = nn.ModuleList(
            Block(c.embed_dim, c.num_heads, c.mlp_ratio, c.qkv_bias, c.drop_rate, c.attn_drop_rate, rate, c.norm_eps)
            for rate in rates)
        self.norm: nn.Module = nn.Identity() if c.fc_norm else nn.LayerNorm(c.embed_dim, eps=c.norm_eps)
        self.fc_norm: nn.Module = nn.LayerNorm(c.embed_dim, eps=c.norm_eps) if c.fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(c.drop_rate)
        self.head: nn.Module = nn.Linear(c.embed_dim, c.num_classes) if c.num_classes else nn.Identity()
        self.pos_table: torch.Tensor | None = None
        # MJP (Masked Jigsaw Puzzle, arXiv:2205.12551, §4.2): one shared learnable "unknown" PE for shuffled positions.
        self.unknown_pos_embed = nn.Parameter(torch.zeros(1, 1, c.embed_dim)) if c.unknown_pos else None
        self.apply(_init_weights)
        if self.unknown_pos_embed is not None:
            trunc_normal_(self.unknown_pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        self._build_pos_embed(c.pos_embed)

    def _make_patch_embed(self) -> nn.Module:
        raise NotImplementedError

    # ------------------------------------------------------------------ position embeddings
    @property
    def grid(self) -> tuple[int, ...]:
        return self.config.grid

    @property
    def num_patches(self) -> int:
        return self.config.num_patches

    @property
    def embed_dim(self) -> int:
        return self.config.embed_dim

    @property
    def _reference(self) -> torch.Tensor:
        """A parameter whose device and dtype new tensors take: the final norm's (``fc_norm``'s where it is dropped)."""
        return (self.fc_norm if self.config.fc_norm else self.norm).weight

    def _build_pos_embed(self, mode: str) -> None:
        """(Re)create the PE of ``mode``; every other weight is left untouched."""
        c = self.config
        if hasattr(self, "pos_table"):
            delattr(self, "pos_table")
        ref = self._reference
        rows = self.num_prefix_tokens
        if mode == "learned":
            table = torch.zeros(1, rows + self.num_patches, c.embed_dim, device=ref.device, dtype=ref.dtype)
            self.pos_table = nn.Parameter(trunc_normal_(table, std=0.02))
        elif mode in ("sincos2d", "sincos1d"):
            if mode == "sincos2d":
                fixed = sincos_2d(self.grid, c.embed_dim)
            else:
                fixed = sincos_1d(self.num_patches, c.embed_dim)
            table = torch.cat([torch.zeros(rows, c.embed_dim), fixed]).unsqueeze(0)  # CLS row = 0, as MAE
            self.register_buffer("pos_table", table.to(ref.device, ref.dtype), persistent=False)
        else:
            self.pos_table = None
        for block in self.blocks:
            block.rel_pos_bias = (RelativePositionBias2d(self.grid, c.num_heads, c.class_token).to(ref.device)
                                  if mode == "relbias2d" else None)

    def set_pos_embed(self, mode: str) -> None:
        """Switch PE mode (e.g. MP3: ``none`` in pretraining -> ``learned`` for fine-tuning), keeping all other
        weights; the new PE is freshly initialised (learned: trunc-normal .02, relbias2d: zeros)."""
        from dataclasses import replace

        self.config = replace(self.config, pos_embed=mode).validate()
        self._build_pos_embed(mode)

    def set_image_size(self, img_size: int | tuple[int, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Run at another resolution with the same patch size (fine-tuning or exporting at another image size than
        pretraining): the patch grid changes and the PE follows it — a learned table is resampled with timm's
        ``resample_abs_pos_embed`` (bicubic, antialiased; the class-token row kept), ``sincos2d`` is rebuilt for
        the new grid, ``relbias2d`` tables are resized with timm's ``resize_rel_pos_bias_table`` (BEiT's
        interpolation); every other weight is unchanged. -> (old grid, new grid)."""
        from dataclasses import replace

        from timm.layers import resample_abs_pos_embed, resize_rel_pos_bias_table

        if self.config.modality != "image":
            raise ModelError("set_image_size is for image backbones (audio: num_frames is fixed by the frontend)")
        old, mode = self.grid, self.config.pos_embed
        config = replace(self.config, img_size=img_size).validate()
        if config.image_hw == self.config.image_hw:
            return old, old
        learned = self.pos_table.detach() if mode == "learned" else None
        tables = [b.rel_pos_bias.relative_position_bias_table.detach() for b in self.blocks] \
            if mode == "relbias2d" else []
        self.config = config
        self.patch_embed.img_size = config.image_hw
        new = self.grid
        if mode == "learned":
            self.pos_table = nn.Parameter(resample_abs_pos_embed(
                learned, new_size=list(new), old_size=list(old), num_prefix_tokens=self.num_prefix_tokens))
        elif mode in ("sincos2d", "relbias2d"):
            self._build_pos_embed(mode)
            for block, table in zip(self.blocks, tables, strict=False):
                target = block.rel_pos_bias.relative_position_bias_table
                target.data.copy_(resize_rel_pos_bias_table(table, new_window_size=tuple(new),
                                                            new_bias_shape=tuple(target.shape),
                                                            old_window_size=tuple(old)))
        return old, new

    def enable_unknown_pos(self) -> None:
        """Add MJP's learnable unknown PE (trunc-normal .02) if the backbone has none; other weights unchanged."""
        from dataclasses import replace

        if self.unknown_pos_embed is None:
            self.config = replace(self.config, unknown_pos=True).validate()
            self.unknown_pos_embed = nn.Parameter(trunc_normal_(self._reference.new_zeros(1, 1, self.embed_dim),
                                                                std=0.02))

    def pos_embed(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """Additive PE of patch positions: (1, N, D), or (B, M, D) for ``index`` (B, M); zeros without a table."""
        if self.pos_table is None:
            table = self._reference.new_zeros(1, self.num_patches, self.embed_dim)
        else:
            table = self.pos_table[:, self.num_prefix_tokens:]
        if index is None:
            return table
        return torch.gather(table.expand(index.shape[0], -1, -1), 1,
                            index.unsqueeze(-1).expand(-1, -1, self.embed_dim))

    def prepend_cls(self, tokens: torch.Tensor) -> torch.Tensor:
        """[CLS + its PE; tokens] (no-op without a class token)."""
        if self.cls_token is None:
            return tokens
        cls = self.cls_token if self.pos_table is None else self.cls_token + self.pos_table[:, :1]
        return torch.cat([cls.expand(tokens.shape[0], -1, -1), tokens], dim=1)

    # ------------------------------------------------------------------ trunk
    def _check_tokens(self, tokens: torch.Tensor, attn_mask: torch.Tensor | None,
                      context_index: torch.Tensor | None, context_len: int | None = None) -> torch.Tensor | None:
        if tokens.dim() != 3 or tokens.shape[-1] != self.embed_dim:
            raise ModelError(f"tokens must be (B, T, {self.embed_dim}), got {tuple(tokens.shape)}")
        b, t, _ = tokens.shape
        keys = t
        if context_index is not None:
            if context_index.dim() != 2 or context_index.shape[0] != b or context_index.dtype != torch.long:
                raise ModelError(f"context_index must be a long tensor (B={b}, M), got {context_index.dtype} "
                                 f"{tuple(context_index.shape)}")
            if _checking() and (context_index.min() < 0 or context_index.max() >= t):
                raise ModelError(f"context_index values must lie in [0, {t}) (the token positions), got "
                                 f"[{int(context_index.min())}, {int(context_index.max())}]")
            keys = context_index.shape[1]
        if context_len is not None:
            if context_index is not None or not 0 < context_len <= t:
                raise ModelError(f"context_len must lie in [1, {t}] (the first tokens are the context) and not "
                                 f"come with context_index, got {context_len}")
            keys = context_len
        if self.config.pos_embed == "relbias2d" and t != self.num_prefix_tokens + self.num_patches:
            raise ModelError(f"relbias2d needs the full token sequence ({self.num_prefix_tokens + self.num_patches}"
                             f" tokens), got {t}")
        if attn_mask is None:
            return None
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise ModelError(f"attn_mask must be bool (True = attend) or additive float, got {attn_mask.dtype}")
        shape = tuple(attn_mask.shape)
        heads = self.config.num_heads
        ok = (len(shape) == 2 and shape == (t, keys)) or (len(shape) == 3 and shape == (b, t, keys)) or (
            len(shape) == 4 and shape[0] in (1, b) and shape[1] in (1, heads) and shape[2:] == (t, keys))
        if not ok:
            raise ModelError(f"attn_mask of shape {shape} does not fit {b} samples x {t} queries x {keys} keys: use "
                             f"({t}, {keys}), ({b}, {t}, {keys}) or ({b}, heads or 1, {t}, {keys})")
        return attn_mask.unsqueeze(1) if attn_mask.dim() == 3 else attn_mask  # per sample -> broadcast over heads

    def forward_tokens(self, tokens: torch.Tensor, *, attn_mask: torch.Tensor | None = None,
                       context_index: torch.Tensor | None = None, context_len: int | None = None) -> torch.Tensor:
        """Run every block and the final norm on ``tokens`` (B, T, D) that already carry their PEs.

        ``context_len`` M: every layer takes keys/values only from the first M tokens (MP3, context first: no copy).
        ``context_index`` (B, M): every layer takes keys/values only from those tokens (a gathered copy).
        ``attn_mask``: bool (True = attend) or additive, (T, K), (B, T, K) or (B, 1|heads, T, K) with K = T or M.
        """
        mask = self._check_tokens(tokens, attn_mask, context_index, context_len)
        x = tokens
        for block in self.blocks:
            x = block(x, attn_mask=mask, context_index=context_index, context_len=context_len)
        return self.norm(x)

    # ------------------------------------------------------------------ classifier path (fine-tuning, export)
    def embed(self, x: torch.Tensor, pos: torch.Tensor | None = None,
              unknown_pos: torch.Tensor | None = None) -> torch.Tensor:
        """Patch tokens + PE (the model's own, or ``pos`` broadcastable to (B, N, D)) + CLS, with dropout.

        ``unknown_pos`` (B, N) bool: those positions get the unknown PE instead (MJP; CLS keeps its PE)."""
        tokens = self.patch_embed(x)
        if pos is None and self.pos_table is not None:
            pos = self.pos_table[:, self.num_prefix_tokens:]
        if unknown_pos is not None:
            if self.unknown_pos_embed is None:
                raise ModelError("unknown_pos given but the backbone has no unknown PE: call enable_unknown_pos() "
                                 "or create it with unknown_pos=True")
            if unknown_pos.shape != tokens.shape[:2] or unknown_pos.dtype != torch.bool:
                raise ModelError(f"unknown_pos must be a bool mask of shape {tuple(tokens.shape[:2])}, got "
                                 f"{unknown_pos.dtype} {tuple(unknown_pos.shape)}")
            base = pos if pos is not None else tokens.new_zeros(1, 1, 1)
            pos = torch.where(unknown_pos.unsqueeze(-1), self.unknown_pos_embed, base)
        if pos is not None:
            tokens = tokens + pos
        return self.pos_drop(self.prepend_cls(tokens))

    def forward_features(self, x: torch.Tensor, unknown_pos: torch.Tensor | None = None) -> torch.Tensor:
        return self.forward_tokens(self.embed(x, unknown_pos=unknown_pos))

    def pool(self, features: torch.Tensor) -> torch.Tensor:
        if self.config.global_pool == "cls":
            return features[:, 0]
        return features[:, self.num_prefix_tokens:].mean(dim=1)

    def forward_head(self, features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Pool, ``fc_norm`` (an identity unless ``config.fc_norm``), dropout, head: timm's order."""
        pooled = self.head_drop(self.fc_norm(self.pool(features)))
        return pooled if pre_logits else self.head(pooled)

    def forward(self, x: torch.Tensor, unknown_pos: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (or pooled features without a head); ``unknown_pos`` (B, N) bool marks MJP-shuffled patches."""
        return self.forward_head(self.forward_features(x, unknown_pos))

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """Replace the head by a fresh trunc-normal(.02) Linear for ``num_classes`` (0 = features only)."""
        from dataclasses import replace

        self.config = replace(self.config, num_classes=num_classes,
                              global_pool=global_pool or self.config.global_pool).validate()
        ref = self._reference
        self.head = nn.Linear(self.embed_dim, num_classes).to(ref.device, ref.dtype) if num_classes else nn.Identity()
        if num_classes:
            _init_weights(self.head)

    def set_fc_norm(self, enabled: bool) -> None:
        """Switch between a final norm after the blocks (``False``) and a LayerNorm after pooling (``True``: timm's
        ``fc_norm``). The norm that appears is freshly initialised (ones / zeros) and the other is dropped, as MAE's
        fine-tuning does with ``--global_pool`` (models_vit.py: a new ``fc_norm``, ``del self.norm``); the blocks,
        PE and head are untouched. A no-op when the backbone already is in that state."""
        from dataclasses import replace

        if enabled == self.config.fc_norm:
            return
        ref = self._reference
        self.config = replace(self.config, fc_norm=enabled).validate()
        fresh = nn.LayerNorm(self.embed_dim, eps=self.config.norm_eps).to(ref.device, ref.dtype)
        self.norm, self.fc_norm = (nn.Identity(), fresh) if enabled else (fresh, nn.Identity())

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute every block's activations in the backward (timm's method name): less memory, one more forward
        of the blocks per step (:func:`set_grad_checkpointing`)."""
        set_grad_checkpointing(self, enable)

    # ------------------------------------------------------------------ optimizer interface (timm's)
    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False, prefix: str = "") -> dict:
        """Parameter groups for timm's layer-wise lr decay (``create_optimizer_v2(..., layer_decay=)``), as BEiT /
        MAE's ``param_groups_lrd``: the embeddings (patch embed, CLS, PE tables, unknown PE) form layer 0, block i
        layer i + 1, and everything unmatched (the final norm, the head, an objective's own heads) the top layer, so
        block i gets lr scale ``decay^(depth - i)`` and the embeddings ``decay^(depth + 1)``. ``prefix`` is the
        backbone's name inside a wrapper (``"backbone."`` in an objective)."""
        p = re.escape(prefix)
        return dict(stem=rf"^{p}(?:cls_token|pos_table|patch_embed|unknown_pos_embed)",
                    blocks=rf"^{p}blocks\.(\d+)")

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Parameters exempt from weight decay (beside timm's rule for every 1-D tensor: norms and biases): PEs, CLS,
        the unknown PE and the relative position bias tables."""
        names = {"pos_table", "cls_token", "unknown_pos_embed"}
        return names | {n for n, _ in self.named_parameters() if n.endswith("relative_position_bias_table")}

    # ------------------------------------------------------------------ checkpoints
    def save_pretrained(self, save_directory: str | os.PathLike, metadata: dict[str, Any] | None = None,
                        **hub_kwargs: Any) -> Path | str:
        """Write a checkpoint directory (``metadata`` defaults to ``pretrained_metadata``); ``push_to_hub=True,
        repo_id=...`` also uploads it (returns the commit URL, else the directory)."""
        if metadata is not None:
            self.pretrained_metadata = metadata
        url = PyTorchModelHubMixin.save_pretrained(self, save_directory, **hub_kwargs)
        return url or Path(save_directory)

    def _save_pretrained(self, save_directory: Path) -> None:
        save_pretrained(self, save_directory, self.pretrained_metadata)

    @classmethod
    def _from_pretrained(cls, *, model_id: str, revision: str | None, cache_dir: str | Path | None,
                         force_download: bool, local_files_only: bool, token: str | bool | None,
                         map_location: str = "cpu", **_: Any) -> Backbone:
        directory = Path(model_id)
        if not directory.is_dir():
            from huggingface_hub import snapshot_download

            directory = Path(snapshot_download(repo_id=model_id, revision=revision, cache_dir=cache_dir,
                                               force_download=force_download, local_files_only=local_files_only,
                                               token=token))
        model, metadata = load_pretrained(directory, map_location)
        if not isinstance(model, cls):
            raise ModelError(f"{model_id} holds a {type(model).__name__}, not a {cls.__name__}: load it with "
                             f"Backbone.from_pretrained or {type(model).__name__}.from_pretrained")
        model.pretrained_metadata = metadata
        return model


class VisionTransformer(Backbone):
    """ViT (Dosovitskiy et al. 2021) for any image size / patch size / channels, every PE mode."""

    def _make_patch_embed(self) -> nn.Module:
        c = self.config
        return PatchEmbed(c.image_hw, c.patch_size, c.in_chans, c.embed_dim)


class AudioTransformer(Backbone):
    """MP3's speech Transformer (§3.1, §4.3): MFCC frames -> Linear -> CLS -> sin PE -> blocks."""

    def _make_patch_embed(self) -> nn.Module:
        c = self.config
        return FrameEmbed(c.num_frames, c.in_features, c.embed_dim)


def build_backbone(config: BackboneConfig) -> Backbone:
    """The backbone class for ``config.modality``."""
    return (AudioTransformer if config.modality == "audio" else VisionTransformer)(config)


def load_pretrained(directory: str | os.PathLike, map_location: str | torch.device = "cpu"
                    ) -> tuple[Backbone, dict[str, Any]]:
    """Rebuild the backbone of a ``save_pretrained`` directory (``config.json`` or, without it, the weights'
    header); returns (model, metadata). Reads both layouts: timm-keyed and the older patchplace-keyed files."""
    config, state, metadata = load_state(directory, map_location)
    weights = Path(directory) / WEIGHTS_NAME
    model = build_backbone(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ModelError(f"{weights} does not match its config.json: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}")
    check_finite(state, weights)
    return model.to(map_location), metadata
