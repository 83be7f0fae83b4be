"""One registry of methods, as timm's ``register_model``: each method is declared once, with its config class and
facts, in :mod:`.configs` (torch-free: ``--help``, the study's plan and the benchmark read it without importing an
objective), and its objective's file registers the class that trains it (:func:`register_method`); every caller
(pretraining, fine-tuning, evaluation, probes, model cards, benchmarks, the study, the tests) reads
:func:`get_method` / :func:`list_methods`.

    declare("mp3", config=MP3Config, pos_embed="none", probe_feature="mean", finetune_pool="cls", ...)  # configs.py
    @register_method("mp3")  # mp3.py
    class MP3(BackboneObjective): ...

A method is a name plus the facts about it that are not in its objective's code: the backbone's PE mode during
pretraining (and the modes it accepts), whether it trains through a classifier head, whether it needs, ignores or may
use the class token, the pooled feature probes read and the pooling its own fine-tuning protocol puts the head on, the
modality, the paper, config defaults that differ from the config class's (``stop`` = I-JEPA with ``stop=True``). The
declaration is the one place each fact is written: the objective's constructor reads them through
:meth:`~.common.BackboneObjective.setup_backbone`. Adding a method is its config and declaration in
:mod:`.configs`, one objective file under ``patchplace/objectives/`` (found by :func:`list_methods` without an import
elsewhere) and one YAML config for ``pipelines/pretrain.py``.

As timm's ``_registry.py``, this module imports no objective (it finds them by :func:`_discover`); the decorator
hands each class its specs (``method_specs``), so :mod:`.common` never imports the registry.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from typing import Any, TypeVar

from .configs import ObjectiveConfig, ObjectiveError
from .declarations import (
    CLASS_TOKEN,
    DECLARED,
    EVALUATED_ENCODERS,
    FINETUNE_POOLS,
    MODALITIES,
    PE_MODES,
    PROBE_FEATURES,
    MethodFacts,
)

__all__ = ["CLASS_TOKEN", "EVALUATED_ENCODERS", "FINETUNE_POOLS", "MODALITIES", "PE_MODES", "PROBE_FEATURES",
           "MethodSpec", "get_method", "list_methods", "method_names", "register_method", "registered",
           "spec_of", "unregister_method"]

T = TypeVar("T", bound=type)


@dataclass(frozen=True, eq=False)
class MethodSpec(MethodFacts):
    """A registered method: its declared facts (:class:`.configs.MethodFacts`) and the objective class that
    trains it."""

    objective_cls: type | None = None

    def build(self, backbone: Any, fields: Mapping[str, Any] | ObjectiveConfig | None = None):
        """The objective around ``backbone`` with :meth:`config` ``(fields)``: given fields or the config object."""
        return self.objective_cls(backbone, self.config(fields))


_METHODS: dict[str, MethodSpec] = {}
_discovered = False


def register_method(name: str, *, config: type | None = None, pos_embed: str | None = None,
                    **facts: Any) -> Callable[[T], T]:
    """Class decorator: registers method ``name`` trained by the decorated objective class, with the facts
    :func:`.configs.declare` gives it (or, for a method declared nowhere else, config class ``config``, ``pos_embed``
    and the other :class:`MethodSpec` fields as keywords); returns the class unchanged. One class may train several
    methods (decorators stacked); they must then agree on ``probe_feature`` and ``finetune_pool``, which the
    objective reports for its backbone."""
    if config is None:
        if name not in DECLARED:
            raise ObjectiveError(f"method {name!r} is not declared in patchplace.objectives.configs: declare it "
                                 "there, or register it with config= and pos_embed=")
        declared = DECLARED[name]
        facts = {f.name: getattr(declared, f.name) for f in dataclass_fields(declared)}
    else:
        facts = {"name": name, "config_cls": config, "pos_embed": pos_embed, **facts}

    def register(objective_cls: T) -> T:
        spec = MethodSpec(**facts, objective_cls=objective_cls)
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


def registered() -> dict[str, MethodSpec]:
    """The methods registered so far (no discovery: what :func:`.configs.known_methods` adds to the declared)."""
    return dict(_METHODS)


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
