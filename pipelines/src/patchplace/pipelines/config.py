"""The config machinery: a YAML file (``--config``: a path or a shipped config's name) + ``section.field=value``
overrides, read as YAML 1.2 by ruamel.yaml's safe loader (only true / false are bools: ``run.mixed_precision=no``
stays "no"; no object tags; each key once), into the config dataclasses (:mod:`patchplace.pipelines.sections`,
:mod:`patchplace.pipelines.commands`) as pydantic validates them strictly (:func:`build`). A refusal is one line
naming the key (:func:`problem`, :func:`read_yaml`, :func:`_checked`). ``--help`` (:func:`parser`) lists every field
with the value that command line would run with, marked where ``--config`` or an override set it, and its meaning.
A command that reads a training section in part declares its own smaller class and ``shares: ClassVar[dict[str,
type]]`` ({section: the training section class}): a shared config file loads, the fields it never reads
(:func:`unread_fields`) are accepted, ignored and named at the end of its --help."""

from __future__ import annotations

import argparse
import contextvars
import dataclasses
import difflib
import functools
import io
import json
import math
import operator
import re
import types
import typing
from collections.abc import Collection, Iterator
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import AllowInfNan, ConfigDict, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from ruamel.yaml import YAML
from ruamel.yaml.constructor import DuplicateKeyError
from ruamel.yaml.error import YAMLError
from ruamel.yaml.nodes import MappingNode, SequenceNode
from ruamel.yaml.representer import SafeRepresenter
from ruamel.yaml.resolver import VersionedResolver

# every section: pydantic checks values of the field's type (no coercion: "yes" is no bool), unknown keys refused
STRICT = ConfigDict(strict=True, extra="forbid")
FINITE = AllowInfNan(False)  # inf (YAML .inf) refused too
_BUILT = contextvars.ContextVar("built", default=False)  # set while :func:`validate` checks a built config


class ConfigError(ValueError):
    """A config file or override is wrong (names the key and what is expected)."""


@dataclass(frozen=True)
class Words:
    """How a bounded field's one-line message (:func:`field_problem`) names what it takes (``what``: "a
    probability"), a note after its range ("(0: off)") and the range itself where its bounds' digits would not
    say it (``span``); pydantic ignores it."""

    what: str = ""
    note: str = ""
    span: str = ""


def one_line(exc: BaseException) -> str:
    """The message of a user error on one line. A DataLoader worker's error comes back as "Caught DataError in
    DataLoader worker process 0. Original Traceback ...": its last line is the original message."""
    text = str(exc).strip()
    if "Original Traceback" in text:
        last = text.splitlines()[-1]
        text = last.split(": ", 1)[1] if ": " in last and "Error" in last.split(": ", 1)[0] else last
    return " ".join(text.split())


def check_path(key: str, path: str) -> None:
    """A :class:`ConfigError` for a path this file system cannot hold, before anything is created or read."""
    from patchplace.data.atomic import path_problem

    if problem := path_problem(key, path):
        raise ConfigError(problem)


def _yaml() -> YAML:
    return YAML(typ="safe", pure=True)  # YAML 1.2's core schema, plain values only, each key once


def parse_yaml(text: str) -> Any:
    """YAML 1.2 text of a config file or an override value."""
    return _yaml().load(text)


class _Quoting(VersionedResolver):
    """Writes YAML 1.1's booleans quoted (``'no'``, ``'off'``), so that a YAML 1.1 reader (PyYAML) reads them as
    strings too."""

    @property
    def processing_version(self) -> tuple[int, int]:
        return (1, 1)


def _float(representer: SafeRepresenter, value: float) -> Any:
    """A float as YAML 1.1 reads it too (``1.0e-06``: a mantissa with a dot)."""
    text = {math.inf: ".inf", -math.inf: "-.inf"}.get(value) or repr(value).lower()
    return representer.represent_scalar("tag:yaml.org,2002:float", text.replace("e", ".0e", 1) if "." not in text
                                        and "e" in text else text)


def dump_yaml(tree: Any) -> str:
    """``tree`` (plain values) as block YAML in its own key order: a run's ``config.yaml``, readable by any YAML
    reader (1.1 or 1.2) as the same values."""
    yaml = YAML(typ="safe", pure=True)
    yaml.default_flow_style, yaml.allow_unicode, yaml.Resolver = False, False, _Quoting
    yaml.sort_base_mapping_type_on_output = False  # type: ignore[assignment]
    yaml.representer.add_representer(float, _float)
    out = io.StringIO()
    yaml.dump(tree, out)
    return out.getvalue()


def read_yaml(text: str | bytes, what: str, fix: str) -> Any:
    """YAML ``text`` of a config file (bytes) or an override value, or one :class:`ConfigError` line naming
    ``what``, where its text is wrong (``line L, column C``: syntax, a key given twice, an object tag; bytes that
    are not UTF-8) and how to fix it (``fix`` for a syntax error)."""
    try:
        text = text.decode() if isinstance(text, bytes) else text
        return parse_yaml(text)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} is not UTF-8 text (byte {exc.start}): {fix}") from None
    except YAMLError as exc:
        error = exc
    problem = " ".join((getattr(error, "problem", None) or one_line(error)).split())
    mark = getattr(error, "problem_mark", None)
    if isinstance(error, DuplicateKeyError):  # YAML 1.2 requires it; PyYAML kept the last (stop, then mae: MAE)
        key = re.search(r'duplicate key "(.*?)" with', problem)
        key = key.group(1) if key else problem
        problem = f"key {key!r} is given twice ({_first_at(text, key, error.context_mark)}YAML would keep the " \
                  "last silently): keep one"
    elif problem.startswith("could not determine a constructor for the tag"):  # !!python/object and the like
        tag = problem.rsplit(" ", 1)[-1].strip("'").replace("tag:yaml.org,2002:", "!!")
        problem = (f"the tag {tag} would build an object, and a config holds plain values (numbers, strings, lists, "
                   "mappings): remove the tag")
    else:
        problem = f"not valid YAML ({problem}): {fix}"
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    raise ConfigError(f"{what}, {where}{problem}")


def _first_at(text: str, key: str, mapping: Any) -> str:
    """``first at line N; `` for the first ``key`` of the mapping that starts at mark ``mapping`` in ``text``."""
    nodes = [_yaml().compose(text)]
    while nodes:
        node = nodes.pop()
        if isinstance(node, MappingNode) and (node.start_mark.line, node.start_mark.column) == (
                mapping.line, mapping.column):
            line = next((k.start_mark.line + 1 for k, _ in node.value if k.value == key), None)
            return f"first at line {line}; " if line else ""
        nodes += [n for pair in node.value for n in pair] if isinstance(node, MappingNode) else \
            node.value if isinstance(node, SequenceNode) else []
    return ""


def _leaves(raw: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of a nested mapping's leaves (``{a: {b: 1}}`` -> ``{"a.b": 1}``; ``{}`` is a leaf)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        out.update(_leaves(value, f"{prefix}{key}.") if isinstance(value, dict) and value else {prefix + key: value})
    return out


def _within(key: str, prefix: str) -> bool:
    """Whether dotted ``key`` is ``prefix`` or lies under it."""
    return key == prefix or key.startswith(prefix + ".")


def _scalars(value: Any) -> list[Any]:
    """The values inside a list / mapping value, or the value itself."""
    if isinstance(value, list | tuple):
        return [s for v in value for s in _scalars(v)]
    return [s for v in value.values() for s in _scalars(v)] if isinstance(value, dict) else [value]


def unread_fields(cls: type) -> list[str]:
    """The fields (``section.field``) of the sections ``cls`` shares with other commands (``cls.shares``: {section:
    the training section class}) that its own, smaller section class lacks: accepted and ignored."""
    return [f"{section}.{f.name}" for section, shared in getattr(cls, "shares", {}).items()
            for f in fields(shared) if f.name not in {g.name for g in fields(_at(cls, section))}]


def shipped_configs() -> Path:
    """The folder of the shipped configs (in the installed package, else pipelines/configs/ of a checkout)."""
    from patchplace.pipelines import _configs  # at call time: as a path from the working directory now

    return _configs()


def config_path(name: str) -> Path:
    """``--config NAME``: an existing file first, else the shipped config of that name (``.yaml`` optional), so the
    console scripts find them from any folder; neither: one line listing the shipped names."""
    check_path("--config", name)
    if Path(name).is_file():
        return Path(name)
    if Path(name).is_dir():
        raise ConfigError(f"--config {name} is a folder: give a YAML file in it, or a shipped config's name")
    shipped = shipped_configs()
    for candidate in (shipped / name, shipped / f"{name}.yaml"):
        if Path(name).name == name and candidate.is_file():  # a bare name only: a path stays the user's path
            return candidate
    names = sorted(p.name for p in shipped.glob("*.yaml")) if shipped.is_dir() else []
    raise ConfigError(f"config file {name} not found, and no shipped config has that name; shipped ({shipped}): "
                      f"{', '.join(names) or 'none'}")


def command_args(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the ``--config`` file, the ``section.field=value`` overrides) of a command line, in any order, as
    :func:`parser` reads them (other options are left out); ``--config`` given twice is refused (argparse would
    keep the last silently)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config", action="append")
    p.add_argument("overrides", nargs="*")
    args, _ = p.parse_known_intermixed_args(argv)
    configs = args.config or [None]
    if len(configs) > 1:
        raise ConfigError(f"--config is given {len(configs)} times ({', '.join(configs)}): give one file, and "
                          "section.field=value overrides for the rest")
    return configs[0], [a for a in args.overrides if "=" in a]


def precheck(cls: type, argv: list[str]) -> None:
    """The refusals of ``cls``'s config that need no torch (the file, unknown keys, types and ranges): run before a
    command imports its heavy stack, so a typo is answered in a second."""
    file, given = given_values(cls, *command_args(argv))
    build(cls, {**file, **given})


def given_setting(argv: list[str], key: str) -> Any:
    """The value a command line gives dotted ``key`` (its override's, else its file's); None if neither does."""
    file, given = given_values(None, *command_args(argv))
    return {**file, **given}.get(key)


def given_values(cls: type | None, path: str | None, overrides: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """({dotted key: value} the ``--config`` file gives, the same for the overrides). An override replaces what the
    file gives at its key (a mapping as a whole); the :func:`unread_fields` of config class ``cls`` are left out."""
    file: dict[str, Any] = {}
    if path:
        path = str(config_path(path))
        raw = read_yaml(Path(path).read_bytes(), f"config file {path}", "fix the file")
        if raw is None:  # (it would run the command's defaults without a word)
            raise ConfigError(f"config file {path} is empty: give its sections (section: {{field: value}}), or "
                              "leave --config out to run the defaults")
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path}: expected a mapping (section: {{field: value}}), got {raw!r}")
        file = _checked(_leaves(raw), f" (in {path})")
    given: dict[str, Any] = {}
    for assignment in overrides:
        if "=" not in assignment:
            raise ConfigError(f"override {assignment!r} must look like section.field=value")
        key, text = assignment.split("=", 1)
        key = key.strip()
        for leaves, where in ((file, f" (in {path})"), (given, "")):
            for old in [k for k in leaves if _within(k, key) or _within(key, k)]:
                if old != key and _within(key, old) and not isinstance(leaves[old], dict):
                    # a section given as a scalar or a list: refused as it is without the override
                    raise ConfigError(f"{old}{where}: expected a mapping, got {leaves[old]!r}")
                del leaves[old]
        value = read_yaml(text, f"override {assignment!r}", "quote or fix the value")
        given.update(_checked(_leaves({key: value}), ""))
    unread = unread_fields(cls) if cls is not None else []
    file, given = ({k: v for k, v in leaves.items() if not any(_within(k, u) for u in unread)}
                   for leaves in (file, given))
    return file, given


def _checked(leaves: dict[str, Any], where: str) -> dict[str, Any]:
    """``leaves`` once no value is NaN (no field takes one: ``optim.lr: .nan`` reached the optimizer) and no string
    holds ``${`` outside a ``pipe:`` command (no interpolation: ``${data.train}/x`` would create a folder of that
    name; a shell expands ``${VAR}`` in a ``pipe:`` command)."""
    for key, value in leaves.items():
        for item in _scalars(value):
            if isinstance(item, float) and item != item:
                raise ConfigError(f"{key}{where}: .nan is not a value any field takes: give a number")
            if isinstance(item, str) and "${" in item and not item.startswith("pipe:"):
                raise ConfigError(f"{key}={item}{where}: ${{...}} interpolation is not expanded in a config (the "
                                  "text would be taken literally): write the value out (a shell variable is "
                                  "expanded in a pipe: command only)")
    return leaves


def load(cls: type, path: str | None, overrides: list[str]) -> Any:
    """YAML file (optional) + overrides -> the validated ``cls`` instance (:func:`build`, :func:`validate`)."""
    file, given = given_values(cls, path, overrides)
    config = build(cls, {**file, **given})
    validate(config, set(given))
    return config


def build(cls: type, given: dict[str, Any], prefix: str = "") -> Any:
    """The ``cls`` instance with the values ``given`` ({dotted key: value}) over the defaults of ``cls()`` (a
    section given in part keeps its owner's: ``optim.max_steps=5`` keeps pretraining's ``OptimSection(lr=1.5e-3)``),
    as pydantic validates it strictly (an int for a float and a list for a tuple aside: "yes" or 1 is no bool, 3 no
    str). A field nothing sets keeps its default object (pydantic would make a float field's 4096 4096.0). A
    refusal names a key as ``prefix`` + its place (``"objective."`` where ``cls`` is that section's class)."""
    for key, value in given.items():  # YAML's values pydantic's JSON lacks (a date) in a mapping field
        if any(not isinstance(v, bool | int | float | str | None) for v in _scalars(value)):
            raise ConfigError(prefix + _wrong(cls, key, given))
    values = dataclasses.asdict(cls())
    for key, value in given.items():
        *parents, name = key.split(".")
        place = values
        for part in parents:
            place[part] = place[part] if isinstance(place.get(part), dict) else {}
            place = place[part]
        place[name] = value
    config, default = _validated(cls, values, given, prefix), cls()
    for name, owner, f in _leaf_fields(config):
        if not any(_within(k, name) for k in given):
            setattr(owner, f.name, operator.attrgetter(name)(default))
    return config


def check(section: Any) -> None:
    """The checks ``section`` (a dataclass instance with a ``key`` such as "optim") declares, as :func:`build` runs
    them: for a section built in code (``OptimSection(schedule="step").validate()``); none for one :func:`build`
    validated (:func:`validate` of a built config: pydantic validates a config once)."""
    if not _BUILT.get():
        _validated(type(section), dataclasses.asdict(section), {}, f"{section.key}.")


def _validated(cls: type, values: dict[str, Any], given: dict[str, Any], prefix: str = "") -> Any:
    """``values`` as pydantic validates them into a ``cls`` (JSON, so that a list is taken for a tuple)."""
    try:
        return _adapter(cls).validate_json(json.dumps(values, default=str), strict=True)
    except ValidationError as exc:
        raise ConfigError(problem(cls, exc, given, prefix)) from None


@functools.cache
def _adapter(cls: type) -> TypeAdapter:
    """pydantic's validator of config class ``cls``: :data:`STRICT` where the class declares no pydantic config
    (another package's, e.g. research's); a section inside that declares none validates as its owner does."""
    if "__pydantic_config__" not in vars(cls):
        cls.__pydantic_config__ = STRICT
    return TypeAdapter(cls)


def validate(config: Any, given: Collection[str] = ()) -> None:
    """Every section's ``validate()`` of a config :func:`build` gave (what needs the file system or torch: the
    declared checks ran in :func:`build`), then its ``validate_overrides(keys)`` where it has one: the checks of
    what the command line set (``given``: the dotted keys of its overrides)."""
    token = _BUILT.set(True)
    try:
        _validate(config, given)
    finally:
        _BUILT.reset(token)


def _validate(config: Any, given: Collection[str]) -> None:
    for f in fields(config):
        if is_dataclass(value := getattr(config, f.name)):
            _validate(value, given)
    if hasattr(config, "validate"):
        config.validate()
    if hasattr(config, "validate_overrides"):
        config.validate_overrides(given)


def problem(cls: type, exc: ValidationError, given: dict[str, Any], prefix: str = "") -> str:
    """pydantic's first refusal of config class ``cls`` as one line naming the key (``prefix`` + its place):
    unknown keys all together with the section's fields; a cross-field check's own :class:`ConfigError`; a range
    or choice as :func:`field_problem` words it; a wrong type as ``key: expected <type>, got <value>``."""
    errors = exc.errors()
    unknown = list(dict.fromkeys(prefix + ".".join(map(str, e["loc"])) for e in errors
                                 if e["type"] == "unexpected_keyword_argument"))
    if unknown:
        section = _at(cls, unknown[0][len(prefix):].rpartition(".")[0])
        known = sorted(f.name for f in fields(section))
        close = [f"{key.rpartition('.')[0]}.{match[0]}" for key in unknown
                 if (match := difflib.get_close_matches(key.rpartition(".")[2], known, n=1))]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        return f"unknown config key(s) {unknown}{hint}; known: {known}"
    error = errors[0]
    if isinstance(cause := (error.get("ctx") or {}).get("error"), ConfigError):
        return str(cause)
    key = ""  # the field pydantic's location lies in (a tuple's item, a union's member: its field)
    for part in map(str, error["loc"]):
        if _at(cls, joined := f"{key}.{part}".lstrip(".")) is None:
            break
        key = joined
    if error["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number",
                         "literal_error"):
        return prefix + field_problem(_at(cls, key), key, error["input"])
    return prefix + _wrong(cls, key, given or {key: error["input"]})


def _at(cls: type, key: str, extras: bool = True) -> Any:
    """The type hint of dotted field ``key`` of config class ``cls`` (``Annotated`` kept with ``extras``; "":
    ``cls``); None where no section declares it (inside a mapping field, an unknown key)."""
    for part in filter(None, key.split(".")):
        cls = typing.get_type_hints(cls, include_extras=extras).get(part) if is_dataclass(cls) else None
    return cls


def field_problem(hint: Any, key: str, value: Any) -> str:
    """``key must be [what] <its choices or range> [note], got value``: the words of a field's declared
    ``Literal`` or ``Ge`` / ``Gt`` / ``Le`` / ``Lt`` bounds and :class:`Words` (of an item, for a tuple)."""
    args = typing.get_args(hint)
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
    hint = next(a for a in args if a is not type(None)) if optional else hint
    info = FieldInfo.from_annotation(typing.get_args(hint)[0] if typing.get_origin(hint) is tuple else hint)
    words = next((m for m in info.metadata if isinstance(m, Words)), Words(note="(a finite number)" * (
        FINITE in info.metadata)))
    note = words.note or ("(or null)" if optional else "")
    if typing.get_origin(info.annotation) is Literal:
        choices = ", ".join(map(str, typing.get_args(info.annotation)))
        return " ".join(filter(None, [f"{key} must be one of {choices}", note])) + f", got {value!r}"
    bounds = {name: getattr(m, name) for m in info.metadata for name in ("ge", "gt", "le", "lt") if hasattr(m, name)}
    low = f"[{bounds['ge']}" if "ge" in bounds else f"({bounds['gt']}" if "gt" in bounds else ""
    high = f"{bounds['le']}]" if "le" in bounds else f"{bounds['lt']})" if "lt" in bounds else ""
    if words.span or (low and high):
        span = words.span or f"in {low}, {high}"
    elif low:
        span = (">= " if low[0] == "[" else "> ") + low[1:]
    else:
        span = ("<= " if high[-1:] == "]" else "< ") + high[:-1] if high else ""
    return " ".join(filter(None, [f"{key} must be", words.what, span, note])) + f", got {value!r}"


def _wrong(cls: type, key: str, given: dict[str, Any]) -> str:
    """``key: expected <the field's type>, got <the value given>``."""
    hint = _at(cls, key, extras=False)
    expected = "a mapping" if is_dataclass(hint) else "a number, string, bool, list or mapping" if hint is None \
        else _type_text(hint)  # (None: inside a mapping field, a value YAML has and JSON lacks)
    value = given[key] if key in given else {k[len(key) + 1:]: v for k, v in given.items() if _within(k, key)}
    return f"{key}: expected {expected}, got {value!r}"


def _type_text(hint: Any) -> str:
    """A type hint as its source writes it (``float | None``, ``tuple[float, float]``)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join(_type_text(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) is not None or not hasattr(hint, "__name__"):
        return str(hint).replace("typing.", "")
    return "None" if hint is type(None) else hint.__name__


def _leaf_fields(config: Any, prefix: str = "") -> Iterator[tuple[str, Any, dataclasses.Field]]:
    """(dotted key, the section instance that holds it, its field) of every field of ``config`` that is no
    section, in declaration order."""
    for f in fields(config):
        if is_dataclass(value := getattr(config, f.name)):
            yield from _leaf_fields(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, config, f


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)
