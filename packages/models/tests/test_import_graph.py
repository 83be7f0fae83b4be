"""The modules of ``patchplace.models`` import one another one way (no import circle, counting imports
inside functions too), each imports alone in a fresh interpreter, and every public name stays importable."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import patchplace.models

PACKAGE = Path(patchplace.models.__file__).parent
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def _imports(module: str) -> set[str]:
    """Sibling modules ``module`` imports anywhere in its source (top level, functions, TYPE_CHECKING blocks)."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            absolute = node.level == 0 and (node.module or "").startswith("patchplace.models")
            if node.level == 1 or absolute:
                base = (node.module or "").removeprefix("patchplace.models").lstrip(".")
                if base:
                    found.add(base.split(".")[0])
                else:  # from . import hub
                    found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[2] for a in node.names if a.name.startswith("patchplace.models."))
    return found & set(MODULES)


def test_module_import_graph_has_no_cycle():
    graph = {m: _imports(m) for m in MODULES}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import circle: " + " -> ".join([*path[path.index(module):], module]))
        if module in done:
            return
        for dep in sorted(graph[module]):
            visit(dep, [*path, module])
        done.add(module)

    for module in MODULES:
        visit(module, [])
    # the layering the modules document: checkpoint files and timm's names know no model class
    assert "backbone" not in graph["hub"] | graph["timm_interop"] | graph["card"], graph
    assert "hub" in graph["backbone"], "the backbone saves / loads through hub (one way)"


# One fresh interpreter loads the third-party stacks the modules build on (torch, timm: nearly all of an import's
# CPU, ~6 s a module on 2 cores) and forks a child per module, which imports that module with none of patchplace's
# own modules loaded: an import circle or a missing sibling import fails there as in an interpreter of its own.
IMPORTER = """
import importlib, json, os, sys, traceback
import timm, torch  # noqa: F401
assert not [name for name in sys.modules if name.startswith("patchplace")], "the parent imports no patchplace"
failures = {}
for module in json.loads(sys.argv[1]):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module("patchplace.models." + module)
            code, text = 0, ""
        except BaseException:
            code, text = 1, traceback.format_exc()
        os.write(write, text.encode())
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        text = pipe.read().decode()
    status = os.waitpid(pid, 0)[1]
    if status or text:
        failures[module] = f"exit status {status}: {text}"
print(json.dumps(failures))
"""


@pytest.fixture(scope="module")
def import_failures() -> dict[str, str]:
    """{module: its traceback} for every module whose import alone fails."""
    run = subprocess.run([sys.executable, "-c", IMPORTER, json.dumps(MODULES)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_alone_in_a_fresh_interpreter(module, import_failures):
    assert module not in import_failures, import_failures.get(module, "")[-2000:]


def test_every_public_name_is_importable_from_the_package():
    for name in patchplace.models.__all__:
        assert getattr(patchplace.models, name) is not None, name
    from patchplace.models import adopt_timm, from_timm, load_pretrained, timm_transform  # moved or new
    from patchplace.models.hub import check_finite, update_metadata  # used by pipelines/evaluate.py and tests
    from patchplace.models.timm_interop import beit_kwargs, timm_kwargs, timm_layout

    assert all(callable(f) for f in (adopt_timm, from_timm, load_pretrained, timm_transform, check_finite,
                                     update_metadata, beit_kwargs, timm_kwargs, timm_layout))
