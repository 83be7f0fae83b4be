"""Each paper's recipe at scale, held field by field: every shipped at-scale config against its paper's cited values
(research/src/patchplace/research/recipes/*.yaml), every field a config sets cited, and the docs tables generated from
the same data and current."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from patchplace.pipelines.config import shipped_configs
from patchplace.research import recipes

ROOT = Path(__file__).resolve().parents[1]
RECIPES = recipes.load_recipes()
AT_SCALE = sorted(p.name for p in shipped_configs().glob("*.yaml")
                  if p.name.startswith(("imagenet_", "speech_commands_")))
# What must be one command away: method -> the stages shipped for it
EXPECTED = {"mp3": {"pretrain", "finetune"}, "mp3_speech": {"pretrain", "finetune"},
            "droppos": {"pretrain", "finetune"}, "mae": {"pretrain", "finetune", "linprobe"},
            "ijepa": {"pretrain"}, "stop": {"pretrain"}, "mjp": {"pretrain"},
            "randsac": {"pretrain", "finetune", "linprobe"}, "supervised": {"pretrain"}}


def test_every_at_scale_config_has_its_papers_data_and_every_paper_its_configs():
    assert sorted(r.file for r in RECIPES) == AT_SCALE, "an at-scale config without cited data, or data without one"
    stages = {m: {r.stage for r in RECIPES if r.method == m} for m in EXPECTED}
    assert all(stages[m] >= want for m, want in EXPECTED.items()), stages


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.file)
def test_the_shipped_config_is_the_papers_recipe_or_a_listed_departure(recipe):
    assert recipes.problems(recipe) == []
    assert all(e.source.strip() for e in recipe.entries), "every value names where it comes from"
    assert all(e.departure is None or e.departure.strip() for e in recipe.entries)


def test_a_silent_change_to_a_config_is_caught(tmp_path):
    """The check can fail: a config whose peak lr drifts, a departure whose value is not shipped, and a field set
    without a cited entry are each reported by name."""
    recipe = next(r for r in RECIPES if r.file == "imagenet_mae_vitb16_pretrain.yaml")
    text = (shipped_configs() / recipe.file).read_text()
    drifted, n = re.subn(r"^  lr: \S+", "  lr: 0.00042", text, count=1, flags=re.M)
    assert n == 1 and "\nrun:\n" in drifted
    (tmp_path / recipe.file).write_text(drifted.replace("\nrun:\n", "\nrun:\n  keep_epochs: [1]\n", 1))
    found = recipes.problems(recipe, configs=tmp_path)
    assert any("optim.lr = 0.00042" in p and "no departure is listed" in p for p in found), found
    assert any("run.keep_epochs is set with no cited entry" in p for p in found), found


def test_values_compare_as_the_pipeline_holds_them():
    assert recipes.same((0.9, 0.95), [0.9, 0.95]) and recipes.same(1.5e-4, 0.00015)
    assert not recipes.same(True, 1) and not recipes.same(0.75, 0.65) and not recipes.same([7, 3], [7])


def test_the_docs_tables_are_generated_from_the_same_data():
    pages = {recipes.DOC_PAGE.get(r.method, r.method) for r in RECIPES}
    for page in pages:
        text = (ROOT / "docs" / "methods" / f"{page}.md").read_text()
        assert recipes.render_page(text, recipes.doc_section(RECIPES, page)) == text, (
            f"docs/methods/{page}.md: run python -m patchplace.research.recipes --write-docs")
