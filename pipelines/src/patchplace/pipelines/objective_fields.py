"""The registered methods and their objective fields, read from the source of ``patchplace.objectives`` without
importing it (it imports torch): what ``pretrain.py --help`` lists, and the registrations' facts the study's plan
and the benchmark's options read (:data:`FACTS`). Each objective file registers its methods with
``@register_method("name", config=XConfig, defaults={...})`` above the objective class, and declares ``XConfig``
(a dataclass of literal defaults, their meaning in comments) in the same file (see patchplace.objectives.registry).
Where the package is imported already, its registry answers. tests/test_help_without_torch.py holds the two equal
for every method."""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from patchplace.pipelines.config import field_docs, source_docs

# the expressions a default may be written as: literals and arithmetic on them (e.g. ``20 / 300``)
_LITERAL_NODES = (ast.Expression, ast.Constant, ast.Tuple, ast.List, ast.Dict, ast.BinOp, ast.UnaryOp,
                  ast.operator, ast.unaryop, ast.Load)


@dataclass(frozen=True)
class MethodFields:
    """One registered method's objective fields: their defaults (the config class's, then the registration's)
    in declaration order, and what each means."""

    name: str
    defaults: dict[str, Any]
    docs: dict[str, str]
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)  # FACTS of its registration (MethodSpec's)


# the registration's facts read here (a keyword of ``register_method``; absent: MethodSpec's default, stated here)
FACTS = {"pos_embed": None, "needs_head": False, "modality": "image", "display": ""}


def _value(node: ast.expr, where: str) -> Any:
    """The value of a default written as a literal or arithmetic on literals."""
    tree = ast.Expression(node)
    if not all(isinstance(n, _LITERAL_NODES) for n in ast.walk(tree)):
        raise ValueError(f"{where}: a default that is not a literal ({ast.unparse(node)}): write it as one")
    return eval(compile(tree, where, "eval"), {"__builtins__": {}})  # literal nodes only (checked above)


def _config_fields(node: ast.ClassDef, lines: list[str], where: str) -> tuple[dict[str, Any], dict[str, str]]:
    """({field: default}, {field: meaning}) of a config dataclass's AST node (ClassVar annotations are no fields)."""
    defaults = {}
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None \
                and "ClassVar" not in ast.unparse(item.annotation):
            defaults[item.target.id] = _value(item.value, f"{where}: {node.name}.{item.target.id}")
    source = lines[node.lineno - 1:node.end_lineno]
    return defaults, source_docs(source, set(defaults), ast.get_docstring(node))


def _registrations(tree: ast.Module) -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """(method, config class name, registration defaults, :data:`FACTS`) of each ``@register_method`` in a module
    (an empty display is the method's name, as MethodSpec's)."""
    found = []
    for node in ast.walk(tree):
        for deco in getattr(node, "decorator_list", []):
            if not (isinstance(deco, ast.Call) and ast.unparse(deco.func).endswith("register_method")):
                continue
            keywords = {k.arg: k.value for k in deco.keywords}
            defaults = _value(keywords["defaults"], "register_method") if "defaults" in keywords else {}
            name = _value(deco.args[0], "register_method")
            facts = {k: _value(keywords[k], "register_method") if k in keywords else v for k, v in FACTS.items()}
            facts["display"] = facts["display"] or name
            found.append((name, ast.unparse(keywords["config"]), defaults, facts))
    return found


def methods(from_source: bool = False) -> dict[str, MethodFields]:
    """{method: its fields} of every registered method, by name: from the registry where patchplace.objectives is
    already imported (a method registered in-process included), else (or ``from_source``) from the source of the
    objective files in its folders."""
    if "patchplace.objectives" in sys.modules and not from_source:
        return _registered()
    spec = importlib.util.find_spec("patchplace.objectives")  # finds the package without running it
    found: dict[str, MethodFields] = {}
    for path in sorted(p for folder in spec.submodule_search_locations for p in Path(folder).glob("*.py")):
        found.update(_read(path))
    return dict(sorted(found.items()))


@functools.cache
def _read(path: Path) -> dict[str, MethodFields]:
    """The methods one objective file registers, with their fields."""
    text = path.read_text()
    if "register_method(" not in text:
        return {}
    tree, lines = ast.parse(text), text.splitlines()
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    found = {}
    for name, config, extra, facts in _registrations(tree):
        defaults, docs = _config_fields(classes[config], lines, path.name)
        found[name] = MethodFields(name, {**defaults, **extra}, docs, facts)
    return found


def _registered() -> dict[str, MethodFields]:
    """The registry's methods (patchplace.objectives imported) with their config's defaults and meanings."""
    from patchplace.objectives import get_method, method_names

    found = {}
    for name in method_names():
        spec = get_method(name)
        config = spec.config()
        defaults = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        docs = {k: v for k, v in field_docs(type(config)).items() if k in defaults}
        found[name] = MethodFields(name, defaults, docs, {k: getattr(spec, k) for k in FACTS})
    return found
