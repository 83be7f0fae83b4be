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
    ("data.auto_augment", "rand-m9-tfoo", "timm cannot read tfoo of a rand policy"),  # the default ops, silently
    ("model.overrides.depth", "1000000000000000000000000000000",  # "Overflow when unpacking long long"
     "model.overrides.depth=1000000000000000000000000000000 is beyond any model's size"),
    ("model.overrides", "{embed_dim: -100000000000000000000}", "model.overrides.embed_dim=-100000000000000000000"),
])
def test_a_value_that_would_train_otherwise_is_refused_naming_it(key, value, words):
    assert words in refusal({key: parse_yaml(value)})


def test_the_shipped_policies_and_timms_own_forms_are_accepted():
    for policy in ("rand-m9-mstd0.5-inc1", "rand-m9-n2-mstd0.5", "augmix-m5-w4-d2", "original-mstd0.5",
                   "rand-m15-mmax20"):
        assert build(PretrainConfig, {"data.auto_augment": policy}).data.auto_augment == policy


def timm_builds(policy: str) -> bool:
    """Whether timm's own parser builds ``policy`` (dispatched as timm.data.create_transform does)."""
    from timm.data.auto_augment import augment_and_mix_transform, auto_augment_transform, rand_augment_transform

    build_policy = rand_augment_transform if policy.startswith("rand") else \
        augment_and_mix_transform if policy.startswith("augmix") else auto_augment_transform
    try:
        build_policy(policy, {"translate_const": 100, "img_mean": (124, 116, 104)})
    except (AssertionError, ValueError, KeyError):
        return False
    return True


ACCEPTED = ["rand-m9-mstd0.5-inc1", "rand-n2-m9", "rand-m9-mstd101", "rand-p0.5", "rand-tweights", "rand-m9-t3aw",
            "rand-m15-mmax20", "rand-inc0", "augmix-m5-w4-d2", "augmix-a0.5-b1", "augmix-mstd0.5", "original",
            "originalr-mstd0.5", "v0", "v0r", "3a"]
TIMM_FAILS = ["rand-m9.5", "rand-w0", "rand-p.5", "rand-mmax20.5", "rand-mstd.5", "augmix-a.5", "augmix-d-1",
              "augmix-m9-x1", "random-m9", "v1"]
TIMM_SILENT = ["rand-mXX", "rand-m9-foo", "rand-tfoo", "rand-m99", "augmix-m11", "rand-m25-mmax20"]


def test_the_policy_grammar_agrees_with_timms_parser():
    """Accepted: timm builds it as written. Refused: timm fails on it (an AssertionError / ValueError at the first
    transform) or builds something else without a word (a section skipped, the default ops, a clamped magnitude)."""
    from patchplace.pipelines.sections import augment_problem

    assert [p for p in ACCEPTED if augment_problem(p) or not timm_builds(p)] == []
    assert [p for p in TIMM_FAILS if timm_builds(p) or not augment_problem(p)] == []
    assert [p for p in TIMM_SILENT if not timm_builds(p) or not augment_problem(p)] == []


def test_more_repeated_augmentations_than_a_batch_holds_are_refused():
    """(data.repeated_aug=16 at data.batch_size=4 trained on batches of one image's copies, silently)"""
    line = refusal({"data.repeated_aug": 16, "data.batch_size": 4})
    assert line.startswith("data.repeated_aug=16 copies of each image exceed data.batch_size=4"), line
    assert "set data.repeated_aug <= 4 or a larger data.batch_size" in line
    assert build(PretrainConfig, {"data.repeated_aug": 3, "data.batch_size": 3}).data.repeated_aug == 3


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


@pytest.mark.parametrize("args", [["data.batchsize=64"], ["optim.clip_grad=-1"], ["--config", "a", "--config", "b"],
                                  ["data.repeated_aug=16", "data.batch_size=4"], ["data.auto_augment=rand-m9.5"],
                                  ["model.overrides.depth=1" + "0" * 30]])
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
