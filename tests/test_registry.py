"""The one registry of methods (``patchplace.objectives.registry``): what each registration states, that every
registered method has a config and shows in ``pretrain.py --help``, and that adding a method is one objective file
plus one YAML config — a throwaway method, from a file no module imports, pretrained by ``pretrain.py`` and accepted
by ``evaluate.py`` and ``finetune.py``."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from pipeline_args import TINY, img

import patchplace.objectives as objectives
from patchplace.models import load_pretrained
from patchplace.objectives import (
    IJEPA,
    MP3,
    MP3Config,
    ObjectiveError,
    get_method,
    list_methods,
    method_names,
    register_method,
    registry,
    unregister_method,
)
from patchplace.pipelines import (
    evaluate,
    finetune,
    pretrain,
)

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = ROOT / "pipelines" / "configs"

# The papers' own facts (docs/methods/*): PE mode during pretraining, trained through a classifier head, the feature
# probes read and the pooling of the method's own fine-tuning, on the pipelines' backbones (with a class token).
PAPERS = {  # method: (pos_embed, needs_head, probe feature, fine-tuning pooling, modality)
    "mp3": ("none", False, "mean", "cls", "image"),  # §3 no PE; §3.1 class token fed; §3.3 head on it
    "mp3_speech": ("sincos1d", False, "mean", "cls", "audio"),  # §4.3: 5% anchors keep the true sin PE
    # MAE's code: sin-cos PE; main_finetune.py's --global_pool (default): the patch mean through a fresh fc_norm
    "droppos": ("sincos2d", False, "cls", "mean_fc_norm", "image"),
    "mae": ("sincos2d", False, "cls", "mean_fc_norm", "image"),
    "ijepa": ("sincos2d", False, "patch_mean", "mean", "image"),  # class token never fed
    "stop": ("sincos2d", False, "patch_mean", "mean", "image"),
    "randsac": ("sincos2d", False, "patch_mean", "mean", "image"),  # App. B.2: the averaged pooled feature
    "mjp": ("learned", True, "cls", "cls", "image"),  # DeiT's learned PE table (Eq. 3-5) and classifier
    "supervised": ("learned", True, "cls", "cls", "image"),  # DeiT
}


class _Backbone:
    """What the spec reads of a backbone: its class token and its head's pooling."""

    def __init__(self, cls_token: bool, global_pool: str = "cls") -> None:
        self.cls_token = object() if cls_token else None
        self.config = type("Config", (), {"global_pool": global_pool})()


def test_the_registry_states_the_papers_facts():
    assert set(method_names()) >= set(PAPERS)
    for name, (pos_embed, needs_head, probe, pool, modality) in PAPERS.items():
        spec = get_method(name)
        with_cls = _Backbone(True)
        assert (spec.pos_embed, spec.needs_head, spec.probe_feature_for(with_cls), spec.finetune_pool_for(with_cls),
                spec.modality) == (pos_embed, needs_head, probe, pool, modality), name
        assert spec.config_cls.from_dict({}) is not None and isinstance(spec.config(), spec.config_cls)
    assert get_method("stop").config().stop and not get_method("ijepa").config().stop
    assert get_method("mp3_speech").config() == MP3Config.speech(), "MP3 §4.3: eta 0, 5% anchors"
    assert get_method("stop").objective_cls is IJEPA and get_method("mp3_speech").objective_cls is MP3
    assert [s.name for s in list_methods() if s.curves] == ["droppos", "mp3"]
    assert method_names("audio") == ["mp3_speech"]
    # on a backbone without a class token: MP3 averages the patch tokens alone, and fine-tunes on their average
    mp3, without = get_method("mp3"), _Backbone(False, "mean")
    assert (mp3.probe_feature_for(without), mp3.finetune_pool_for(without)) == ("patch_mean", "mean")
    assert get_method("supervised").probe_feature_for(without) == "mean", "a head's pooling"


def test_an_unknown_method_is_one_line_naming_the_known_ones():
    with pytest.raises(ObjectiveError) as err:
        get_method("nope")
    assert str(err.value) == f"unknown method 'nope'; known: {', '.join(method_names())}"


def test_registrations_that_contradict_are_refused():
    class Other(MP3):
        pass

    with pytest.raises(ObjectiveError, match=r"'mp3' is already registered by patchplace\.objectives\.mp3\.MP3"):
        register_method("mp3", config=MP3Config, pos_embed="none")(Other)
    with pytest.raises(ObjectiveError, match="share MP3: they need the same probe_feature and finetune_pool"):
        register_method("mp3_other", config=MP3Config, pos_embed="none", probe_feature="cls")(MP3)
    with pytest.raises(ObjectiveError, match=r"pos_embed must be one of .*, got 'rope'"):
        register_method("mp3_rope", config=MP3Config, pos_embed="rope")(Other)
    assert "mp3_other" not in method_names() and "mp3_rope" not in method_names()
    assert get_method("mp3").objective_cls is MP3


def test_every_registered_method_has_a_config_and_shows_in_pretrain_help(capsys):
    """A YAML config ``pipelines/configs/<method>_<data>.yaml`` that pretrains it, and ``--help`` lists it (and, with
    ``method=<name>``, its objective fields)."""
    for spec in list_methods():
        found = [p for p in CONFIGS.glob(f"{spec.name}_*.yaml") if yaml.safe_load(p.read_text()).get("method")
                 == spec.name]
        assert found, f"{spec.name}: no pipelines/configs/{spec.name}_<data>.yaml with method: {spec.name}"
        assert pretrain.PretrainConfig.help_fields([f"method={spec.name}"])[0].startswith(
            f"objective fields of method={spec.name} ")
    with pytest.raises(SystemExit):
        pretrain.main(["--help"])
    out = capsys.readouterr().out
    listed = " ".join(out.split("methods: ", 1)[1].split()).split(", ")
    assert listed == method_names(), out[-400:]


# ---------------------------------------------------------------------------------------------- a new method
THROWAWAY = '''
"""A throwaway method for the registry's test: each patch's mean intensity, regressed from the encoder's output."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import nn

from patchplace.objectives.common import BackboneObjective, ObjectiveConfig, check_positive, split_batch
from patchplace.objectives.registry import register_method


@dataclass
class ThrowawayConfig(ObjectiveConfig):
    weight: float = 1.0  # scale of the loss

    def validate(self, named=str) -> ThrowawayConfig:
        check_positive(named("weight"), self.weight)
        return self


@register_method("throwaway", config=ThrowawayConfig, pos_embed="sincos2d", probe_feature="cls",
                 finetune_pool="mean", paper="Nobody et al. 2099, A Throwaway Method", display="Throwaway")
class Throwaway(BackboneObjective):
    def __init__(self, backbone, config: ThrowawayConfig | None = None) -> None:
        super().__init__()
        self.backbone, self.config = backbone, (config or ThrowawayConfig()).validate()
        self.head = nn.Linear(backbone.embed_dim, backbone.config.in_chans)

    def forward(self, batch, progress: float | None = None) -> dict:
        x, _ = split_batch(batch)
        tokens = self.backbone.forward_features(x)[:, self.backbone.num_prefix_tokens:]
        target = F.avg_pool2d(x, self.backbone.config.patch_size).flatten(2).transpose(1, 2)
        return {"loss": self.config.weight * F.mse_loss(self.head(tokens), target)}
'''


@pytest.fixture
def throwaway(tmp_path, monkeypatch):
    """``throwaway.py`` written beside the package's modules (a folder of ``patchplace.objectives.__path__``),
    imported by nothing: the registry finds it. Unregistered after the test."""
    folder = tmp_path / "objectives"
    folder.mkdir()
    (folder / "throwaway.py").write_text(textwrap.dedent(THROWAWAY))
    monkeypatch.setattr(objectives, "__path__", [*objectives.__path__, str(folder)])
    monkeypatch.setattr(registry, "_discovered", False)
    try:
        yield get_method("throwaway")
    finally:
        unregister_method("throwaway")
        sys.modules.pop("patchplace.objectives.throwaway", None)


def test_a_method_is_one_objective_file_and_one_yaml(shards, tmp_path, throwaway, capsys):
    config = tmp_path / "throwaway_toy.yaml"
    config.write_text("method: throwaway\nobjective: {weight: 0.5}\noptim: {max_steps: 2}\n")
    with pytest.raises(SystemExit):
        pretrain.main(["--config", str(config), "--help"])
    out = capsys.readouterr().out
    assert "objective fields of method=throwaway" in out and "objective.weight = 0.5" in out
    assert "# scale of the loss" in out and "throwaway" in out.split("methods: ", 1)[1]

    pre = tmp_path / "pre"
    assert pretrain.main(["--config", str(config), *img(shards), *TINY, f"run.output={pre}"]) == 0
    backbone, metadata = load_pretrained(pre / "checkpoint")
    assert backbone.config.pos_embed == "sincos2d" and backbone.config.num_classes == 0, "its registration's PE"
    assert (metadata["method"], metadata["objective"]) == ("throwaway", {"weight": 0.5})
    assert (metadata["probe_feature"], metadata["finetune_pool"]) == ("cls", "mean")
    card = (pre / "checkpoint" / "README.md").read_text()
    assert "- **Method**: throwaway — Nobody et al. 2099, A Throwaway Method" in card

    ev = tmp_path / "ev"
    assert evaluate.main([*img(shards), "data.batch_size=8", "data.num_workers=0", "eval.probe_train_samples=16",
                          "eval.probe_epochs=1", "eval.max_eval_samples=8", f"run.output={ev}",
                          f"model.checkpoint={pre / 'checkpoint'}"]) == 0
    results = json.loads((ev / "results.json").read_text())
    assert results["probe_feature"] == "cls" and "linear_probe" in results

    ft = tmp_path / "ft"
    capsys.readouterr()
    assert finetune.main([*img(shards), *TINY, "optim.max_steps=2", "finetune.mixup=0", "finetune.cutmix=0",
                          f"model.checkpoint={pre / 'checkpoint'}", f"run.output={ft}"]) == 0
    assert "finetune.global_pool: mean (the checkpoint's finetune_pool: throwaway fine-tunes on average-pooled " \
           "patch tokens)" in capsys.readouterr().out
    tuned, tuned_metadata = load_pretrained(ft / "checkpoint")
    assert tuned.config.global_pool == "mean" and tuned_metadata["method"] == "finetune:throwaway"
    assert "Nobody et al. 2099" in (ft / "checkpoint" / "README.md").read_text(), "the card cites the pretraining's"


def test_the_registration_drives_the_backbone_set_up():
    """Each backbone fact is written once, in the registration: ``setup_backbone`` reads the PE modes, the class
    token (needed / never fed, so frozen), the modality and the head from it; the class carries its specs in source
    order (the first names it in errors), and an unregistered class is told to register."""
    from patchplace.models import create_model
    from patchplace.objectives import MAE, RandSAC, RandSACConfig
    from patchplace.objectives.common import BackboneObjective

    facts = {s.name: (s.class_token, s.pos_modes) for s in list_methods()}
    assert facts["mae"] == facts["droppos"] == ("required", ("sincos2d",))
    assert facts["ijepa"] == facts["stop"] == facts["randsac"] == ("unused", ("sincos2d",))
    assert facts["mjp"] == ("optional", ("learned", "sincos2d"))
    assert [s.name for s in IJEPA.method_specs] == ["ijepa", "stop"] and registry.spec_of(IJEPA).name == "ijepa"
    micro = {"in_chans": 1, "pos_embed": "sincos2d"}
    randsac = RandSAC(create_model("vit_micro", **micro), RandSACConfig(decoder_dim=32, decoder_heads=2))
    assert not randsac.backbone.cls_token.requires_grad and randsac.backbone.patch_embed.proj.weight.requires_grad
    with pytest.raises(ObjectiveError, match=r"^MAE needs a backbone with a class token \(class_token=True\)$"):
        MAE(create_model("vit_micro", class_token=False, global_pool="mean", **micro))
    with pytest.raises(ObjectiveError, match=r"MP3 needs a backbone with pos_embed in .*got 'relbias2d'"):
        MP3(create_model("vit_micro", in_chans=1, pos_embed="relbias2d"))
    with pytest.raises(ObjectiveError, match="class_token must be one of"):
        register_method("mp3_bad", config=MP3Config, pos_embed="none", class_token="sometimes")(MP3)

    class Loose(BackboneObjective):
        def __init__(self, backbone) -> None:
            super().__init__()
            self.config = self.setup_backbone(backbone, MP3Config())

    register_method("loose", config=MP3Config, pos_embed="sincos2d", class_token="unused", display="Loose")(Loose)
    try:
        with pytest.raises(ObjectiveError, match=r"Loose needs a backbone with pos_embed in \('sincos2d',\), got "
                                                 "'learned'"):
            Loose(create_model("vit_micro", in_chans=1, pos_embed="learned"))
        assert not Loose(create_model("vit_micro", **micro)).backbone.cls_token.requires_grad
    finally:
        unregister_method("loose")
    assert Loose.method_specs == () and "loose" not in method_names()
    with pytest.raises(ObjectiveError, match="Loose is not registered: decorate it with register_method"):
        Loose(create_model("vit_micro", **micro))


def test_every_registered_curve_is_one_evaluate_draws():
    """``MethodSpec.curves`` names the function of ``evaluate.CURVES`` that draws them (no isinstance dispatch)."""
    assert {s.name: s.curves for s in list_methods() if s.curves} == {"droppos": "position_grid", "mp3": "eta"}
    assert all(s.curves in evaluate.CURVES for s in list_methods() if s.curves)
