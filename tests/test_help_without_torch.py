"""``--help`` of every entry point imports no torch (it took 17-42 s when torch, timm and torchvision loaded
first): the scripts (``python pipelines/<command>.py``: the training commands, the demo, the study, the controls,
the benchmark), the modules (``python -m patchplace.pipelines.<command>``, ``patchplace.research.<command>``,
``patchplace.research.recipes``, ``.emulated_bf16``, ``patchplace.models.convert``, ``patchplace.export``,
``patchplace.export.evaluate``, ``patchplace.data``), the dataset recipes (``python data/<recipe>.py``: also within
100 columns, a usage error in one line) and the console scripts (``patchplace-<command>``), each
run as a user runs it, in a subprocess with ``-X importtime``; the modules it imported are read back. A usage error
is argparse's, exit 2, before torch too. A module prints what its script prints, byte for byte. The torch-free
copies ``--help`` reads (the objectives' fields and registration facts from their source, the attack's fields, the
attention kernels, the export's choices, the benchmark's suites, the controls' probe features) are held equal to
the originals here."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "pipelines" / "configs"
HEAVY = ("torch", "timm", "torchvision", "accelerate")  # each takes seconds to import
PY = sys.executable
# the pipelines commands' arguments: a --config and an override where they take one
ARGS = {"pretrain": ["--config", str(CONFIGS / "stop_fashion_mnist.yaml"), "objective.sigma=0.5"],
        "finetune": ["--config", str(CONFIGS / "finetune_fashion_mnist.yaml"), "run.seed=3"],
        "evaluate": ["--privacy", "--config", str(CONFIGS / "evaluate_fashion_mnist.yaml")]}
SCRIPTS = tomllib.loads((ROOT / "pipelines" / "pyproject.toml").read_text())["project"]["scripts"]
# the other entry points: the demo and the research commands as scripts (pipelines/<name>.py, also as the module
# each runs) and modules alone
RESEARCH = {"study": "patchplace.research.study", "controls": "patchplace.research.controls",
            "benchmark": "patchplace.research.benchmark"}
MODULES = {"recipes": "patchplace.research.recipes", "emulated_bf16": "patchplace.research.emulated_bf16",
           "convert": "patchplace.models.convert"}
# the dataset recipes (python data/<recipe>.py): their options parse in patchplace.pipelines.datasets
RECIPES = sorted(p.stem for p in (ROOT / "data").glob("*.py"))


def console_script(name: str) -> list[str]:
    """The command line that runs console script ``name`` as pyproject.toml declares it (what pip's launcher in
    the environment's bin/ does, whether or not that launcher is up to date)."""
    module, function = SCRIPTS[name].split(":")
    return [PY, "-c", f"import sys; sys.argv[0] = {name!r}; from {module} import {function}; sys.exit({function}())"]


COMMANDS = {
    **{f"{c}.py": [PY, str(ROOT / "pipelines" / f"{c}.py"), *ARGS[c]] for c in ARGS},
    **{f"-m pipelines.{c}": [PY, "-m", f"patchplace.pipelines.{c}", *ARGS[c]] for c in ARGS},
    **{f"patchplace-{c}": [*console_script(f"patchplace-{c}"), *ARGS[c]] for c in ARGS},
    "-m export": [PY, "-m", "patchplace.export"],
    "-m export.evaluate": [PY, "-m", "patchplace.export.evaluate"],
    "-m data": [PY, "-m", "patchplace.data"],
    "demo.py": [PY, str(ROOT / "pipelines" / "demo.py")],
    "-m pipelines.demo": [PY, "-m", "patchplace.pipelines.demo"],
    "patchplace-demo": console_script("patchplace-demo"),
    **{f"{c}.py": [PY, str(ROOT / "pipelines" / f"{c}.py")] for c in RESEARCH},
    **{f"-m research.{c}": [PY, "-m", module] for c, module in RESEARCH.items()},
    **{f"-m {c}": [PY, "-m", module] for c, module in MODULES.items()},
    **{f"data/{r}.py": [PY, str(ROOT / "data" / f"{r}.py")] for r in RECIPES},
}
# the commands whose --help lists config fields (run.seed among them)
FIELD_LISTS = {*(f"{c}.py" for c in ARGS), *(f"-m pipelines.{c}" for c in ARGS), *(f"patchplace-{c}" for c in ARGS),
               "controls.py", "-m research.controls", "study.py", "-m research.study"}
# seconds: ~0.3 s on an idle 2-core EPYC; the bound leaves room for a loaded machine, far below torch's import
LIMIT_S = 6.0


def imported(result: subprocess.CompletedProcess) -> set[str]:
    """The top-level modules a ``-X importtime`` run imported."""
    return {m.group(1).split(".")[0] for m in re.finditer(r"^import time:.*\|\s*([\w.]+)\s*$", result.stderr, re.M)}


def run_traced(command: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    """``command`` run with ``-X importtime`` (its environment variable: console scripts too), and its seconds."""
    env = {**os.environ, "COLUMNS": "250", "PYTHONPROFILEIMPORTTIME": "1"}
    start = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120, env=env)
    return result, time.perf_counter() - start


def check_help(name: str, result: subprocess.CompletedProcess, seconds: float, cwd: Path) -> None:
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage:"), result.stdout[:500]
    if name in FIELD_LISTS:
        assert "\n  run.seed = " in result.stdout or "\n  seeds = " in result.stdout, result.stdout[-2000:]
    heavy = sorted(set(HEAVY) & imported(result))
    assert not heavy, f"{name} --help imported {heavy}"
    assert seconds < LIMIT_S, f"{name} --help took {seconds:.1f} s"
    assert list(cwd.iterdir()) == [], "--help wrote files"


@pytest.mark.parametrize("command", COMMANDS, ids=list(COMMANDS))
def test_help_imports_no_torch(command, tmp_path):
    check_help(command, *run_traced([*COMMANDS[command], "--help"], tmp_path), tmp_path)


def test_every_entry_point_is_covered():
    """A console script added to pyproject.toml, or a script added to pipelines/, is checked above."""
    assert set(SCRIPTS) <= set(COMMANDS)
    assert all(SCRIPTS[f"patchplace-{c}"] == f"patchplace.pipelines.cli:{c}" for c in ARGS)
    assert {p.name for p in (ROOT / "pipelines").glob("*.py")} <= set(COMMANDS)
    assert RECIPES and all(f"data/{r}.py" in COMMANDS for r in RECIPES)


# a usage error of each command that parses its arguments before torch: exit 2, argparse's line (or the usage)
USAGE_ERRORS = {"demo.py": (["--nosuch-flag"], "error: unrecognized arguments: --nosuch-flag"),
                "study.py": (["--jobs", "two"], "error: argument --jobs: invalid int value: 'two'"),
                "controls.py": (["--nosuch-flag"], "error: unrecognized arguments: --nosuch-flag"),
                "benchmark.py": (["--suite", "nosuch"], "error: argument --suite: invalid choice: 'nosuch'"),
                "-m research.study": (["--jobs", "two"], "error: argument --jobs: invalid int value: 'two'"),
                "-m recipes": (["--nosuch-flag"], "error: unrecognized arguments: --nosuch-flag"),
                "-m convert": (["x.pth"], "error: the following arguments are required: --from, --out"),
                "-m emulated_bf16": (["train"], "usage: python -m patchplace.research.emulated_bf16 {pretrain,"
                                                "finetune} ARGS... (--help: what it does)")}


@pytest.mark.parametrize("command", USAGE_ERRORS)
def test_usage_error_imports_no_torch(command, tmp_path):
    extra, line = USAGE_ERRORS[command]
    result, _ = run_traced([*COMMANDS[command], *extra], tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert line in result.stderr, result.stderr[-2000:]
    assert not set(HEAVY) & imported(result)
    assert list(tmp_path.iterdir()) == []


# a usage error of each recipe: (its arguments, the line it prints); one line, exit 2, before torch
RECIPE_ERRORS = {"cifar": ([], "error: the following arguments are required: --src"),
                 "fashion_mnist": (["--out", "s3://b/fm"], "error: argument --out: cannot write a split to s3://b/fm"),
                 "image_folder": (["--src", "x", "--workers", "two"], "error: argument --workers: invalid int value"),
                 "speech_commands": (["--src", "x", "--version", "3"], "error: argument --version: invalid choice"),
                 "spoken_keywords": (["--out", "x", "--jobs"], "error: argument --jobs: expected one argument")}


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_help_fits_and_imports_no_torch(recipe, tmp_path):
    """``python data/<recipe>.py --help``: exit 0 before torch (or numpy, or webdataset) loads, every line
    within 100 columns on a wide terminal (COLUMNS=250) and on none (argparse's 80)."""
    result, seconds = run_traced([*COMMANDS[f"data/{recipe}.py"], "--help"], tmp_path)
    check_help(f"data/{recipe}.py", result, seconds, tmp_path)
    assert not {"numpy", "webdataset"} & imported(result)
    assert f"usage: python data/{recipe}.py " in result.stdout
    narrow = subprocess.run([*COMMANDS[f"data/{recipe}.py"], "--help"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, env={k: v for k, v in os.environ.items() if k != "COLUMNS"})
    for text in (result.stdout, narrow.stdout):
        widest = max(text.splitlines(), key=len)
        assert len(widest) <= 100, f"{recipe}: {len(widest)} columns: {widest!r}"


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_usage_error_is_one_line_without_torch(recipe, tmp_path):
    extra, line = RECIPE_ERRORS[recipe]
    result, _ = run_traced([*COMMANDS[f"data/{recipe}.py"], *extra], tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [x for x in result.stderr.splitlines() if not x.startswith("import time:")]
    assert len(errors) == 1 and errors[0].startswith(f"python data/{recipe}.py: {line}"), errors
    assert not set(HEAVY) & imported(result)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["demo", *RESEARCH])
def test_module_answers_as_its_script(command):
    """``python -m <module>`` prints the --help of ``python pipelines/<command>.py``, byte for byte."""
    module = f"-m pipelines.{command}" if command == "demo" else f"-m research.{command}"
    env = {**os.environ, "COLUMNS": "250"}
    script, run = (subprocess.run([*COMMANDS[form], "--help"], cwd=ROOT, capture_output=True, text=True,
                                  timeout=120, env=env) for form in (f"{command}.py", module))
    assert script.returncode == 0, script.stderr[-2000:]
    assert (run.returncode, run.stdout, run.stderr) == (script.returncode, script.stdout, script.stderr)


@pytest.mark.parametrize("command", ARGS)
def test_installed_console_script(command, tmp_path):
    """The launcher pip wrote into the environment's bin/, when it runs what pyproject.toml declares (an
    environment installed before the declaration changed has launchers of the old target: reinstall)."""
    name = f"patchplace-{command}"
    launcher, (module, function) = Path(PY).parent / name, SCRIPTS[name].split(":")
    if not launcher.is_file() or f"from {module} import {function}\n" not in launcher.read_text():
        pytest.skip(f"{launcher} is missing or does not run {SCRIPTS[name]}: pip install -e pipelines")
    check_help(name, *run_traced([str(launcher), *ARGS[command], "--help"], tmp_path), tmp_path)


HELP_ARGS = [["--help"], ["-h", "--config", "nosuch.yaml"], ["--he", "run.seed=3"]]  # abbreviated, bad --config


@pytest.mark.parametrize("extra", HELP_ARGS, ids=["help", "missing-config", "abbreviated"])
@pytest.mark.parametrize("command", ARGS)
def test_module_help_is_the_scripts(command, extra):
    """``python -m patchplace.pipelines.<command>`` answers as ``python pipelines/<command>.py``: the same stdout,
    stderr and exit code, byte for byte, with a --config and overrides."""
    env = {**os.environ, "COLUMNS": "250"}
    script, module = (subprocess.run([*COMMANDS[form], *extra], cwd=ROOT, capture_output=True, text=True,
                                     timeout=120, env=env) for form in (f"{command}.py", f"-m pipelines.{command}"))
    assert script.returncode == 0, script.stderr[-2000:]
    assert (module.returncode, module.stdout, module.stderr) == (script.returncode, script.stdout, script.stderr)


def test_export_evaluate_usage_error_imports_no_torch(tmp_path):
    """The evaluator's arguments parse before torch loads: a usage error is argparse's, exit 2, in a blink."""
    result, _ = run_traced(COMMANDS["-m export.evaluate"] + ["model.onnx"], tmp_path)
    assert result.returncode == 2
    assert "error: the following arguments are required: --data" in result.stderr
    assert not set(HEAVY) & imported(result)


def test_pretrain_help_shows_the_method_in_force():
    """The objective fields come from the --config file's method, with the file's and the override's values."""
    result = subprocess.run([*COMMANDS["pretrain.py"], "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert "objective fields of method=stop" in result.stdout, result.stdout[-3000:]
    assert "objective.sigma = 0.5  (override)" in result.stdout
    assert "objective.predictor_dim = 96  (from file)" in result.stdout


def test_the_objectives_declarations_import_without_torch():
    """The objectives' configs and their methods' declarations (what --help, the study's plan and the benchmark
    read) load, build and validate without torch."""
    code = ("import sys; from patchplace.objectives import MP3Config, known_methods; "
            "assert known_methods()['stop'].config().stop and MP3Config(eta=0.5).validate(); "
            f"print(sorted(set(sys.modules) & set({HEAVY!r})))")
    result = subprocess.run([PY, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_every_declared_method_is_registered_with_its_declared_facts():
    """Each declared method is registered by an objective class (found by the registry's discovery), with the
    facts it was declared with; none is registered without a declaration."""
    from patchplace.objectives import list_methods
    from patchplace.objectives.declarations import DECLARED

    specs = {spec.name: spec for spec in list_methods()}
    assert set(specs) == set(DECLARED)
    for name, declared in DECLARED.items():
        assert specs[name].objective_cls is not None, name
        assert [getattr(specs[name], f.name) for f in dataclasses.fields(declared)] == \
            [getattr(declared, f.name) for f in dataclasses.fields(declared)], name


def test_torch_free_copies_match_their_originals():
    """What --help reads instead of importing torch: the attack's fields in evaluate's privacy section (its own
    steps and tv_weight aside), the attention kernels, the export's choices."""
    from patchplace.export import choices, exporter
    from patchplace.finetune import AttackConfig
    from patchplace.models import ATTENTION_KERNELS
    from patchplace.pipelines.commands import PrivacySection
    from patchplace.pipelines.sections import ATTENTION_KERNELS as COPY

    attack = [(f.name, f.default) for f in dataclasses.fields(AttackConfig)]
    privacy = [(f.name, f.default) for f in dataclasses.fields(PrivacySection)][:len(attack)]
    assert [n for n, _ in privacy] == [n for n, _ in attack]
    assert [p for p in privacy if p[0] not in ("steps", "tv_weight")] == \
        [a for a in attack if a[0] not in ("steps", "tv_weight")]
    assert COPY == ATTENTION_KERNELS
    assert (exporter.KINDS, exporter.SPEECH_INPUTS, exporter.DEFAULT_OPSET) == \
        (choices.KINDS, choices.SPEECH_INPUTS, choices.DEFAULT_OPSET)


def test_research_copies_match_their_originals():
    """What the research commands' --help reads instead of importing torch: the benchmark's suite names (the
    registered methods' facts it reads are held equal to the registry's by the objective fields' test above), the
    controls' probe features."""
    from patchplace.finetune import PROBE_FEATURES
    from patchplace.research import cli
    from patchplace.research.benchmarks import options
    from patchplace.research.benchmarks.suites import SUITES

    assert tuple(SUITES) == options.SUITES
    assert cli.PROBE_FEATURES == PROBE_FEATURES
