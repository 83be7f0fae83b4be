"""The config loader (pipelines/src/patchplace/pipelines/config.py): YAML 1.2 through ruamel.yaml, strict types
through pydantic, unknown keys named, a section given in part keeping its owner's defaults, and every shipped config
giving the values stored in tests/config_snapshot.json (written by tests/config_snapshot.py with the OmegaConf
loader these replaced: the same values, of the same Python types)."""

from __future__ import annotations

import pytest

from patchplace.pipelines.commands import EvaluateConfig, FinetuneConfig, PretrainConfig
from patchplace.pipelines.config import ConfigError, build, command_args, given_setting, given_values


def values(*overrides: str, cls: type = PretrainConfig):
    file, given = given_values(cls, None, list(overrides))
    return build(cls, {**file, **given})


@pytest.mark.parametrize(("override", "key", "expected"), [
    ("run.mixed_precision=no", ("run", "mixed_precision"), "no"),  # YAML 1.1 (PyYAML): False
    ("optim.lr=1e-3", ("optim", "lr"), 1e-3),  # PyYAML: the string "1e-3"
    ("run.seed=010", ("run", "seed"), 10),  # YAML 1.1: octal 8
    ("optim.betas=[0.9, 0.99]", ("optim", "betas"), (0.9, 0.99)),
    ("data.memory_budget_mb=2048", ("data", "memory_budget_mb"), 2048.0),
])
def test_yaml_1_2_values(override, key, expected):
    got = getattr(getattr(values(override), key[0]), key[1])
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize(("override", "message"), [
    ("run.resume=yes", "run.resume: expected bool, got 'yes'"),
    ("run.seed=1.5", "run.seed: expected int, got 1.5"),
    ("run.output=3", "run.output: expected str, got 3"),
    ("data.in_memory=3", "data.in_memory: expected bool | str, got 3"),
    ("optim=3", "optim: expected a mapping, got 3"),
    ("data.scale=[0.1, x]", "data.scale: expected tuple[float, float], got [0.1, 'x']"),
    ("data.bogus=1", "unknown config key(s) ['data.bogus']; known: ['auto_augment', "),
    ("model.overrides={depth: 1, depth: 2}", "key 'depth' is given twice (first at line 1; YAML would keep"),
])
def test_a_wrong_value_is_one_line_naming_its_key(override, message):
    with pytest.raises(ConfigError) as refused:
        values(override)
    assert str(refused.value).startswith(message) or message in str(refused.value), str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_section_given_in_part_keeps_its_owners_defaults_and_untouched_defaults_keep_their_objects():
    config = values("optim.max_steps=5")
    assert (config.optim.max_steps, config.optim.lr, config.optim.betas) == (5, 1.5e-3, (0.9, 0.95))
    assert type(config.data.memory_budget_mb) is int  # the class's 4096, as config.yaml has always shown it
    assert values("finetune.mixup=0", cls=FinetuneConfig).optim.layer_decay == 0.75


def test_a_shared_config_loads_where_a_command_reads_part_of_it():
    file, given = given_values(EvaluateConfig, None, ["model.preset=vit_tiny", "data.hflip=0.2", "run.seed=4"])
    assert build(EvaluateConfig, {**file, **given}).run.seed == 4 and not file and list(given) == ["run.seed"]


def test_command_line_settings_are_read_as_the_parser_reads_them(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("run: {mixed_precision: bf16}\n")
    assert command_args(["a.b=1", "--config", str(config), "c.d=2", "--help"]) == (str(config), ["a.b=1", "c.d=2"])
    assert given_setting(["--config", str(config)], "run.mixed_precision") == "bf16"
    assert given_setting([f"--config={config}", "run.mixed_precision=no"], "run.mixed_precision") == "no"
    assert given_setting(["x=1"], "run.mixed_precision") is None


def test_every_shipped_config_parses_as_the_snapshot_says():
    """Each shipped config read by each command's config class gives exactly what it gives in the stored snapshot
    (values and their Python types), where that class takes it."""
    import json
    from pathlib import Path

    from config_snapshot import snapshot

    stored = json.loads((Path(__file__).with_name("config_snapshot.json")).read_text())
    assert {k: v for k, v in snapshot().items() if not isinstance(v, str)} == stored
