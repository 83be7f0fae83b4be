"""Each sub-package's suite stands alone: `pytest` inside the package, with only what its pyproject declares (no
optional stack, no sibling it does not depend on), collects every module and skips what needs the rest."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from test_install import LOCAL, ROOT, clean_env, local_closure, requirement_name

pytestmark = pytest.mark.slow  # a pytest process per package

# optional stacks: distribution -> the modules it provides
STACKS = {"onnx": {"onnx"}, "onnxscript": {"onnxscript", "onnx_ir"}, "onnxruntime": {"onnxruntime"},
          "onnxruntime-gpu": {"onnxruntime"}, "accelerate": {"accelerate"}}

# Loaded at start-up from PYTHONPATH: the path finder does not find the blocked modules, as if not installed
# (find_spec returns None, import raises ModuleNotFoundError).
BLOCKER = '''
import sys
from importlib.machinery import PathFinder

ABSENT = {absent!r}


class AbsentPathFinder(PathFinder):
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if any(fullname == m or fullname.startswith(m + ".") for m in ABSENT):
            return None
        return super().find_spec(fullname, path, target)


sys.meta_path[:] = [AbsentPathFinder if f is PathFinder else f for f in sys.meta_path]
'''

# per package: what runs after every module is collected (the tests of an optional stack, quick ones)
SELECTION = {"packages/data": ["-k", "onnx"], "packages/models": ["-k", "onnx or timm_preprocessing"],
             "packages/objectives": ["--collect-only"], "packages/finetune": ["--collect-only"]}


def absent_modules(package: str) -> set[str]:
    """The optional stacks and sibling packages ``package`` does not declare in its dependencies."""
    project = tomllib.loads((ROOT / package / "pyproject.toml").read_text())["project"]
    declared = {requirement_name(d) for d in project["dependencies"]}
    present = set().union(*(mods for stack, mods in STACKS.items() if stack in declared))
    stacks = set().union(*STACKS.values()) - present
    return stacks | {"patchplace." + n.removeprefix("patchplace-") for n in set(LOCAL) - local_closure(project["name"])}


def start_pytest(cwd: Path, args: list[str], absent: set[str], folder: Path) -> subprocess.Popen:
    """pytest in ``cwd`` with ``absent`` blocked (the blocker is written to ``folder``)."""
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(BLOCKER.format(absent=sorted(absent)))
    return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args], cwd=cwd,
                            env=clean_env(PYTHONPATH=str(folder)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(process: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = process.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def suites(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every package's run, started together (each mostly imports torch and collects: they share the cores)."""
    folder = tmp_path_factory.mktemp("blockers")
    started = {p: start_pytest(ROOT / p, SELECTION[p], absent_modules(p), folder / p.replace("/", "-"))
               for p in SELECTION}
    return {p: finish(process) for p, process in started.items()}


@pytest.mark.parametrize("package", sorted(SELECTION))
def test_package_suite_runs_with_only_what_the_package_declares(package, suites):
    assert {"onnxruntime", "accelerate"} <= absent_modules(package)
    done = suites[package]
    summary = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0 and "error" not in summary, done.stdout[-3000:] + done.stderr[-2000:]
    if SELECTION[package][0] == "-k":  # the optional stack's tests are there, and skip
        assert "passed" in summary or "skipped" in summary, summary
        assert "SKIPPED" in done.stdout and "failed" not in summary, done.stdout[-3000:]


def test_the_blocker_makes_a_top_level_import_of_an_absent_stack_fail(tmp_path):
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "test_uses_onnx.py").write_text("import onnx\n\n\ndef test_nothing():\n    pass\n")
    done = finish(start_pytest(tmp_path / "suite", [], {"onnx"}, tmp_path / "blocker"))
    assert done.returncode != 0 and "No module named 'onnx'" in done.stdout, done.stdout[-2000:]


def test_make_package_tests_runs_its_lanes_and_a_failing_suite_fails_make(tmp_path):
    """``make package-tests``' two lanes at once: a failing suite stops its own lane (the suite after it in that
    lane does not start), the other lane still runs to its end and is printed, and make exits non-zero; with every
    suite passing, make exits 0. (``-o setup``: the .venv as it is.)"""
    for name, check in (("failing", "1 + 1 == 3"), ("after", "True"), ("passing", "1 + 1 == 2")):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"test_{name}.py").write_text(f"def test_it():\n    assert {check}\n")
    failing, after, passing = (tmp_path / name for name in ("failing", "after", "passing"))

    def make(lanes: str) -> subprocess.CompletedProcess:
        return subprocess.run(["make", "--no-print-directory", "-o", "setup", "package-tests",
                               f"PACKAGE_LANES={lanes}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env=clean_env())

    failed = make(f'"{failing} {after}" {passing}')
    assert failed.returncode != 0, failed.stdout[-2000:]
    assert f"== {failing}: pytest" in failed.stdout and f"== {after}: pytest" not in failed.stdout, failed.stdout
    assert f"== {passing}: pytest" in failed.stdout and "1 failed" in failed.stdout and "1 passed" in failed.stdout
    passed = make(f'"{passing} {after}" {passing}')
    assert passed.returncode == 0, passed.stdout[-2000:] + passed.stderr[-2000:]
    assert passed.stdout.count("1 passed") == 3, passed.stdout
