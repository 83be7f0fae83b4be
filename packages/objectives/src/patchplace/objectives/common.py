"""Pieces every objective shares (written once): config validation, batch unpacking, random masking / per-sample
shuffles, grid geometry, position-accuracy metrics, and a small Transformer decoder built from the backbone's
own blocks."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from patchplace.models import Backbone, adopt_timm, is_timm_vit
from patchplace.models.backbone import Block

from .configs import ObjectiveConfig, ObjectiveError, check_positive, check_ratio, check_widths  # noqa: F401 (for the objectives)


def split_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(inputs, labels)`` / ``[inputs, labels]`` / ``{"inputs", "labels"}`` / a bare tensor -> (inputs, labels)."""
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, dict):
        return batch["inputs"], batch.get("labels")
    if isinstance(batch, (tuple, list)) and len(batch) >= 1:
        return batch[0], batch[1] if len(batch) > 1 else None
    raise ObjectiveError(f"a batch must be a tensor, (inputs, labels) or a dict, got {type(batch).__name__}")


# ---------------------------------------------------------------------------------------------- base
class BackboneObjective(nn.Module):
    """Base of every objective: an ``nn.Module`` holding ``self.backbone`` plus its own heads / decoders.

    It gives the wrapper timm's optimizer interface, so ``create_optimizer_v2(objective, layer_decay=...)`` builds
    the same groups as on the bare backbone (docs/design.md): ``group_matcher``
    maps the backbone's embeddings to layer 0
    and block i to layer i + 1; the final norm, the classifier head and the objective's own modules are the top
    layer (lr scale 1). ``no_weight_decay`` = the backbone's (PE tables, CLS, unknown PE, relative bias tables) +
    the objective's learned tokens named in ``no_weight_decay_tokens`` (mask tokens, the DropPos [MASK] position
    token); timm exempts every 1-D tensor (norms, biases) on top of that.

    ``probe_feature`` says which pooled feature the pretraining trained (docs/design.md, recorded in the checkpoint):
    ``"cls"`` (the class token, in a sequence that contains it), ``"mean"`` (average of the patch outputs of a
    sequence that contains the class token) or ``"patch_mean"`` (average of the final-normed patch outputs of the
    patch tokens alone: methods that never feed the class token, whose probes must not read or attend to it).

    ``finetune_pool`` says which feature the method's own fine-tuning protocol puts its classifier head on (recorded
    in the checkpoint; ``finetune.global_pool: null`` reads it): ``"cls"`` (MP3 §3.3, MJP, DeiT) or ``"mean"``
    (average-pooled patch tokens: MAE's ``--global_pool``, DropPos, I-JEPA, StoP, RandSAC).

    Both are declared once, where the objective's file registers its methods (:func:`.registry.register_method`),
    as are the backbone facts :meth:`setup_backbone` applies (PE modes, modality, class token, classifier head).
    """

    backbone: Backbone
    # the registered methods (MethodSpec) this class trains, in source order; set by register_method (the
    # registry hands them to the class: this module never imports the registry)
    method_specs: tuple[Any, ...] = ()
    no_weight_decay_tokens: tuple[str, ...] = ()
    # True for objectives whose steps may leave a trainable parameter without a gradient by design (MJP: E_unk on
    # steps without the jigsaw). A DDP trainer must then look for unused parameters (``find_unused_parameters``).
    leaves_parameters_unused: bool = False

    def setup_backbone(self, backbone: nn.Module, config: ObjectiveConfig) -> ObjectiveConfig:
        """The set-up every registered objective's constructor starts with, driven by its registration's facts
        (:class:`.registry.MethodSpec`): a timm ``VisionTransformer`` is adopted with its parameters shared and the
        pretraining PE (:func:`as_backbone`), ``config`` is validated with its null widths taken from the backbone
        (:meth:`ObjectiveConfig.for_backbone`), the backbone is checked (PE mode, modality, class token, classifier
        head) and kept as ``self.backbone``; a class token the method never feeds is frozen. Returns the config."""
        specs = type(self).method_specs
        if not specs:
            raise ObjectiveError(f"{type(self).__name__} is not registered: decorate it with register_method")
        spec = specs[0]  # the class's own method (a stacked one, e.g. StoP, is a config preset of it)
        backbone = as_backbone(backbone, spec.pos_embed if spec.pos_embed in ("sincos2d", "none") else None)
        config = config.validate().for_backbone(backbone)
        check_backbone(backbone, specs)
        self.backbone = backbone
        if spec.class_token == "unused":
            self.freeze_class_token()
        return config

    @property
    def evaluated_encoder(self) -> Backbone:
        """The encoder the registered method's paper evaluates (its registration's ``evaluated_encoder``: the
        trained ``backbone``, or I-JEPA's / StoP's EMA ``target_encoder``): what probes, fine-tuning and export
        read, so what a checkpoint saves as its backbone."""
        specs = type(self).method_specs
        return getattr(self, specs[0].evaluated_encoder) if specs else self.backbone

    @property
    def probe_feature(self) -> str:
        """The registered method's (:mod:`.registry`) on this backbone; an unregistered objective: the feature the
        classifier head reads (``cls`` or ``mean`` of a sequence that holds the class token)."""
        specs = type(self).method_specs
        return specs[0].probe_feature_for(self.backbone) if specs else self.backbone.config.global_pool

    @property
    def finetune_pool(self) -> str:
        """The registered method's (:mod:`.registry`) on this backbone; an unregistered objective: the pooling the
        classifier head reads (``cls`` or ``mean``)."""
        specs = type(self).method_specs
        return specs[0].finetune_pool_for(self.backbone) if specs else self.backbone.config.global_pool

    def freeze_class_token(self) -> None:
        """For objectives that never feed the class token (``probe_feature = "patch_mean"``): it can get no gradient
        in this pretraining, so it is frozen. Distributed data parallel then meets no trainable parameter without a
        gradient (its "parameters that were not used in producing loss" error), and single-process training is
        unchanged (AdamW skips a parameter whose gradient is None). The token keeps its initialization in the
        checkpoint; fine-tuning, which loads a fresh backbone, trains it."""
        if self.backbone.cls_token is not None:
            self.backbone.cls_token.requires_grad_(False)

    def freeze_unknown_pos(self) -> None:
        """For objectives that never pass ``unknown_pos`` (all but MJP) on a backbone that has MJP's unknown PE
        (``E_unk``, e.g. an MJP checkpoint being fine-tuned): it can get no gradient, so it is frozen, for the same
        reason as :meth:`freeze_class_token` (DDP's unused-parameter error; single-process training unchanged)."""
        if self.backbone.unknown_pos_embed is not None:
            self.backbone.unknown_pos_embed.requires_grad_(False)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict:
        return self.backbone.group_matcher(coarse, prefix="backbone.")

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        own = {name for name in self.no_weight_decay_tokens if getattr(self, name, None) is not None}
        return {f"backbone.{n}" for n in self.backbone.no_weight_decay()} | own


# ---------------------------------------------------------------------------------------------- masking
def noise_device(device: torch.device | str, generator: torch.Generator | None) -> torch.device | str:
    """Where to draw random numbers: on the generator's device when one is given (so a CPU generator gives the same
    masks whatever device the model is on), else on ``device`` — with its default generator, the global RNG
    stream a checkpoint saves (a training step passes no generator: its masks are drawn on the device)."""
    return generator.device if generator is not None else device


def random_shuffle(batch: int, n: int, device: torch.device | str = "cpu",
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """One random permutation of ``range(n)`` per sample (B, n) — MAE's argsort-of-noise shuffle."""
    noise = torch.rand(batch, n, device=noise_device(device, generator), generator=generator)
    return noise.argsort(dim=1).to(device)


def random_masking(batch: int, n: int, keep: int, device: torch.device | str = "cpu",
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MAE per-sample random masking: returns ``ids_keep`` (B, keep), ``mask`` (B, n) bool (True = removed) and
    ``ids_restore`` (B, n) (the inverse permutation, to put [kept; removed] tokens back in order)."""
    if not 0 <= keep <= n:
        raise ObjectiveError(f"cannot keep {keep} of {n} tokens")
    shuffle = random_shuffle(batch, n, device, generator)
    restore = shuffle.argsort(dim=1)
    # token i is removed iff its place in the shuffle is past the kept ones (MAE: ones, [:keep] = 0, gather by
    # restore: the same mask in one op)
    return shuffle[:, :keep], restore >= keep, restore


def num_kept(n: int, ratio: float) -> int:
    """Tokens kept at masking ratio ``ratio``: round((1 - ratio) n), at least 1."""
    return max(1, round((1.0 - ratio) * n))


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[b, index[b]]`` for (B, N, ...) and (B, M) -> (B, M, ...)."""
    shape = index.shape + x.shape[2:]
    return torch.gather(x, 1, index.reshape(*index.shape, *([1] * (x.dim() - 2))).expand(shape))


# ---------------------------------------------------------------------------------------------- patches
def image_to_patches(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, C, p, p) patches in raster order (lossless; inverse: :func:`patches_to_image`)."""
    b, c, h, w = images.shape
    p = patch_size
    return images.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, c, p, p)


def patches_to_image(patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """(B, N, C, p, p) raster-ordered patches -> (B, C, gh * p, gw * p)."""
    b, _, c, p, _ = patches.shape
    gh, gw = grid
    return patches.reshape(b, gh, gw, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, gh * p, gw * p)


# ---------------------------------------------------------------------------------------------- grid geometry
def grid_coords(grid: tuple[int, ...]) -> torch.Tensor:
    """(N, len(grid)) integer coordinates of raster-ordered positions: (row, col) for 2-D, (t,) for 1-D."""
    axes = torch.meshgrid(*[torch.arange(g) for g in grid], indexing="ij")
    return torch.stack([a.reshape(-1) for a in axes], dim=1)


def squared_grid_distance(grid: tuple[int, ...]) -> torch.Tensor:
    """(N, N) squared Euclidean distance between positions on the grid."""
    c = grid_coords(grid).float()
    return ((c[:, None, :] - c[None, :, :]) ** 2).sum(-1)


# ---------------------------------------------------------------------------------------------- metrics
@torch.no_grad()
def topk_accuracy(logits: torch.Tensor, targets: torch.Tensor, k: int = 1,
                  weight: torch.Tensor | None = None) -> torch.Tensor:
    """Fraction of rows whose target is among the top-k logits; with ``weight`` the weighted fraction
    sum(w * hit) / sum(w) (a bool mask counts the rows where it is True; 0 when every weight is 0)."""
    k = min(k, logits.shape[-1])
    hit = (logits.topk(k, dim=-1).indices == targets.unsqueeze(-1)).any(-1).float()
    if weight is None:
        return hit.mean()
    weight = weight.float()
    return (hit * weight).sum() / weight.sum().clamp_min(torch.finfo(weight.dtype).tiny)


# ---------------------------------------------------------------------------------------------- decoder
class TransformerDecoder(nn.Module):
    """``depth`` pre-norm blocks (the backbone's own ``Block``) of width ``dim`` + a final LayerNorm; inputs are
    projected from ``in_dim`` by ``embed`` (MAE / DropPos decoders, predictors)."""

    def __init__(self, in_dim: int, dim: int, depth: int, num_heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        if dim % num_heads:
            raise ObjectiveError(f"decoder width {dim} is not divisible by decoder heads {num_heads}")
        self.embed = nn.Linear(in_dim, dim)
        self.blocks = nn.ModuleList(Block(dim, num_heads, mlp_ratio, True, 0.0, 0.0, 0.0, 1e-6) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.apply(init_linear)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, attn_mask=attn_mask)
        return self.norm(x)


def init_linear(module: nn.Module) -> None:
    """MAE's init for heads and decoders: xavier-uniform Linear weights, zero biases."""
    if isinstance(module, nn.Linear):
        nn.init.xavier_uniform_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


def as_backbone(backbone: nn.Module, pos_embed: str | None = None) -> Backbone:
    """The backbone an objective trains: a patchplace backbone as given, or a timm ``VisionTransformer`` adopted
    with its parameters shared (training the objective trains the timm model in place) and the PE the method needs
    (:func:`patchplace.models.adopt_timm`)."""
    return adopt_timm(backbone, pos_embed) if is_timm_vit(backbone) else backbone


def check_backbone(backbone: Backbone, specs: tuple[Any, ...]) -> None:
    """``backbone`` against what the methods ``specs`` of one objective class state (one line naming the fix):
    a PE mode one of them accepts, a modality one of them trains, the class token and classifier head they need."""
    name = specs[0].display
    modes = tuple(dict.fromkeys(mode for spec in specs for mode in spec.pos_modes))
    if backbone.config.pos_embed not in modes:
        raise ObjectiveError(f"{name} needs a backbone with pos_embed in {modes}, got "
                             f"{backbone.config.pos_embed!r}: create it with pos_embed={modes[0]!r} "
                             "(or call backbone.set_pos_embed)")
    modalities = {spec.modality for spec in specs}
    if not specs[0].any_modality and backbone.config.modality not in modalities:
        raise ObjectiveError(f"{name} needs an {' or '.join(sorted(modalities))} backbone, got a "
                             f"{backbone.config.modality} one")
    if specs[0].class_token == "required" and backbone.cls_token is None:
        raise ObjectiveError(f"{name} needs a backbone with a class token (class_token=True)")
    if specs[0].needs_head and backbone.config.num_classes < 1:
        raise ObjectiveError(f"{name} needs a classifier head (it trains with labels): create the backbone with "
                             "num_classes >= 1")
