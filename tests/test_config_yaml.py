"""One YAML library (ruamel.yaml) reads the configs and writes a run's config.yaml: the bytes PyYAML's
``safe_dump`` wrote (the reference: config.yaml files written before read and compare the same), the values read
back equal, and a stage's fingerprint reads its ``--config`` as the command does (a shipped config by name too)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from patchplace.pipelines import stages
from patchplace.pipelines.commands import EvaluateConfig, FinetuneConfig, PretrainConfig
from patchplace.pipelines.config import build, dump_yaml, given_values, parse_yaml, to_dict

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "pipelines" / "configs").glob("*.yaml"))


def _trees() -> list[dict]:
    trees = []
    for path in CONFIGS:
        for cls in (PretrainConfig, FinetuneConfig, EvaluateConfig):
            try:
                file, given = given_values(cls, str(path), [])
                trees.append(to_dict(build(cls, {**file, **given})))
            except ValueError:  # a config of another command
                continue
    return trees


def test_config_yaml_is_written_as_pyyaml_wrote_it_and_reads_back_equal():
    trees = _trees()
    assert len(trees) > 20
    odd = {"a": "no", "b": "off", "c": 1e-06, "d": [2.5e-07, 3e20, float("inf")], "e": (), "f": {}, "g": "x: y",
           "h": "2020-01-01", "i": "010", "j": "pipe:curl -s http://x/{000..009}.tar", "k": "null", "l": "é"}
    for tree in [*trees, odd]:
        text = dump_yaml(tree)
        assert text == yaml.safe_dump(tree, sort_keys=False)
        assert parse_yaml(text) == yaml.safe_load(text) == yaml.safe_load(yaml.safe_dump(tree))


def test_a_stage_fingerprints_a_shipped_config_by_name_as_by_path():
    path = CONFIGS[0]
    by_path = stages.config_fingerprint(["--config", str(path)])
    assert by_path and stages.config_fingerprint(["--config", path.stem]) == by_path
    assert stages.config_fingerprint(["optim.epochs=1"]) is None


def test_a_fingerprint_reads_yaml_1_2_as_the_command_does(tmp_path):
    one, other = tmp_path / "a.yaml", tmp_path / "b.yaml"
    one.write_text("run: {mixed_precision: no}\n")  # the string "no" (YAML 1.1: false)
    other.write_text("run: {mixed_precision: false}\n")
    assert stages.config_fingerprint(["--config", str(one)]) != stages.config_fingerprint(["--config", str(other)])
    with pytest.raises(ValueError, match="not found"):
        stages.config_fingerprint(["--config", str(tmp_path / "none.yaml")])
