"""``--help`` of the config-driven command lines: every field with the value that command line would run with
(:func:`help_values`), marked where ``--config`` or an override set it, and its meaning read from the config classes'
sources (:func:`field_docs`), fitted to the terminal (:func:`fit_lines`); :func:`parser` is the command's argparse
parser with that help."""

from __future__ import annotations

import argparse
import functools
import inspect
import io
import re
import textwrap
import tokenize
from collections.abc import Callable, Collection
from dataclasses import fields, is_dataclass
from typing import Any

from patchplace.data.helpformat import HELP_WIDTH, help_formatter
from patchplace.pipelines.config import (
    ConfigError,
    _leaf_fields,
    _within,
    build,
    command_args,
    given_values,
    one_line,
    unread_fields,
)

HELP_COLUMN = 44  # where a field's meaning starts in --help ("  section.field = value" before it)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """What each field of a dataclass means, read from its source (:func:`source_docs`); a subclass's words win."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            lines = inspect.getsource(klass).splitlines() if is_dataclass(klass) else None
        except (OSError, TypeError):
            lines = None
        docs.update(source_docs(lines, {f.name for f in fields(klass)}, klass.__doc__) if lines else {})
    return {k: v for k, v in docs.items() if v}


def source_docs(lines: list[str], names: Collection[str], docstring: str | None) -> dict[str, str]:
    """{field: meaning} of the fields ``names`` of a class whose source is ``lines``: the comment after the field
    (or the comment lines right above it), else a ``name``: text entry of the class ``docstring`` (the objectives'
    configs)."""
    comments, docs = {}, {}
    for token in tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0] - 1] = token.string.lstrip("#").strip()
    for i, line in enumerate(lines):
        match = re.match(r"\s+(\w+)\s*:", line)
        if not match or match.group(1) not in names or match.group(1) in docs:
            continue
        above, j = [], i - 1
        while j >= 0 and lines[j].strip().startswith("#"):
            above.insert(0, comments.get(j, ""))
            j -= 1
        docs[match.group(1)] = comments.get(i) if not line.strip().startswith("#") and comments.get(i) \
            else " ".join(above)
    for name, text in re.findall(r"``(\w+)``:\s*(.+?)(?=;\s*``|\.?\s*$|\.\s)", " ".join(
            (docstring or "").split()), flags=re.S):
        if name in names and not docs.get(name):
            docs[name] = text.strip()
    return docs


def describe(config: Any, prefix: str = "", sources: dict[str, str] | None = None) -> list[str]:
    """One --help entry (:func:`field_entry`) per field of ``config`` (a dataclass type or instance) with its
    value, where it comes from (``sources``: {dotted key: "from file" / "override"}) and what it means."""
    instance = config() if isinstance(config, type) else config
    return [field_entry(name, getattr(owner, f.name), field_docs(type(owner)).get(f.name),
                        source_of(sources or {}, name)) for name, owner, f in _leaf_fields(instance, prefix)]


def field_entry(name: str, value: Any, doc: str | None, source: str | None = None) -> str:
    """``  name = value  (source)`` and ``# doc`` beside it from :data:`HELP_COLUMN` (below the value when the
    value leaves no room), wrapped to :data:`HELP_WIDTH` columns, the doc's lines aligned under its first."""
    left = f"  {name} = {value!r}" + (f"  ({source})" if source else "")
    head = textwrap.wrap(left, HELP_WIDTH, subsequent_indent=" " * 6, break_on_hyphens=False) \
        if len(left) > HELP_WIDTH else [left]
    if not doc:
        return "\n".join(head)
    text = textwrap.wrap(doc, HELP_WIDTH - HELP_COLUMN - 3, break_on_hyphens=False)
    if len(head) == 1 and len(left) <= HELP_COLUMN:  # the meaning beside the value
        head, text = [f"{left:<{HELP_COLUMN}} # {text[0]}"], text[1:]
    return "\n".join([*head, *(f"{'':<{HELP_COLUMN}} # {t}" for t in text)])


def source_of(sources: dict[str, str], name: str) -> str | None:
    """Where the value of field ``name`` comes from: its own key, or (a mapping field such as ``model.overrides``)
    a key inside it."""
    return next((where for key, where in sources.items() if _within(key, name)), None)


def help_values(cls: type, argv: list[str]) -> tuple[Any, dict[str, str], str]:
    """What --help shows for this command line: (the ``cls`` instance its ``--config`` file and overrides give, not
    validated; {dotted key: "from file" / "override"} for every value they set; the header naming them). A file or
    override that does not load leaves the code defaults, and the header says why."""
    header = "config fields (override with section.field=value)"
    try:
        path, overrides = command_args(argv)
    except ConfigError as exc:  # (--config twice)
        return cls(), {}, f"{header}; the code defaults ({one_line(exc)}):"
    if not path and not overrides:
        return cls(), {}, header + ":"
    try:
        file, given = given_values(cls, path, overrides)
        config = build(cls, {**file, **given})
    except (OSError, ValueError, TypeError) as exc:
        what = " and ".join([*([f"--config {path}"] if path else []), *(["the overrides"] if overrides else [])])
        return cls(), {}, f"{header}; the code defaults ({what} not applied: {one_line(exc)}):"
    marks = [*([f'"(from file)" by --config {path}'] if path else []),
             *(['"(override)" by the command line'] if overrides else [])]
    sources = {**dict.fromkeys(file, "from file"), **dict.fromkeys(given, "override")}
    return config, sources, f"{header} with the values in force: the code defaults, changed where marked " \
                            f"{' and '.join(marks)}:"


def help_epilog(cls: type, argv: list[str]) -> str:
    """The config part of --help: every field a command reads with its value in force (:func:`help_values`) and
    meaning, its :func:`unread_fields`, then what the class adds for this command line (``help_fields(argv,
    config, sources)``, e.g. the chosen objective's fields with their values)."""
    config, sources, header = help_values(cls, argv)
    lines = [header, *describe(config, sources=sources)]
    if unused := unread_fields(cls):
        lines += ["", *textwrap.wrap("not read by this command (accepted, so that a shared config loads): "
                                     + ", ".join(unused), HELP_WIDTH, break_on_hyphens=False)]
    if hasattr(cls, "help_fields"):
        lines += cls.help_fields(argv, config, sources)
    return "\n".join(lines)


class HelpFormatter(help_formatter(argparse.RawDescriptionHelpFormatter)):  # type: ignore[misc]
    """Keeps the line breaks of the description and epilog and fits them to :data:`HELP_WIDTH` columns
    (:func:`fit_lines`)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(indent + line for line in fit_lines(text.splitlines(), HELP_WIDTH - len(indent)))


def fit_lines(lines: list[str], width: int = HELP_WIDTH) -> list[str]:
    """``lines`` fitted to ``width`` columns: a paragraph of prose with a longer line is filled again, a longer
    command example (an indented ``python`` / ``accelerate`` line) continues on the next after a backslash, another
    indented line wraps under itself; lines that fit are kept as they are."""
    out: list[str] = []
    paragraph: list[str] = []

    def flush() -> None:
        long = any(len(line) > width for line in paragraph)
        out.extend(textwrap.wrap(" ".join(paragraph), width, break_on_hyphens=False) if long else paragraph)
        paragraph.clear()

    for line in lines:
        if line.strip() and not line[0].isspace():  # prose: gathered into its paragraph
            paragraph.append(line)
            continue
        flush()
        indent = line[:len(line) - len(line.lstrip())]
        if len(line) <= width:
            out.append(line)
        elif re.match(r"\s+(python|accelerate|torchrun)\b", line):  # a command: still one after copy and paste
            command, _, comment = line.strip().partition("  #")
            if comment.strip():  # its comment above it: a backslash would not continue a comment
                out.append(f"{indent}# {comment.strip()}")
            parts = textwrap.wrap(command.strip(), width - 2, initial_indent=indent, subsequent_indent=indent + "    ",
                                  break_long_words=False, break_on_hyphens=False)
            out.extend([f"{part} \\" for part in parts[:-1]] + parts[-1:])
        else:
            out.extend(textwrap.wrap(line.strip(), width, initial_indent=indent, subsequent_indent=indent,
                                     break_on_hyphens=False))
    flush()
    return out


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose epilog is written by ``epilog_of()`` when help is asked for (it reads the --config
    file)."""

    epilog_of: Callable[[], str] | None = None

    def format_help(self) -> str:
        self.epilog = self.epilog if self.epilog is not None or self.epilog_of is None else self.epilog_of()
        return super().format_help()


def parser(cls: type, description: str, argv: list[str] | None = None) -> argparse.ArgumentParser:
    """``--config`` + overrides; ``--help`` lists every field the command reads with the value in force for this
    command line and its meaning, plus what the config class adds (:func:`help_epilog`)."""
    argv = list(argv or [])
    p = _Parser(description=description, formatter_class=HelpFormatter)
    p.epilog_of = lambda: help_epilog(cls, argv)
    p.add_argument("--config", help="YAML file, or a shipped config's name (pipelines/configs/*.yaml, e.g. "
                                    "mp3_fashion_mnist)")
    p.add_argument("overrides", nargs="*", help="section.field=value, e.g. data.batch_size=64 run.output=runs/x")
    return p
