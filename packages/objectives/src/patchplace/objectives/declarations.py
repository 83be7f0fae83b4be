"""The methods' registrations, importable without torch: the facts of each method (:func:`declare`: its config
class, PE mode, probe feature, fine-tuning pooling, paper, ...), which the objective's file links to its class with
``@register_method(name)`` (:mod:`.registry`)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from .configs import (
    DropPosConfig,
    IJEPAConfig,
    MAEConfig,
    MJPConfig,
    MP3Config,
    ObjectiveConfig,
    ObjectiveError,
    RandSACConfig,
    SupervisedConfig,
)

# ``head``: the pooling of the backbone's classifier head (``global_pool``), for methods that train through it.
PROBE_FEATURES = ("cls", "mean", "patch_mean", "head")
FINETUNE_POOLS = ("cls", "mean", "mean_fc_norm", "head")
MODALITIES = ("image", "audio")
PE_MODES = ("none", "learned", "sincos1d", "sincos2d", "relbias2d")
# required: the objective reads it (fails without one); unused: never fed, so frozen (DDP meets no parameter without a
# gradient); optional: used where the backbone has one
CLASS_TOKEN = ("required", "unused", "optional")

# the objective's attribute whose encoder a method's paper evaluates
EVALUATED_ENCODERS = ("backbone", "target_encoder")


@dataclass(frozen=True, eq=False)
class MethodFacts:
    """What one method is (see :mod:`.registry`), its objective class aside. ``probe_feature`` / ``finetune_pool``
    are stated for the paper's backbone, which has a class token; :meth:`probe_feature_for` /
    :meth:`finetune_pool_for` give them on any backbone."""

    name: str
    config_cls: type
    pos_embed: str  # the backbone's PE mode during pretraining
    needs_head: bool = False  # trains through a classifier head (with labels): the backbone has num_classes
    # the pooled feature the pretraining trains (docs/design.md): cls | mean (patch outputs of a sequence holding the
    # class token) | patch_mean (the patch tokens alone: the class token is never fed) | head
    probe_feature: str = "head"
    finetune_pool: str = "head"  # what the method's own fine-tuning puts its classifier head on: cls | mean | head |
    # mean_fc_norm (the mean through a fresh LayerNorm, no final norm: MAE's main_finetune.py --global_pool)
    modality: str = "image"  # image | audio: the data it pretrains on
    paper: str = ""  # authors, year, title: the model card's reference
    display: str = ""  # the name tables show (the method's own spelling, e.g. I-JEPA); empty: ``name``
    defaults: Mapping[str, Any] = field(default_factory=dict)  # config fields that differ from the class's defaults
    # the curves evaluate.py draws from its saved objective (objective.safetensors): a name of
    # patchplace.pipelines.curves.CURVES (e.g. "eta" for MP3, "position_grid" for DropPos); empty: none
    curves: str = ""
    pos_modes: tuple[str, ...] = ()  # the backbone PE modes the objective trains on; empty: pos_embed alone
    class_token: str = "optional"  # required | unused (never fed: frozen) | optional (see CLASS_TOKEN)
    any_modality: bool = False  # the objective trains a backbone of any modality, not only ``modality``'s
    # the objective's attribute holding the encoder its paper evaluates (probes, fine-tuning, export read it; a
    # checkpoint saves it as checkpoint/ and the trained backbone beside it where they differ): backbone, or
    # target_encoder (I-JEPA / StoP: the EMA target encoder)
    evaluated_encoder: str = "backbone"

    def __post_init__(self) -> None:
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))
        object.__setattr__(self, "display", self.display or self.name)
        object.__setattr__(self, "pos_modes", tuple(self.pos_modes) or (self.pos_embed,))
        checks = [("pos_embed", self.pos_embed, PE_MODES), ("probe_feature", self.probe_feature, PROBE_FEATURES),
                  ("finetune_pool", self.finetune_pool, FINETUNE_POOLS), ("modality", self.modality, MODALITIES),
                  ("evaluated_encoder", self.evaluated_encoder, EVALUATED_ENCODERS),
                  ("class_token", self.class_token, CLASS_TOKEN)]
        checks += [("pos_modes", mode, PE_MODES) for mode in self.pos_modes]
        for what, value, allowed in checks:
            if value not in allowed:
                raise ObjectiveError(f"method {self.name!r}: {what} must be one of {allowed}, got {value!r}")

    def config(self, fields: Mapping[str, Any] | ObjectiveConfig | None = None,
               named: Callable[[str], str] = str) -> ObjectiveConfig:
        """The method's config: the class's defaults, then :attr:`defaults`, then ``fields`` (validated); ``fields``
        that are a :attr:`config_cls` object already (a pipeline's validated ``objective`` section) are that object,
        validated. A refusal words each field as ``named(field)`` (:meth:`ObjectiveConfig.validate`)."""
        if fields is not None and not isinstance(fields, Mapping):
            if not isinstance(fields, self.config_cls):
                raise ObjectiveError(f"method {self.name!r} is configured by {self.config_cls.__name__}, not "
                                     f"{type(fields).__name__}")
            return fields.validate(named)
        return self.config_cls.from_dict({**self.defaults, **(fields or {})}, named)

    def config_values(self) -> dict[str, Any]:
        """{field: value} of :meth:`config` (the class's defaults, then :attr:`defaults`), in declaration order."""
        config = self.config()
        return {f.name: getattr(config, f.name) for f in fields(config)}

    def probe_feature_for(self, backbone: Any) -> str:
        """The probe feature on ``backbone``: ``head`` is its ``global_pool``; ``mean`` without a class token is
        ``patch_mean`` (the sequence holds the patch tokens only)."""
        if self.probe_feature == "head":
            return backbone.config.global_pool
        if backbone.cls_token is None and self.probe_feature in ("cls", "mean"):
            return "patch_mean"
        return self.probe_feature

    def finetune_pool_for(self, backbone: Any) -> str:
        """The fine-tuning pooling on ``backbone``: ``head`` is its ``global_pool``; ``cls`` without a class token is
        ``mean`` (average pooling)."""
        if self.finetune_pool == "head":
            return backbone.config.global_pool
        if backbone.cls_token is None and self.finetune_pool == "cls":
            return "mean"
        return self.finetune_pool


DECLARED: dict[str, MethodFacts] = {}


def declare(name: str, *, config: type, pos_embed: str, **facts: Any) -> None:
    """Declares method ``name``: its config class, the backbone's PE mode in pretraining and the other
    :class:`MethodFacts` as keywords; its objective's file registers the class that trains it
    (``@register_method(name)``)."""
    DECLARED[name] = MethodFacts(name, config, pos_embed, **facts)


def known_methods() -> dict[str, MethodFacts]:
    """{method: its facts} of every declared method and, once :mod:`.registry` is imported, every registered one
    (a method registered in this process included), by name."""
    registry = sys.modules.get(f"{__package__}.registry")
    return dict(sorted({**DECLARED, **(registry.registered() if registry else {})}.items()))


# The DeiT baseline: a learned PE, trained through the classifier head, whose pooling probes and fine-tuning read (a
# fine-tune, this objective on a prepared checkpoint, records the pooling it fine-tuned with). It is the fine-tuning
# objective too: any PE mode, any modality (speech models fine-tune through it).
declare("supervised", config=SupervisedConfig, pos_embed="learned", pos_modes=PE_MODES, any_modality=True,
        needs_head=True, probe_feature="head", finetune_pool="head")

# §3: every position embedding is removed during pretraining; the class token (§3.1) enters without PE, so probes
# read the mean of the patch outputs of a sequence holding it, and fine-tuning puts "a linear classifier head after
# the cls token" (§3.3).
# Pretraining has no position information (§3): a relbias2d backbone would inject it inside attention. Other PE
# modes are accepted for the anchors (§4.3), which need the backbone's true PE (checked against anchor_ratio).
declare("mp3", config=MP3Config, pos_embed="none", pos_modes=("none", "sincos1d", "sincos2d", "learned"),
        any_modality=True, probe_feature="mean", finetune_pool="cls", curves="eta",
        paper="Zhai et al. 2022, Position Prediction as an Effective Pretraining Strategy (MP3)",
        display="MP3")
# §3.1, §4.3: speech keeps the true sinusoidal PE for its 5% anchors, and pretrains with full attention (eta 0).
declare("mp3_speech", config=MP3Config, pos_embed="sincos1d", any_modality=True, probe_feature="mean",
        finetune_pool="cls",
        modality="audio", defaults={"eta": 0.0, "anchor_ratio": 0.05}, display="MP3 speech",
        paper="Zhai et al. 2022, Position Prediction as an Effective Pretraining Strategy (MP3), §4.3")

# MAE's code: the fixed 2-D sin-cos PE; the encoder runs [CLS; visible] (its linear probe reads the class token);
# fine-tuning with --global_pool (its default), the average of the patch outputs through a fresh fc_norm.
declare("mae", config=MAEConfig, pos_embed="sincos2d", class_token="required", probe_feature="cls",
        finetune_pool="mean_fc_norm",
        display="MAE", paper="He et al. 2022, Masked Autoencoders Are Scalable Vision Learners")

# §3, official code (MAE's): the fixed 2-D sin-cos PE, kept by the class token (Eq. 3), so probes read it; fine-tuning
# follows MAE's code and its --global_pool (average pooling through a fresh fc_norm).
# the [CLS] token keeps its PE and drives attentive reconstruction (Eq. 9): it is required
declare("droppos", config=DropPosConfig, pos_embed="sincos2d", class_token="required", probe_feature="cls",
        finetune_pool="mean_fc_norm", curves="position_grid", display="DropPos",
        paper="Wang et al. 2023, DropPos: Pre-Training Vision Transformers by Reconstructing Dropped "
        "Positions")

# I-JEPA's and StoP's code: the fixed 2-D sin-cos PE. The context encoder never sees a class token: their linear
# probes read the average of its final-normed patch outputs (docs/design.md), and they fine-tune on average-pooled
# patch tokens. Their evaluations read the EMA target encoder (StoP's logistic_eval.py loads
# checkpoint['target_encoder'], as I-JEPA's released evaluations do): a checkpoint saves it as the backbone.
declare("ijepa", config=IJEPAConfig, pos_embed="sincos2d", class_token="unused", probe_feature="patch_mean",
        finetune_pool="mean", evaluated_encoder="target_encoder",
        display="I-JEPA", paper="Assran et al. 2023, Self-Supervised Learning from Images with a "
        "Joint-Embedding Predictive Architecture")
declare("stop", config=IJEPAConfig, pos_embed="sincos2d", class_token="unused", probe_feature="patch_mean",
        finetune_pool="mean", evaluated_encoder="target_encoder",
        defaults={"stop": True}, display="StoP",
        paper="Bar et al. 2024, Stochastic positional embeddings improve masked image modeling (StoP)")

# DeiT's recipe with labels: a learned, additive PE table (Eq. 3-5) and the classifier head, whose pooling probes
# read; MJP trains and fine-tunes that classifier on the class token.
# Eq. 3-5: an additive, per-position PE table (learned, or a fixed sincos2d one on which DAL cannot act)
declare("mjp", config=MJPConfig, pos_embed="learned", pos_modes=("learned", "sincos2d"), needs_head=True,
        probe_feature="head",
        finetune_pool="cls", display="MJP",
        paper="Ren et al. 2023, Masked Jigsaw Puzzle: A Versatile Position Embedding for Vision Transformers")

# §3-4: the fixed 2-D sin-cos PE; the encoder runs the patch tokens alone (no class token), and App. B.2 ("we
# directly use the averaged pooled feature out of the encoder for both fine-tuning and linear probing") probes and
# fine-tunes the mean of its patch outputs.
declare("randsac", config=RandSACConfig, pos_embed="sincos2d", class_token="unused",
        probe_feature="patch_mean", finetune_pool="mean", display="RandSAC",
        paper="Hua et al. 2022, Self-supervision through Random Segments with Autoregressive Coding (RandSAC)")
