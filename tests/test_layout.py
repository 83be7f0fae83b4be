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
            "export": ROOT / "export", "pipelines": ROOT / "pipelines", "research": ROOT / "research"}
LIBRARIES = ("data", "models", "objectives", "finetune", "export")  # plain PyTorch, with a tests/ folder each


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
    if top in OPTIONAL:
        return None
    if top == "patchplace":
        return "patchplace-" + module.split(".")[1]
    dists = _installed().get(top)
    if not dists:
        raise AssertionError(f"cannot tell which distribution provides {module!r}")
    return dists[0]


# Declared without being imported: runtime requirements of another dependency.
RUNTIME_ONLY = {"setuptools": "imagecorruptions imports pkg_resources, which setuptools >= 81 removed",
                "tensorboard": "Accelerate's TensorBoard tracker (run.tensorboard) writes the events with it",
                "s3fs": "patchplace-data[s3]: fsspec imports it for s3:// URLs (patchplace.data.stores)"}
# Imported only when installed, by code that measures them as an option.
OPTIONAL = {"kornia": "research/benchmarks/data.py times its crop as one more augmentation candidate"}


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
    # the pipelines' and the research code's tests are end to end: the repository's tests/
    for needed in ("pyproject.toml", "README.md", f"src/patchplace/{name}/__init__.py",
                   *(["tests"] if name in LIBRARIES else [])):
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
    """The libraries are plain PyTorch, the research code is a client of the pipelines: neither imports accelerate
    (nor do the dataset recipes)."""
    roots = [*(PACKAGES[n] / "src" for n in LIBRARIES), RESEARCH, PIPELINES / "datasets"]
    offenders = [str(p.relative_to(ROOT)) for d in roots for p in d.rglob("*.py")
                 if any(m.split(".")[0] == "accelerate" for m in _imports(p))]
    assert not offenders, f"only patchplace.pipelines may import accelerate: {offenders}"


# ------------------------------------------------------------------------------ patchplace.pipelines / .research
PIPELINES = ROOT / "pipelines" / "src" / "patchplace" / "pipelines"
RESEARCH = ROOT / "research" / "src" / "patchplace" / "research"
# the command lines: each a module with main(argv) -> exit code, and a script of that name in pipelines/ (or data/)
ENTRY_POINTS = {"patchplace.pipelines." + n for n in ("pretrain", "finetune", "evaluate", "demo")} | {
    "patchplace.research." + n for n in ("study", "controls", "benchmark")}
# Imports of an entry point allowed, each to run that entry point's main() in-process (or, for the pure step, to
# build pretrain.py's training from its public API): the demo's stages (one mixed precision for all of them) and
# the benchmark suites that time the pipelines end to end; and the recipe check, which reads each shipped at-scale
# config through the config class its command line builds (nothing run), and the loader_vs_step benchmark, which
# builds pretraining's loader from a shipped config the same way (nothing trained). The study runs its stages as
# processes of their own. Nothing else imports an entry point (no helper lives in one).
STAGES = {"patchplace.pipelines." + n for n in ("pretrain", "finetune", "evaluate")}
RUNS_MAIN = {"patchplace.pipelines.demo": STAGES, "patchplace.research.recipes": STAGES,
             "patchplace.research.benchmarks.loader_vs_step": {"patchplace.pipelines.pretrain"},
             "patchplace.research.benchmarks.pipelines": {"patchplace.pipelines.pretrain",
                                                          "patchplace.pipelines.finetune"}}


def package_modules(*roots: Path) -> dict[str, Path]:
    """{dotted module name (``patchplace.pipelines.engine``, ``patchplace.research.reproduction``): file}."""
    return {".".join(p.relative_to(root.parents[1]).with_suffix("").parts).removesuffix(".__init__"): p
            for root in roots for p in sorted(root.rglob("*.py"))}


def package_imports(*roots: Path) -> dict[str, set[str]]:
    """{module under ``roots``: the modules under ``roots`` it imports, at the top or inside a function}."""
    modules, graph = package_modules(*roots), {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.level or node.module):
                source = _absolute(name, path, node)
                found |= {f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _absolute(importer: str, path: Path, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` names, relative ones (``from .common import``) resolved from ``importer``."""
    if not node.level:
        return node.module
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def layout_offenders(graph: dict[str, set[str]], entry_points: set[str]) -> list[str]:
    """``importer -> imported (why)`` for every import across the roles that the layout does not allow: an entry
    point imported other than to run its main, the pipelines importing the research code."""
    offenders = []
    for importer, imported in sorted(graph.items()):
        for module in sorted(imported):
            if module in entry_points and module not in RUNS_MAIN.get(importer, set()):
                offenders.append(f"{importer} -> {module} (an entry point, not run through its main)")
            elif importer.startswith("patchplace.pipelines") and module.startswith("patchplace.research"):
                offenders.append(f"{importer} -> {module} (the pipelines never import their clients)")
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


def test_every_command_line_has_its_script():
    """Each entry point's script in pipelines/ (the documented ``python pipelines/<name>.py``) runs its module's
    main; the dataset recipes' in data/; nothing else sits there."""
    scripts = {p.stem for p in (ROOT / "pipelines").glob("*.py")}
    assert scripts == {m.rsplit(".", 1)[1] for m in ENTRY_POINTS}
    for script in (ROOT / "pipelines").glob("*.py"):
        assert "import main" in script.read_text() and len(script.read_text().splitlines()) < 12, script
    recipes = {p.stem for p in (PIPELINES / "datasets").glob("*.py")} - {"__init__"}
    assert {p.stem for p in (ROOT / "data").glob("*.py")} == recipes
    assert any((ROOT / "pipelines" / "configs").glob("*.yaml"))


def test_no_code_edits_sys_path():
    """Everything imports from installed packages: no sys.path edits, no top-level ``core`` / ``benchmarks`` /
    ``reproduction`` / ``data`` modules."""
    roots = [ROOT / "pipelines", ROOT / "research", ROOT / "tests", ROOT / "data", ROOT / "export",
             *(ROOT / "packages").iterdir()]
    offenders = [str(p.relative_to(ROOT)) for d in roots for p in d.rglob("*.py")
                 if "sys.path.insert" in p.read_text() or "sys.path.append" in p.read_text()]
    offenders.remove("tests/test_layout.py")  # (this test's own text)
    assert not offenders
    assert not [d for d in ("core", "benchmarks", "reproduction") if (ROOT / "pipelines" / d).exists()]
    assert not (ROOT / "data" / "__init__.py").exists()


def test_only_the_stage_runners_import_entry_points_and_pipelines_never_import_research():
    assert not layout_offenders(package_imports(PIPELINES, RESEARCH), ENTRY_POINTS)


def test_pipelines_and_research_have_no_import_cycles():
    graph = package_imports(PIPELINES, RESEARCH)
    assert {"patchplace.pipelines.engine", "patchplace.research.reproduction.runner"} <= set(graph)
    assert "patchplace.pipelines.evaluate" in graph["patchplace.pipelines.demo"]
    assert not import_cycles(graph)


def test_the_objectives_and_their_registry_import_no_cycle():
    """As timm's ``_registry.py``: the registry imports no objective (it finds them at run time), only the
    torch-free configs (configs.py, which imports nothing of the package) and declarations (declarations.py, which
    imports only the configs); the objectives' shared base (common.py) never imports the registry; relative imports
    count."""
    graph = package_imports(ROOT / "packages" / "objectives" / "src" / "patchplace" / "objectives")
    registry, common, configs, declared = ("patchplace.objectives.registry", "patchplace.objectives.common",
                                           "patchplace.objectives.configs", "patchplace.objectives.declarations")
    assert graph[registry] == {configs, declared} and graph[declared] == {configs} and not graph[configs]
    assert configs in graph[common]
    assert registry not in graph[common] and registry in graph["patchplace.objectives.mae"]
    assert not import_cycles(graph)


def test_the_layout_checks_catch_what_they_should(tmp_path):
    """A helper imported from an entry point, the pipelines importing the research code, and a cycle are reported;
    running a stage's main from the demo is not."""
    files = {"pipelines/pretrain.py": "from patchplace.pipelines import engine\n",
             "pipelines/evaluate.py": "from patchplace.pipelines.helpers import first_images\n",
             "pipelines/engine.py": "import json\nfrom patchplace.research.reproduction import plan\n",
             "pipelines/helpers.py": "def first_images():\n    from patchplace.pipelines import evaluate\n",
             "research/controls.py": "from patchplace.research.reproduction.plan import RUNS\n",
             "research/reproduction/__init__.py": "",
             "research/reproduction/plan.py": "from patchplace.pipelines.engine import start\n",
             "pipelines/demo.py": "from patchplace.pipelines import evaluate, pretrain\n",
             "research/reproduction/claims.py": "from patchplace.research.controls import random_key\n"}
    for name, text in files.items():
        path = tmp_path / "patchplace" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    graph = package_imports(tmp_path / "patchplace" / "pipelines", tmp_path / "patchplace" / "research")
    entry = {"patchplace.pipelines.pretrain", "patchplace.pipelines.evaluate", "patchplace.research.controls"}
    assert layout_offenders(graph, entry) == [
        "patchplace.pipelines.engine -> patchplace.research.reproduction.plan (the pipelines never import their "
        "clients)",
        "patchplace.pipelines.helpers -> patchplace.pipelines.evaluate (an entry point, not run through its main)",
        "patchplace.research.reproduction.claims -> patchplace.research.controls (an entry point, not run through "
        "its main)"]
    assert import_cycles(graph) == [["patchplace.pipelines.engine", "patchplace.research.reproduction.plan"],
                                    ["patchplace.pipelines.evaluate", "patchplace.pipelines.helpers"]]
