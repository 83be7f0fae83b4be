"""Installing one sub-package: the README's one-liners name exactly the local packages each one needs, and pip
resolves them from a clean slate (``--dry-run --ignore-installed``: nothing of this environment is reused)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
LOCAL = {"patchplace-data": "packages/data", "patchplace-models": "packages/models",
         "patchplace-objectives": "packages/objectives", "patchplace-finetune": "packages/finetune",
         "patchplace-export": "export"}


def local_closure(name: str) -> set[str]:
    """The package and every local package it depends on, transitively."""
    deps = tomllib.loads((ROOT / LOCAL[name] / "pyproject.toml").read_text())["project"]["dependencies"]
    needed = {re.split(r"[<>=!~ \[]", d)[0] for d in deps} & set(LOCAL)
    return {name}.union(*(local_closure(d) for d in needed))


def readme_lines() -> dict[str, list[str]]:
    """{package: the paths of its README install line}."""
    rows = re.findall(r"^\| `(patchplace-\w+)` \| `pip install ([^`]+)` \|$", (ROOT / "README.md").read_text(), re.M)
    return {name: command.split() for name, command in rows}


def test_the_readme_install_lines_name_exactly_the_local_packages_needed():
    lines = readme_lines()
    assert set(lines) == set(LOCAL), "one line per sub-package"
    for name, paths in lines.items():
        assert {p.removeprefix("./") for p in paths} == {LOCAL[n] for n in local_closure(name)}, name


@pytest.mark.parametrize("name", ["patchplace-objectives", "patchplace-export"])
def test_one_package_resolves_from_a_clean_slate_with_its_readme_line(name, tmp_path):
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--disable-pip-version-check", "--report", str(report), *readme_lines()[name]],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    resolved = {item["metadata"]["name"] for item in json.loads(report.read_text())["install"]}
    assert local_closure(name) <= resolved and {"torch", "timm"} <= resolved
    assert not (set(LOCAL) - local_closure(name)) & resolved, "no local package it does not need"


def test_one_package_alone_stops_at_its_local_dependency_as_the_readme_says():
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--disable-pip-version-check", "./packages/objectives"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and "No matching distribution found for patchplace-models" in done.stderr, \
        done.stderr[-2000:]
