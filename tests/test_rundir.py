"""The run directory's modules and the Trainer's shape: calls go one way (the Trainer -> ``engine/rundir.py`` ->
``engine/checkpoints.py`` -> ``engine/protocol.py``, whose file protocol needs neither torch nor Accelerate), every
attribute of the Trainer is set in its ``__init__``, and pretraining's optimizer, built in the engine, is the one the
fine-tuning package builds (timm's parameter groups, the same lr and weight decay on every parameter)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from patchplace.finetune import build_optimizer, parameter_groups
from patchplace.models import create_model
from patchplace.objectives import get_method
from patchplace.pipelines.config import ConfigError
from patchplace.pipelines.engine import optim as engine_optim
from patchplace.pipelines.sections import OptimSection

ENGINE = Path(__file__).resolve().parents[1] / "pipelines" / "src" / "patchplace" / "pipelines" / "engine"
# each module of the run directory, and the engine modules it must never import (the way back up)
NEVER = {"protocol": {"rundir", "checkpoints", "trainer", "callbacks", "launch"},
         "checkpoints": {"rundir", "trainer", "callbacks"},
         "rundir": {"trainer", "callbacks"}}


def engine_imports(module: str) -> set[str]:
    """The ``patchplace.pipelines.engine`` modules ``module`` imports (any line of it)."""
    tree = ast.parse((ENGINE / f"{module}.py").read_text())
    names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    prefix = "patchplace.pipelines.engine."
    return {name[len(prefix):].split(".")[0] for name in names if name.startswith(prefix)}


@pytest.mark.parametrize("module", sorted(NEVER))
def test_the_run_directory_calls_only_downward(module):
    assert not engine_imports(module) & NEVER[module], f"engine/{module}.py imports {engine_imports(module)}"


def test_the_file_protocol_loads_without_torch_or_accelerate():
    # the engine package's __init__ imports the Trainer: the module file on its own
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('protocol', "
            f"{str(ENGINE / 'protocol.py')!r}); m = importlib.util.module_from_spec(spec); "
            "spec.loader.exec_module(m); print(sorted(x for x in ('torch', 'accelerate') if x in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_every_trainer_attribute_is_set_in_init():
    tree = ast.parse((ENGINE / "trainer.py").read_text())
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    where: dict[str, set[str]] = {}
    for method in (n for n in trainer.body if isinstance(n, ast.FunctionDef)):
        for node in ast.walk(method):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) else []
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        where.setdefault(t.attr, set()).add(method.name)
    late = sorted(name for name, methods in where.items() if "__init__" not in methods)
    assert not late, f"Trainer attributes first set outside __init__: {late}"
    assert "rundir" in where and not {"out", "log", "console", "command"} & set(where), "the run dir: one attribute"


def objective() -> torch.nn.Module:
    spec = get_method("mae")
    backbone = create_model("vit_micro", in_chans=1, img_size=28, patch_size=4, num_classes=0,
                            pos_embed=spec.pos_embed)
    return spec.objective_cls(backbone, spec.config({"decoder_dim": 32, "decoder_heads": 2, "decoder_depth": 1}))


@pytest.mark.parametrize("layer_decay", [None, 0.75])
def test_the_engines_optimizer_is_the_finetune_packages(layer_decay):
    model = objective()
    cfg = OptimSection(layer_decay=layer_decay, weight_decay=0.05, betas=(0.9, 0.95))
    ours = engine_optim.make_optimizer(model, cfg, lr=2e-3)
    theirs = build_optimizer(model, lr=2e-3, weight_decay=0.05, layer_decay=layer_decay, betas=(0.9, 0.95))
    assert type(ours) is type(theirs) and ours.defaults == theirs.defaults
    assert engine_optim.parameter_groups(ours, model) == parameter_groups(theirs, model)
    assert [(g["lr"], g["weight_decay"], [id(p) for p in g["params"]]) for g in ours.param_groups] == \
           [(g["lr"], g["weight_decay"], [id(p) for p in g["params"]]) for g in theirs.param_groups]
    if layer_decay:
        assert len({g["lr"] for g in ours.param_groups}) > 2, "layer decay gives the blocks their own lr"


def test_a_layer_decay_without_effect_is_one_line_naming_the_key():
    with pytest.raises(ConfigError, match=r"^optim.layer_decay: layer_decay=0.75 needs parameter groups: Linear "):
        engine_optim.make_optimizer(torch.nn.Linear(2, 2), OptimSection(layer_decay=0.75))
