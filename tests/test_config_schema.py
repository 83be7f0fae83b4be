"""The config sections' ranges and choices are declared once (``Annotated[..., Field(ge=..)]`` / ``Literal``) and
pydantic enforces them: every declared bound and choice of every command's sections refuses a value just outside
it in one line naming the key, the same line for a config file's value and a section built in code."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Annotated, Any, Literal

import pytest

from patchplace.pipelines import commands
from patchplace.pipelines.config import ConfigError, build, check
from patchplace.pipelines.sections import OptimSection

CONFIGS = (commands.PretrainConfig, commands.FinetuneConfig, commands.EvaluateConfig)


def outside(hint: Any) -> Any:
    """A value just outside the declared choices or bounds of a field's hint (None: it declares none)."""
    if type(None) in typing.get_args(hint):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is tuple:
        item = outside(typing.get_args(hint)[0])
        return None if item is None else [item]
    if typing.get_origin(hint) is Annotated:
        base, *meta = typing.get_args(hint)
        if typing.get_origin(base) is Literal:
            return "not-a-choice"
        for m in (m for a in meta for m in getattr(a, "metadata", [a])):
            for name, step in (("ge", -1), ("gt", 0), ("le", 1), ("lt", 0)):
                if hasattr(m, name):
                    return base(getattr(m, name) + step)
        return None
    return "not-a-choice" if typing.get_origin(hint) is Literal else None


def declared(cls: type, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, a value outside its declaration) of every field of ``cls`` that declares choices or bounds."""
    found = []
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            found += declared(hints[f.name], f"{prefix}{f.name}.")
        elif (value := outside(hints[f.name])) is not None:
            found.append((prefix + f.name, value))
    return found


CASES = list({key: value for cls in CONFIGS for key, value in declared(cls)}.items())


def test_the_sections_declare_their_checks():
    keys = {key for key, _ in CASES}
    assert len(keys) > 50 and {"data.batch_size", "optim.schedule", "run.seed", "eval.probe_layers",
                               "finetune.global_pool", "privacy.ratio", "model.attention"} <= keys


@pytest.mark.parametrize(("key", "value"), CASES)
def test_a_value_outside_a_declared_range_or_choice_is_one_line_naming_the_key(key, value):
    cls = next(c for c in CONFIGS if key in dict(declared(c)))
    with pytest.raises(ConfigError) as caught:
        build(cls, {key: value})
    message = str(caught.value)
    assert message.startswith(f"{key} must be ") and ", got " in message and "\n" not in message, message


def test_a_section_built_in_code_is_refused_with_the_line_a_config_file_gets():
    with pytest.raises(ConfigError) as from_file:
        build(commands.FinetuneConfig, {"optim.schedule": "linear"})
    with pytest.raises(ConfigError) as in_code:
        check(OptimSection(schedule="linear"))
    assert str(in_code.value) == str(from_file.value) == \
        "optim.schedule must be one of cosine, step, constant, got 'linear'"


def test_a_cross_field_check_keeps_its_own_line():
    with pytest.raises(ConfigError, match=r"^optim.schedule=step needs optim.step_every >= 1"):
        build(commands.PretrainConfig, {"optim.schedule": "step"})


@dataclass
class Inner:
    size: int = 1


@dataclass
class Plain:
    """Another package's config class (research's) that declares no pydantic config: strict all the same."""

    inner: Inner = field(default_factory=Inner)


def test_a_config_class_without_a_pydantic_config_is_strict_too():
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['inner.sise'\] \(did you mean "
                                          r"inner.size\?\); known: \['size'\]"):
        build(Plain, {"inner.sise": 2})
    with pytest.raises(ConfigError, match=r"inner.size: expected int, got '2'"):
        build(Plain, {"inner.size": "2"})
