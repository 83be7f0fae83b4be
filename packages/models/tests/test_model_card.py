"""Hub-grade model cards — YAML front matter with license, the base model of a fine-tune and a
``model-index`` (task, dataset with the split the metrics were measured on, metrics) that huggingface_hub's own
parser reads; the body's metrics table names the split; a pretraining checkpoint's card shows its objective's
metrics."""

from __future__ import annotations

import pytest
import yaml
from huggingface_hub import ModelCard

from patchplace.models import create_model, save_pretrained, update_metadata

SHA = "sha256:" + "ab" * 32
DATA = {"normalization": {"mean": [0.286], "std": [0.353]}, "modality": "image", "pad_to": 32, "img_size": None,
        "native_size": [28, 28], "data": {"dataset": "fashion_mnist", "fingerprint": "f00"}}


def _card(directory):
    text = (directory / "README.md").read_text()
    assert text.startswith("---\n")
    front, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(front), body, text


def _finetune(tmp_path, **extra):
    """A fine-tuned checkpoint with the metadata finetune.py + engine.py write (split: data.val's last part)."""
    model = create_model("vit_micro", img_size=32, patch_size=4, in_chans=1, num_classes=3)
    metadata = {"method": "finetune:mp3", "pretrained": SHA, "pretrained_from": "runs/mp3/checkpoint",
                "pretrain_metadata": {"method": "mp3", "step": 500}, "classes": list("abc"), **DATA, "step": 100,
                "recipe": {"optim": {"lr": 1e-3}}, "metrics": {"top1": 0.9, "top5": 0.99, "count": 10000},
                "metrics_split": "test", **extra}
    return save_pretrained(model, tmp_path / "ft", metadata=metadata)


def test_finetune_card_front_matter_has_license_base_model_and_model_index_with_split(tmp_path):
    directory = _finetune(tmp_path)
    front, body, text = _card(directory)
    assert front["license"] == "apache-2.0" and front["library_name"] == "patchplace"
    assert front["pipeline_tag"] == "image-classification" and front["datasets"] == ["fashion_mnist"]
    # a local checkpoint is not a Hub model id (the Hub refuses such a base_model): recorded beside it
    assert "base_model" not in front
    assert front["base_model_local"] == {"checkpoint": "runs/mp3/checkpoint", "weights": SHA, "method": "mp3",
                                         "step": 500}
    (entry,) = front["model-index"]
    (result,) = entry["results"]
    assert result["task"]["type"] == "image-classification"
    assert result["dataset"] == {"name": "fashion_mnist", "type": "fashion_mnist", "split": "test"}
    assert {m["type"]: m["value"] for m in result["metrics"]} == {"accuracy": 0.9, "top_5_accuracy": 0.99}
    assert all(m["name"] for m in result["metrics"]), "metrics carry a readable name"
    hub = ModelCard(text).data  # the Hub client's own parser
    assert hub.license == "apache-2.0"
    assert {(r.metric_type, r.dataset_split, r.metric_value) for r in hub.eval_results} == {
        ("accuracy", "test", 0.9), ("top_5_accuracy", "test", 0.99)}
    assert "| metric | value | split |" in body and "| top1 | 0.9 | test |" in body and "| top5 | 0.99 | test |" in body
    assert "on the `test` split of fashion_mnist (10000 samples)" in body
    assert "- **Base model**: pretraining checkpoint `runs/mp3/checkpoint` (mp3, step 500, weights" in body


def test_base_model_is_written_when_it_is_a_hub_id_and_license_can_be_set(tmp_path):
    directory = _finetune(tmp_path, license="mit")
    update_metadata(directory, base_model="someone/patchplace-mp3-fmnist")
    front, body, text = _card(directory)
    assert front["base_model"] == "someone/patchplace-mp3-fmnist" and front["license"] == "mit"
    assert ModelCard(text).data.base_model == "someone/patchplace-mp3-fmnist"
    assert "[someone/patchplace-mp3-fmnist](https://huggingface.co/someone/patchplace-mp3-fmnist)" in body
    update_metadata(directory, base_model="/not/a hub id")  # a path is never written as base_model
    assert "base_model" not in _card(directory)[0]


def test_finetune_without_a_recorded_path_names_the_weights(tmp_path):
    model = create_model("vit_micro", img_size=32, patch_size=4, in_chans=1, num_classes=3)
    directory = save_pretrained(model, tmp_path / "ft", metadata={
        "method": "finetune:mp3", "pretrained": SHA, "pretrain_metadata": {"method": "mp3"}, **DATA})
    front, body, _ = _card(directory)
    assert front["base_model_local"] == {"weights": SHA, "method": "mp3"}
    assert "whose path was not recorded (identify it by its weights' sha256)" in body and SHA in body
    assert "model-index" not in front and "Not recorded in this checkpoint (written before its evaluation)." in body


@pytest.mark.parametrize("split", ["holdout", "test[:2000]"])
def test_pretraining_card_shows_the_objectives_metrics_with_their_split(tmp_path, split):
    model = create_model("vit_micro", img_size=32, patch_size=4, in_chans=1, num_classes=0, pos_embed="none")
    directory = save_pretrained(model, tmp_path / "pre", metadata={
        "method": "mp3", **DATA, "step": 300, "metrics": {"loss": 2.5, "pos_acc": 0.4, "top1": 0.4, "count": 2000},
        "metrics_split": split})
    front, body, text = _card(directory)
    assert front["license"] == "apache-2.0" and "base_model" not in front and "base_model_local" not in front
    (result,) = front["model-index"][0]["results"]
    assert result["task"] == {"type": "image-feature-extraction", "name": "mp3 pretraining objective"}
    assert result["dataset"]["split"] == split
    assert {m["name"]: m["value"] for m in result["metrics"]} == {
        "mp3 pretext loss": 2.5, "mp3 pretext pos_acc": 0.4, "mp3 pretext top1": 0.4}
    assert all(r.dataset_split == split for r in ModelCard(text).data.eval_results)
    assert "Not recorded" not in body.split("## Metrics")[1]
    assert f"| pos_acc | 0.4 | {split} |" in body and "the mp3 objective's own (pretext task" in body


def test_metrics_without_a_recorded_split_say_so(tmp_path):
    model = create_model("vit_micro", img_size=32, patch_size=4, in_chans=1, num_classes=3)
    directory = save_pretrained(model, tmp_path / "old", metadata={"method": "supervised", **DATA,
                                                                   "metrics": {"top1": 0.5}})
    front, body, _ = _card(directory)
    assert "split" not in front["model-index"][0]["results"][0]["dataset"]
    assert "| top1 | 0.5 | not recorded |" in body and "a split this checkpoint does not record" in body


def test_card_license_front_matter_is_valid_by_the_hubs_spec(tmp_path):
    """The default is the README's (apache-2.0); a Hub id is written as is; any other license is license: other
    with license_name and license_link (the Hub refuses other without them); an incomplete one is refused in one
    line and changes no file. Validated by the Hub's rules (ModelCard.validate needs the network) and read back by
    huggingface_hub's own parser."""
    from pathlib import Path

    from patchplace.models import ModelError
    from patchplace.models.card import DEFAULT_LICENSE, HUB_LICENSES, license_problems

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert f"else `{DEFAULT_LICENSE}`" in readme and DEFAULT_LICENSE in HUB_LICENSES
    directory = _finetune(tmp_path)
    cases = [({}, {"license": "apache-2.0"}),
             ({"license": "MIT"}, {"license": "mit"}),
             ({"license": "my-terms-1.0", "license_link": "https://example.org/terms"},
              {"license": "other", "license_name": "my-terms-1.0", "license_link": "https://example.org/terms"}),
             ({"license": "other", "license_name": "lab-1.0", "license_link": "LICENSE"},
              {"license": "other", "license_name": "lab-1.0", "license_link": "LICENSE"})]
    for fields, expected in cases:
        update_metadata(directory, **{"license": None, "license_name": None, "license_link": None, **fields})
        front, _, text = _card(directory)
        assert {k: front[k] for k in front if k.startswith("license")} == expected, fields
        assert license_problems(front) == [], (fields, license_problems(front))
        card = ModelCard(text).data
        assert card.license == expected["license"] and card.to_dict().get("license_name") == expected.get(
            "license_name") and card.to_dict().get("license_link") == expected.get("license_link")
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    for fields, said in (({"license": "other"}, "license_name"), ({"license": "my-terms"}, "license_link"),
                         ({"license": "other", "license_name": "My Terms", "license_link": "LICENSE"}, "not an id")):
        with pytest.raises(ModelError, match=said) as error:
            update_metadata(directory, **{"license_name": None, "license_link": None, **fields})
        assert "\n" not in str(error.value)
        assert {p.name: p.read_bytes() for p in directory.iterdir()} == before, "a refused license changes no file"
    # the rules themselves: what the Hub refuses
    assert license_problems({"license": "other"}) and license_problems({"license": "apache 2"})
    assert license_problems({"license": "mit", "license_name": "x"})


def test_the_card_cites_the_paper_the_pipeline_recorded(tmp_path):
    """The paper comes from the metadata the pipeline writes from the method's registration (this package knows no
    method): a pretraining's ``paper``, a fine-tune's pretraining's; none recorded, none cited."""
    paper = "Zhai et al. 2022, Position Prediction as an Effective Pretraining Strategy (MP3)"
    _, body, _ = _card(_finetune(tmp_path, pretrain_metadata={"method": "mp3", "step": 500, "paper": paper}))
    assert f"- **Method**: mp3 — {paper}\n" in body
    model = create_model("vit_micro", img_size=32, patch_size=4, in_chans=1, pos_embed="none")
    for name, metadata in (("pre", {"method": "mp3", "paper": paper}), ("bare", {"method": "mp3"})):
        _, body, _ = _card(save_pretrained(model, tmp_path / name, metadata={**metadata, **DATA, "step": 1}))
        assert ("- **Method**: mp3 — " in body) == (name == "pre"), name
        assert f"- **Method**: mp3 — {paper}\n" in body or name == "bare"
