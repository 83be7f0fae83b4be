"""Installing a sub-package by its path alone: its local dependencies come with it (hatch context-formatted direct
references, docs/design.md#packaging), every documented ``pip install`` line runs as typed, and the same
dependencies become plain version requirements for publishable wheels."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
import tomllib
from test_extras import HEAVY, parse

ROOT = Path(__file__).resolve().parents[1]
LOCAL = {"patchplace-data": "packages/data", "patchplace-models": "packages/models",
         "patchplace-objectives": "packages/objectives", "patchplace-finetune": "packages/finetune",
         "patchplace-export": "export", "patchplace-pipelines": "pipelines", "patchplace-research": "research"}
SPEC = "PATCHPLACE_SIBLING_SPEC"
# hatchling and its build requirements, filled by `make setup`: what lets pip build the packages offline
WHEELHOUSE = Path(sys.prefix) / "wheelhouse"
DOCS = ["README.md", "docs/**/*.md", "packages/*/README.md", "export/README.md", "pipelines/README.md",
        "research/README.md"]


def requirement_name(requirement: str) -> str:
    """The distribution a requirement names (``patchplace-models{env:...}`` included)."""
    return re.split(r"[<>=!~ \[{@;]", requirement, maxsplit=1)[0]


def local_closure(name: str) -> set[str]:
    """The package and every local package it depends on, transitively."""
    deps = tomllib.loads((ROOT / LOCAL[name] / "pyproject.toml").read_text())["project"]["dependencies"]
    needed = {requirement_name(d) for d in deps} & set(LOCAL)
    return {name}.union(*(local_closure(d) for d in needed))


def readme_lines() -> dict[str, list[str]]:
    """{package: the arguments of its README install line}."""
    rows = re.findall(r"^\| `(patchplace-\w+)` \| `pip install ([^`]+)`", (ROOT / "README.md").read_text(), re.M)
    return {name: shlex.split(command) for name, command in rows}


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without pip settings, Python paths or the sibling switch, plus ``extra``."""
    drop = ("PIP_", "PYTHON", "VIRTUAL_ENV", SPEC)
    return {**{k: v for k, v in os.environ.items() if not k.startswith(drop)}, **extra}


def offline_env(**extra: str) -> dict[str, str]:
    """pip with no index and no configuration file: build requirements come from the wheelhouse only."""
    if not (WHEELHOUSE.is_dir() and any(WHEELHOUSE.glob("hatchling-*.whl"))):
        pytest.skip(f"no hatchling wheel in {WHEELHOUSE}: `make setup` downloads it")
    return clean_env(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(WHEELHOUSE), PIP_CONFIG_FILE=os.devnull,
                     PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_CACHE_DIR="1", **extra)


def test_the_readme_installs_each_package_by_its_path_alone():
    lines = readme_lines()
    assert set(lines) == set(LOCAL), "one line per sub-package"
    for name, args in lines.items():
        assert [re.sub(r"\[.*\]$", "", a).removeprefix("./") for a in args] == [LOCAL[name]], name


RESOLVED = ["patchplace-objectives", "patchplace-export"]


@pytest.fixture(scope="module")
def clean_slate_reports(tmp_path_factory) -> dict[str, tuple[int, str, Path]]:
    """{package: (pip's exit code, its stderr, its --report)} for each README line of :data:`RESOLVED`, resolved
    from a clean slate. The resolutions run side by side: each waits on a build environment per local package
    (pip subprocesses), so together they take little longer than the longer one."""
    folder = tmp_path_factory.mktemp("resolutions")
    started = {}
    for name in RESOLVED:
        report = folder / f"{name}.json"
        started[name] = (subprocess.Popen(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
             "--disable-pip-version-check", "--report", str(report), *readme_lines()[name]],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=clean_env()), report)
    done = {}
    for name, (process, report) in started.items():
        try:
            _, stderr = process.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        done[name] = (process.returncode, stderr, report)
    return done


@pytest.mark.slow
@pytest.mark.parametrize("name", RESOLVED)
def test_one_package_resolves_from_a_clean_slate_with_its_readme_line(name, clean_slate_reports):
    """What pip would install for the README line (``./export[cpu]``: the image-only export) from a clean slate,
    transitively: the package's local closure and no other local package, and none of the heavy distributions of
    the audio / corruption extras (tests/test_extras.py checks the declarations; this is what their dependencies
    bring). One resolution per package: each takes a minute or two (a build environment per local package)."""
    returncode, stderr, report = clean_slate_reports[name]
    assert returncode == 0, stderr[-2000:]
    resolved = {parse(item["metadata"]["name"])[0] for item in json.loads(report.read_text())["install"]}
    assert local_closure(name) <= resolved and {"torch", "timm"} <= resolved
    assert not (set(LOCAL) - local_closure(name)) & resolved, "no local package it does not need"
    assert not resolved & HEAVY, sorted(resolved & HEAVY)
    if name == "patchplace-export":
        assert "onnxruntime" in resolved and "onnxruntime-gpu" not in resolved, "[cpu]: one runtime"


def third_party_view(folder: Path) -> Path:
    """``folder`` filled with links to every entry of this venv's site-packages except patchplace's own."""
    folder.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if "patchplace" not in entry.name.lower():  # dists, editable .pth files and their finders
            (folder / entry.name).symlink_to(entry)
    return folder


@pytest.mark.slow
def test_the_design_card_command_installs_into_a_fresh_venv_offline(tmp_path):
    """``pip install packages/objectives`` into a fresh venv: patchplace-models comes along, built from its path."""
    env = offline_env()
    fresh = tmp_path / "fresh"
    # --without-pip: pip, and torch & co., come from the view of this venv's third-party packages (no network)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True, timeout=120)
    python = fresh / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True, env=env).stdout.strip())
    (site / "third_party.pth").write_text(f"{third_party_view(tmp_path / 'third_party')}\n")
    done = subprocess.run([python, "-m", "pip", "install", "packages/objectives"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    probe = ("import importlib.metadata as md, json, patchplace.models, patchplace.objectives\n"
             "print(json.dumps({'files': [patchplace.models.__file__, patchplace.objectives.__file__],\n"
             "  'dists': {d.metadata['Name']: json.loads(d.read_text('direct_url.json') or 'null')\n"
             "            for d in md.distributions() if d.metadata['Name'].startswith('patchplace')}}))")
    seen = json.loads(subprocess.run([python, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                                     check=True).stdout)
    assert all(Path(f).is_relative_to(site) for f in seen["files"]), seen["files"]
    assert set(seen["dists"]) == {"patchplace-models", "patchplace-objectives"}, "nothing else of ours"
    for name, direct_url in seen["dists"].items():
        assert direct_url["url"] == (ROOT / LOCAL[name]).as_uri(), name
        assert not direct_url.get("dir_info", {}).get("editable"), f"{name}: a copy, not an editable install"


def build_wheel(package: str, out: Path, **env: str) -> zipfile.ZipFile:
    """The wheel of ``package`` (a path under the root), built offline without its dependencies."""
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), package],
                          cwd=ROOT, env=offline_env(**env), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel)


def requires_dist(wheel: zipfile.ZipFile) -> list[str]:
    (metadata,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return Parser().parsestr(wheel.read(metadata).decode()).get_all("Requires-Dist")


@pytest.mark.slow
def test_wheels_require_siblings_by_path_and_for_an_index_by_version(tmp_path):
    local = build_wheel("packages/finetune", tmp_path / "local")
    published = build_wheel("packages/finetune", tmp_path / "index", **{SPEC: "==0.1.0"})
    for wheel in (local, published):  # the namespace package alone: no patchplace/__init__.py
        assert {n.split("/")[0] for n in wheel.namelist()} == {"patchplace", "patchplace_finetune-0.1.0.dist-info"}
        assert {n.rsplit("/", 1)[0] for n in wheel.namelist() if n.endswith(".py")} == {"patchplace/finetune"}
        assert "patchplace/finetune/__init__.py" in wheel.namelist()
    siblings = {"patchplace-models": "packages/models", "patchplace-objectives": "packages/objectives"}
    assert {r for r in requires_dist(local) if r.startswith("patchplace")} == {
        f"{name} @ {(ROOT / path).as_uri()}" for name, path in siblings.items()}
    assert {r for r in requires_dist(published) if r.startswith("patchplace")} == {
        f"{name}==0.1.0" for name in siblings}


@pytest.mark.slow
def test_make_setup_installs_editables_beside_the_sibling_references():
    """pip refuses an editable beside a direct reference to the same path (pypa/pip#10216): `make setup` empties
    the sibling spec, so siblings are required by name and the -e of the same command provides them."""
    assert f"\t{SPEC}= $(PIP) install" in (ROOT / "Makefile").read_text()
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "-q", "-e", "packages/models",
                           "-e", "packages/objectives"], cwd=ROOT, env=offline_env(**{SPEC: ""}),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


# pip options whose next argument is not a package: skipped; -e / --editable's next argument is a path: checked
OPTION_VALUES = {"-r", "--requirement", "-c", "--constraint", "-d", "--target", "-t", "-f", "--find-links", "-i",
                 "--index-url", "--extra-index-url", "-C", "--config-settings", "--prefix", "--root", "--report",
                 "--python-version", "--platform", "--implementation", "--only-binary", "--no-binary"}


def install_offenders(text: str) -> list[str]:
    """The ``pip install`` commands in ``text``'s code (fenced blocks, inline spans) that do not run as typed from
    the repository root: a local path without a slash (pip would fetch a PyPI project of that name), a path that
    does not exist, or one of our distribution names (not on PyPI)."""
    fenced = r"^```[^\n]*\n(.*?)^```"
    code = [*re.findall(fenced, text, re.M | re.S), *re.findall(r"`([^`]+)`", re.sub(fenced, "", text,
                                                                                        flags=re.M | re.S))]
    segments = [s for snippet in code for line in snippet.replace("\\\n", " ").splitlines()
                for s in re.split(r"&&|\|\||;|\|", line)]
    offenders = []
    for segment in segments:
        for match in re.finditer(r"\bpip3? install\b(.*)", segment):
            command = match.group(1)
            try:
                args = shlex.split(command, comments=True)
            except ValueError:
                offenders.append(f"pip install{command}: unbalanced quotes")
                continue
            skip_next = False
            for arg in args:
                if skip_next or arg.startswith("$"):
                    skip_next = False
                    continue
                if arg in OPTION_VALUES:
                    skip_next = True
                    continue
                if arg.startswith("-") or "://" in arg:
                    continue
                path = re.sub(r"\[[^\]]*\]$", "", arg)
                name = requirement_name(path)
                if "/" in path and not (ROOT / path).exists():
                    offenders.append(f"pip install{command}: {path} does not exist")
                elif "/" not in path and (ROOT / path).exists():
                    offenders.append(f"pip install{command}: {path} is local, write it with a slash (pip reads a "
                                     "bare name as a PyPI project)")
                elif "/" not in path and name.lower().replace("_", "-") in LOCAL:
                    offenders.append(f"pip install{command}: {name} is not on PyPI, install it by its path")
    return offenders


def test_every_documented_install_line_runs_as_typed():
    files = sorted({p for pattern in DOCS for p in ROOT.glob(pattern)})
    assert ROOT / "README.md" in files and ROOT / "docs/design.md" in files
    offenders = [f"{f.relative_to(ROOT)}: {o}" for f in files for o in install_offenders(f.read_text())]
    assert not offenders, "\n".join(offenders)


def test_the_install_line_check_catches_what_it_should():
    text = ("Run `pip install export` or `pip install 'export[cpu]'`, or\n```bash\npip install packages/nope "
            "torch==2.14.1 && pip install .\n```\n`pip install patchplace-models` `pip install -e packages/models "
            "'./export[test,cpu]' -d wheels`")
    bare = "is local, write it with a slash (pip reads a bare name as a PyPI project)"
    assert install_offenders(text) == [
        "pip install packages/nope torch==2.14.1 : packages/nope does not exist",
        f"pip install .: . {bare}",
        f"pip install export: export {bare}",
        f"pip install 'export[cpu]': export {bare}",
        "pip install patchplace-models: patchplace-models is not on PyPI, install it by its path",
    ]
