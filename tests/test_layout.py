"""Repository contracts of docs/design.md: layout, PEP 420 namespace, honest dependency declarations."""

from __future__ import annotations

import ast
import functools
import importlib
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"data": ROOT / "packages/data", "models": ROOT / "packages/models",
            "objectives": ROOT / "packages/objectives", "finetune": ROOT / "packages/finetune",
            "export": ROOT / "export"}


def _imports(source: Path) -> set[str]:
    """Modules imported by ``source`` (a .py file, or every .py file under a directory); relative ones excluded."""
    names = set()
    for file in [source] if source.is_file() else source.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text(), filename=str(file))):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
    return names


def _distribution(module: str) -> str | None:
    """Distribution that provides ``module`` (None for the standard library)."""
    top = module.split(".")[0]
    if top in sys.stdlib_module_names:
        return None
    if top == "patchplace":
        return "patchplace-" + module.split(".")[1]
    dists = _installed().get(top)
    if not dists:
        raise AssertionError(f"cannot tell which distribution provides {module!r}")
    return dists[0]


# Declared without being imported: runtime requirements of another dependency.
RUNTIME_ONLY = {"setuptools": "imagecorruptions imports pkg_resources, which setuptools >= 81 removed"}


@functools.cache
def _installed() -> dict[str, list[str]]:
    return packages_distributions()


# one import, two distributions: the ONNX Runtime extras ([cpu] / [gpu]) of patchplace-export
SAME_MODULE = {"onnxruntime-gpu": "onnxruntime"}


def _normalize(name: str) -> str:
    name = re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[; ]", name, maxsplit=1)[0]).lower()
    return SAME_MODULE.get(name, name)


def test_patchplace_is_a_pep420_namespace_everywhere():
    assert not [p for p in ROOT.rglob("patchplace/__init__.py") if ".venv" not in p.parts]
    assert getattr(importlib.import_module("patchplace"), "__file__", None) is None


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_package_layout(name):
    pkg = PACKAGES[name]
    for needed in ("pyproject.toml", "README.md", f"src/patchplace/{name}/__init__.py", "tests"):
        assert (pkg / needed).exists(), f"{pkg.relative_to(ROOT)} lacks {needed}"


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_package_is_installed_from_this_checkout(name):
    module = importlib.import_module(f"patchplace.{name}")
    assert Path(module.__file__).resolve().parent == PACKAGES[name] / "src" / "patchplace" / name


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_package_declares_exactly_what_it_imports(name):
    pkg = PACKAGES[name]
    project = tomllib.loads((pkg / "pyproject.toml").read_text())["project"]
    # an extra other than [test] declares a runtime dependency the user picks (e.g. export's ONNX Runtime [cpu] | [gpu])
    extras = [d for group, deps in project.get("optional-dependencies", {}).items() if group != "test" for d in deps]
    declared = {_normalize(d) for d in [*project.get("dependencies", []), *extras]}
    imported = {_normalize(d) for m in _imports(pkg / "src") if (d := _distribution(m))}
    imported.discard(_normalize(project["name"]))
    assert imported <= declared, f"{project['name']} imports but does not declare {sorted(imported - declared)}"
    unused = declared - imported - set(RUNTIME_ONLY)
    assert not unused, f"{project['name']} declares but never imports {sorted(unused)}"


def test_only_pipelines_import_accelerate():
    offenders = [str(p.relative_to(ROOT)) for d in [*PACKAGES.values(), ROOT / "data"] for p in d.rglob("*.py")
                 if any(m.split(".")[0] == "accelerate" for m in _imports(p))]
    assert not offenders, f"only pipelines/ may import accelerate: {offenders}"
