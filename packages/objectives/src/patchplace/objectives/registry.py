"""One registry of methods, as timm's ``register_model``: each objective's own file declares, once, the methods it
trains with :func:`register_method`, and every caller (pretraining, fine-tuning, evaluation, probes, model cards,
benchmarks, the study, the tests) reads :func:`get_method` / :func:`list_methods`.

    @register_method("mp3", config=MP3Config, pos_embed="none", probe_feature="mean", finetune_pool="cls", ...)
    class MP3(BackboneObjective): ...

A method is a name plus the facts about it that are not in its objective's code: the backbone's PE mode during
pretraining (and the modes it accepts), whether it trains through a classifier head, whether it needs, ignores or may
use the class token, the pooled feature probes read and the pooling its own fine-tuning protocol puts the head on, the
modality, the paper, config defaults that differ from the config class's (``stop`` = I-JEPA with ``stop=True``). The
registration is the one place each fact is written: the objective's constructor reads them through
:meth:`~.common.BackboneObjective.setup_backbone`. Adding a method is one objective file under
``patchplace/objectives/`` (found by :func:`list_methods` without an import elsewhere) and one YAML config for
``pipelines/pretrain.py``.

As timm's ``_registry.py``, this module imports no objective (it finds them by :func:`_discover`); the decorator
hands each class its specs (``method_specs``), so :mod:`.common` never imports the registry.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

from .common import ObjectiveConfig, ObjectiveError

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

T = TypeVar("T", bound=type)


@dataclass(frozen=True, eq=False)
class MethodSpec:
    """What one method is (see the module docstring). ``probe_feature`` / ``finetune_pool`` are stated for the
    paper's backbone, which has a class token; :meth:`probe_feature_for` / :meth:`finetune_pool_for` give them on
    any backbone."""

    name: str
    objective_cls: type
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

    def build(self, backbone: Any, fields: Mapping[str, Any] | ObjectiveConfig | None = None):
        """The objective around ``backbone`` with :meth:`config` ``(fields)``: given fields or the config object."""
        return self.objective_cls(backbone, self.config(fields))

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


_METHODS: dict[str, MethodSpec] = {}
_discovered = False


def register_method(name: str, *, config: type, pos_embed: str, **facts: Any) -> Callable[[T], T]:
    """Class decorator: registers method ``name`` trained by the decorated objective class with config class
    ``config`` and the other :class:`MethodSpec` fields as keywords; returns the class unchanged. One class may
    train several methods (decorators stacked); they must then agree on ``probe_feature`` and ``finetune_pool``,
    which the objective reports for its backbone."""

    def register(objective_cls: T) -> T:
        spec = MethodSpec(name, objective_cls, config, pos_embed, **facts)
        known = _METHODS.get(name)
        if known is not None and _qualname(known.objective_cls) != _qualname(objective_cls):
            raise ObjectiveError(f"method {name!r} is already registered by {_qualname(known.objective_cls)}")
        for other in _METHODS.values():
            if other.objective_cls is objective_cls and other.name != name and _class_facts(other) != \
                    _class_facts(spec):
                raise ObjectiveError(f"methods {other.name!r} and {name!r} share {objective_cls.__name__}: they need "
                                     "the same probe_feature and finetune_pool (and class_token, needs_head, "
                                     "any_modality)")
        _METHODS[name] = spec  # a module imported again (importlib.reload) replaces its own
        # stacked decorators run bottom-up: prepending keeps the specs in source order (the first is the class's own)
        objective_cls.method_specs = (spec, *_own_specs(objective_cls, name))
        return objective_cls

    return register


def unregister_method(name: str) -> None:
    """Removes method ``name`` (a method registered for a while, e.g. by a test)."""
    spec = _METHODS.pop(name, None)
    if spec is not None:
        spec.objective_cls.method_specs = _own_specs(spec.objective_cls, name)


def get_method(name: str) -> MethodSpec:
    """The registered method ``name``; an unknown name raises :class:`ObjectiveError` listing the known ones."""
    _discover()
    if name not in _METHODS:
        raise ObjectiveError(f"unknown method {name!r}; known: {', '.join(sorted(_METHODS))}")
    return _METHODS[name]


def list_methods(modality: str | None = None) -> list[MethodSpec]:
    """Every registered method (of ``modality`` when given), by name."""
    _discover()
    return [spec for name, spec in sorted(_METHODS.items()) if modality in (None, spec.modality)]


def method_names(modality: str | None = None) -> list[str]:
    """The names of :func:`list_methods`."""
    return [spec.name for spec in list_methods(modality)]


def spec_of(objective_cls: type) -> MethodSpec | None:
    """The first method the objective class (or the nearest registered class it derives from) trains, as its file
    writes them; None when none."""
    return next(iter(getattr(objective_cls, "method_specs", ())), None)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _class_facts(spec: MethodSpec) -> tuple:
    """The facts every method of one objective class shares (the class applies them whatever the method)."""
    return (spec.probe_feature, spec.finetune_pool, spec.class_token, spec.needs_head, spec.any_modality,
            spec.evaluated_encoder)


def _own_specs(objective_cls: type, without: str) -> tuple[MethodSpec, ...]:
    """The specs registered on ``objective_cls`` itself (not inherited), less method ``without``."""
    return tuple(s for s in vars(objective_cls).get("method_specs", ()) if s.name != without)


def _discover() -> None:
    """Imports every module of this package once, so a method's file registers it without an import elsewhere."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    package = __name__.rpartition(".")[0]
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
        importlib.import_module(f"{package}.{module.name}")
