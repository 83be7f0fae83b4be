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
    # "{": a sibling's hatch context-formatted reference ("patchplace-models{env:...}", see the packages' pyproject)
    name = re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[; {@]", name, maxsplit=1)[0]).lower()
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


# ------------------------------------------------------------------------------------------------ pipelines/
PIPELINES = ROOT / "pipelines"
ENTRY_POINTS = {"pretrain", "finetune", "evaluate", "controls", "demo", "study", "benchmark", "harness_compare",
                "gpu_parts"}
MACHINERY = ("core", "reproduction", "benchmarks")  # the packages beside the entry points
# Imports of an entry point allowed, each to run that entry point's main() in-process: the study's stages, the
# benchmark suites that time the pipelines end to end, the demo's stages. Nothing else imports an entry point (no
# helper lives in one), and core/ imports only core/.
RUNS_MAIN = {"reproduction.runner": {"pretrain", "finetune", "evaluate", "controls"},
             "benchmarks.pipelines": {"pretrain", "finetune"},
             "demo": {"pretrain", "finetune", "evaluate"}}


def pipeline_modules(root: Path) -> dict[str, Path]:
    """{module name as the entry points import it (``pretrain``, ``core.engine``, ``core``): file} under ``root``."""
    return {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
            for p in sorted(root.rglob("*.py"))}


def pipeline_imports(root: Path) -> dict[str, set[str]]:
    """{module of ``root``: the modules of ``root`` it imports, at the top or inside a function}."""
    modules, graph = pipeline_modules(root), {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                          for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def layout_offenders(root: Path) -> list[str]:
    """``importer -> imported (why)`` for every import across the roles that the layout does not allow."""
    graph = pipeline_imports(root)
    entry_points = {name for name in graph if "." not in name and (root / f"{name}.py").is_file()}
    offenders = []
    for importer, imported in sorted(graph.items()):
        for module in sorted(imported):
            if module in entry_points and module not in RUNS_MAIN.get(importer, set()):
                offenders.append(f"{importer} -> {module} (an entry point, not run through its main)")
            elif importer.split(".")[0] == "core" and module.split(".")[0] != "core":
                offenders.append(f"{importer} -> {module} (core/ imports only core/)")
    return offenders


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle of ``graph`` found by depth-first search, each from its smallest module, sorted."""
    cycles, done, path = set(), set(), []

    def visit(module: str) -> None:
        if module in path:
            cycle = path[path.index(module):]
            first = cycle.index(min(cycle))
            cycles.add(tuple(cycle[first:] + cycle[:first]))
            return
        if module in done:
            return
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            visit(imported)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    return [list(c) for c in sorted(cycles)]


def test_pipelines_are_laid_out_by_role():
    """Entry points at the top of pipelines/, the machinery in packages whose docstring names each of its modules."""
    assert {p.stem for p in PIPELINES.glob("*.py")} == ENTRY_POINTS
    assert any((PIPELINES / "configs").glob("*.yaml"))
    for package in MACHINERY:
        init = PIPELINES / package / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        unnamed = [p.name for p in sorted(init.parent.glob("*.py")) if p.name != "__init__.py" and p.name not in doc]
        assert not unnamed, f"{init.relative_to(ROOT)}'s docstring does not name {unnamed}"


def test_only_the_stage_runners_import_entry_points_and_core_imports_only_core():
    assert not layout_offenders(PIPELINES)


def test_pipelines_have_no_import_cycles():
    graph = pipeline_imports(PIPELINES)
    assert {"core.engine", "reproduction.runner", "benchmarks.suites"} <= set(graph)  # the checker sees the packages
    assert "core.config" in graph["core.engine"] and "pretrain" in graph["reproduction.runner"]
    assert not import_cycles(graph)


def test_within_pipelines_only_core_imports_accelerate():
    offenders = [str(p.relative_to(ROOT)) for p in PIPELINES.rglob("*.py")
                 if p.parent.name != "core" and any(m.split(".")[0] == "accelerate" for m in _imports(p))]
    assert not offenders, f"accelerate is imported by core/ only (engine.py, rundir.py): {offenders}"


def test_the_layout_checks_catch_what_they_should(tmp_path):
    """A helper imported from an entry point, core/ importing another role, and a cycle are reported; running a
    stage's main from the study's runner is not."""
    files = {"pretrain.py": "from core import engine\n", "controls.py": "from reproduction.plan import RUNS\n",
             "evaluate.py": "from core.helpers import first_images\n", "core/__init__.py": "",
             "core/engine.py": "import json\nfrom reproduction import plan\n",
             "core/helpers.py": "def first_images():\n    import evaluate\n",
             "reproduction/__init__.py": "", "reproduction/plan.py": "from core.engine import start\n",
             "reproduction/runner.py": "import controls\nimport pretrain\n",
             "reproduction/claims.py": "from controls import random_key\nfrom patchplace.export.evaluate import main\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert layout_offenders(tmp_path) == [
        "core.engine -> reproduction.plan (core/ imports only core/)",
        "core.helpers -> evaluate (an entry point, not run through its main)",
        "reproduction.claims -> controls (an entry point, not run through its main)"]
    assert import_cycles(pipeline_imports(tmp_path)) == [["core.engine", "reproduction.plan"],
                                                         ["core.helpers", "evaluate"]]
