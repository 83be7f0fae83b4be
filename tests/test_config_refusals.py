"""Refusals a user meets before any training: each one line naming the key, exit 2, before torch is imported where
nothing but the config is wrong, and nothing accepted that would train other than asked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from patchplace.pipelines.commands import PretrainConfig
from patchplace.pipelines.config import ConfigError, build, command_args, given_values, parse_yaml

ROOT = Path(__file__).resolve().parents[1]


def refusal(given: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        build(PretrainConfig, given)
    return str(caught.value)


@pytest.mark.parametrize(("key", "value", "words"), [
    ("optim.clip_grad", "-1", "optim.clip_grad must be a norm > 0 (null: off), got -1"),  # flipped the gradient
    ("optim.clip_grad", "0", "optim.clip_grad must be a norm > 0"),
    ("optim.betas", "[0.9, 1.5]", "optim.betas must be a beta in [0, 1), got 1.5"),  # blamed on layer_decay
    ("data.auto_augment", "rand-mXX", "timm cannot read mXX of a rand policy"),  # trained at m10
    ("data.auto_augment", "rand-m99", "magnitude m99 is above timm's maximum 10"),  # clamped to 10
    ("data.auto_augment", "garbage", "timm's policies are rand, augmix"),  # timm's 40-line AssertionError
])
def test_a_value_that_would_train_otherwise_is_refused_naming_it(key, value, words):
    assert words in refusal({key: parse_yaml(value)})


def test_the_shipped_policies_and_timms_own_forms_are_accepted():
    for policy in ("rand-m9-mstd0.5-inc1", "rand-m9-n2-mstd0.5", "augmix-m5-w4-d2", "original-mstd0.5",
                   "rand-m15-mmax20"):
        assert build(PretrainConfig, {"data.auto_augment": policy}).data.auto_augment == policy


def test_an_unknown_key_names_the_key_it_was_probably_meant_to_be():
    line = refusal({"data.batchsize": 64})
    assert line.startswith("unknown config key(s) ['data.batchsize'] (did you mean data.batch_size?); known: [")
    assert "did you mean" not in refusal({"data.zzzzzz": 1})


@pytest.mark.parametrize("section", ["[{lr: 0.1}]", "5"])
def test_a_malformed_section_is_refused_also_when_an_override_sets_a_field_of_it(tmp_path, section):
    """(it was dropped silently: the run trained with the default lr and config.yaml said so)"""
    path = tmp_path / "bad.yaml"
    path.write_text(f"optim: {section}\n")
    for overrides in ([], ["optim.max_steps=2"]):
        with pytest.raises(ConfigError, match=r"^optim( \(in .*\))?: expected a mapping, got"):
            file, given = given_values(PretrainConfig, str(path), overrides)
            build(PretrainConfig, {**file, **given})


def test_config_given_twice_is_refused_not_the_first_ignored():
    with pytest.raises(ConfigError, match="--config is given 2 times"):
        command_args(["--config", "a.yaml", "--config", "b.yaml", "data.batch_size=4"])
    assert command_args(["--config", "a.yaml", "data.batch_size=4"]) == ("a.yaml", ["data.batch_size=4"])


@pytest.mark.parametrize("args", [["data.batchsize=64"], ["optim.clip_grad=-1"], ["--config", "a", "--config", "b"]])
def test_a_config_error_is_answered_before_torch_is_imported(args):
    code = ("import sys; from patchplace.pipelines.cli import main; rc = main('pretrain', sys.argv[1:]); "
            "print('torch' in sys.modules); sys.exit(rc)")
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                            timeout=120)
    assert result.returncode == 2 and result.stdout.strip() == "False", result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr


def test_a_tracker_named_alone_is_a_list_of_one_as_accelerate_takes_it():
    for value in ("tensorboard", ["tensorboard"]):
        assert build(PretrainConfig, {"run.log_with": value}).run.log_with == ("tensorboard",)
    assert build(PretrainConfig, {}).run.log_with == ()


def test_an_empty_config_file_or_a_folder_is_refused_not_run_as_the_defaults(tmp_path):
    (tmp_path / "empty.yaml").write_text("# nothing\n")
    with pytest.raises(ConfigError, match="is empty"):
        given_values(PretrainConfig, str(tmp_path / "empty.yaml"), [])
    with pytest.raises(ConfigError, match="is a folder"):
        given_values(PretrainConfig, str(tmp_path), [])
