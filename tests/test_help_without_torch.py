"""``--help`` of the command lines imports no torch (it took 19-42 s when torch, timm and torchvision loaded
first): each is run as a user runs it, in a subprocess with ``-X importtime``, and the modules it imported are
read back. The torch-free copies it reads (the objectives' fields from their source, the attack's fields, the
attention kernels, the export's choices) are held equal to the originals here."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "pipelines" / "configs"
HEAVY = ("torch", "timm", "torchvision", "accelerate")  # each takes seconds to import
# the command lines of the list, with a --config and an override where they take one
COMMANDS = {
    "pretrain": [str(ROOT / "pipelines/pretrain.py"), "--config", str(CONFIGS / "stop_fashion_mnist.yaml"),
                 "objective.sigma=0.5"],
    "finetune": [str(ROOT / "pipelines/finetune.py"), "--config", str(CONFIGS / "finetune_fashion_mnist.yaml"),
                 "run.seed=3"],
    "evaluate": [str(ROOT / "pipelines/evaluate.py"), "--privacy", "--config",
                 str(CONFIGS / "evaluate_fashion_mnist.yaml")],
    "export": ["-m", "patchplace.export"],
    "data": ["-m", "patchplace.data"],
}
# seconds: ~0.3 s on an idle 2-core EPYC; the bound leaves room for a loaded machine, far below torch's import
LIMIT_S = 6.0


def imported(result: subprocess.CompletedProcess) -> set[str]:
    """The top-level modules a ``-X importtime`` run imported."""
    return {m.group(1).split(".")[0] for m in re.finditer(r"^import time:.*\|\s*([\w.]+)\s*$", result.stderr, re.M)}


@pytest.mark.parametrize("command", COMMANDS, ids=list(COMMANDS))
def test_help_imports_no_torch(command, tmp_path):
    env = {**os.environ, "COLUMNS": "250"}
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-X", "importtime", *COMMANDS[command], "--help"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120, env=env)
    seconds = time.perf_counter() - start
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage:"), result.stdout[:500]
    heavy = sorted(set(HEAVY) & imported(result))
    assert not heavy, f"{command} --help imported {heavy}"
    assert seconds < LIMIT_S, f"{command} --help took {seconds:.1f} s"
    assert list(tmp_path.iterdir()) == [], "--help wrote files"


def test_pretrain_help_shows_the_method_in_force():
    """The objective fields come from the --config file's method, with the file's and the override's values."""
    result = subprocess.run([sys.executable, *COMMANDS["pretrain"], "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert "objective fields of method=stop" in result.stdout, result.stdout[-3000:]
    assert "objective.sigma = 0.5  (override)" in result.stdout
    assert "objective.predictor_dim = 96  (from file)" in result.stdout


def test_objective_fields_match_the_registered_configs():
    """The fields read from the objective files' source are each registered method's config: names, order,
    defaults (the registration's included) and a meaning for every one that documents itself."""
    from patchplace.objectives import get_method, method_names
    from patchplace.pipelines import objective_fields
    from patchplace.pipelines.config import field_docs

    assert objective_fields.methods(from_source=True) == objective_fields.methods()  # the registry's, imported
    read = objective_fields.methods(from_source=True)
    assert list(read) == method_names()
    for name in method_names():
        config = get_method(name).config()
        values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        assert list(read[name].defaults.items()) == list(values.items()), name
        assert read[name].docs == {k: v for k, v in field_docs(type(config)).items() if k in values}, name


def test_torch_free_copies_match_their_originals():
    """What --help reads instead of importing torch: the attack's fields in evaluate's privacy section (its own
    steps and tv_weight aside), the attention kernels, the export's choices."""
    from patchplace.export import choices, exporter
    from patchplace.finetune import AttackConfig
    from patchplace.models import ATTENTION_KERNELS
    from patchplace.pipelines import config
    from patchplace.pipelines.commands import PrivacySection

    attack = [(f.name, f.default) for f in dataclasses.fields(AttackConfig)]
    privacy = [(f.name, f.default) for f in dataclasses.fields(PrivacySection)][:len(attack)]
    assert [n for n, _ in privacy] == [n for n, _ in attack]
    assert [p for p in privacy if p[0] not in ("steps", "tv_weight")] == \
        [a for a in attack if a[0] not in ("steps", "tv_weight")]
    assert config.ATTENTION_KERNELS == ATTENTION_KERNELS
    assert (exporter.KINDS, exporter.SPEECH_INPUTS, exporter.DEFAULT_OPSET) == \
        (choices.KINDS, choices.SPEECH_INPUTS, choices.DEFAULT_OPSET)
