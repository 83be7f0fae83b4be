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
            "ijepa": {"pretrain", "linprobe", "lowlabel"}, "stop": {"pretrain", "linprobe", "lowlabel"},
            "mjp": {"pretrain"},
            "randsac": {"pretrain", "finetune", "linprobe"}, "supervised": {"pretrain"}}


def test_every_at_scale_config_has_its_papers_data_and_every_paper_its_configs():
    assert sorted(r.file for r in RECIPES) == AT_SCALE, "an at-scale config without cited data, or data without one"
    stages = {m: {r.stage for r in RECIPES if r.method == m} for m in EXPECTED}
    assert all(stages[m] >= want for m, want in EXPECTED.items()), stages


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.file)
def test_the_shipped_config_is_the_papers_recipe_or_a_listed_departure(recipe):
    assert recipes.problems(recipe) == []
    assert all(e.source for e in recipe.entries), "every value names where it comes from"
    assert all(e.departure is None or e.departure.strip() for e in recipe.entries)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.file)
def test_every_citation_can_be_checked(recipe):
    """A repository citation names a 40-hex commit, a file and a key; a paper citation an arXiv id and a table,
    section, figure, appendix, equation or algorithm; a project citation why no source states the value."""
    for e in recipe.entries:
        for c in e.source:
            if c.kind == "code":
                assert re.fullmatch(r"[0-9a-f]{40}", c.commit or "") and c.file and c.key, (e.label, c)
                assert re.fullmatch(r"[\w.-]+/[\w.-]+", c.repo or ""), (e.label, c)
            elif c.kind == "paper":
                assert re.fullmatch(r"\d{4}\.\d{4,5}", c.arxiv or "") and c.where, (e.label, c)
                assert {k for k, _ in c.where} <= set(recipes.LOCATORS), (e.label, c)
            else:
                assert c.kind == "project" and c.why.strip(), (e.label, c)
    assert recipes.citation_problems(recipe) == []


def test_an_uncheckable_citation_is_refused(tmp_path):
    """Prose, an alias missing from sources, a short commit, a code citation without a key and a paper citation
    without a cell are each refused by name."""
    head = ('method: mae\npaper: "p"\nsources:\n  code: {repo: a/b, commit: abc123}\n'
            '  pap: {paper: "t", arxiv: "2111.06377"}\n'
            'recipes:\n  x.yaml:\n    stage: pretrain\n    reproduces: "r"\n    fields:\n')

    def load(entry: str):
        (tmp_path / "mae.yaml").write_text(head + "      - " + entry + "\n")
        return recipes.load_recipes(tmp_path)

    with pytest.raises(ValueError, match="source must be a list"):
        load('{field: optim.lr, paper: 1, source: "MAE Table 8"}')
    with pytest.raises(ValueError, match="'nope' is not in the file's sources"):
        load("{field: optim.lr, paper: 1, source: [{code: nope, file: f.py, key: k}]}")
    with pytest.raises(ValueError, match="a citation is one of"):
        load("{field: optim.lr, paper: 1, source: [{code: code, paper: pap, file: f.py, key: k}]}")
    [r] = load("{field: optim.lr, paper: 1, source: [{code: code, file: f.py}, {paper: pap}, {project: ' '}]}")
    found = recipes.citation_problems(r)
    assert any("'abc123' is not 40 hex digits" in p for p in found), found
    assert any("f.py: no key" in p for p in found), found
    assert any("pap: names none of table" in p for p in found), found
    assert any("a project citation needs why" in p for p in found), found


def test_verify_finds_a_missing_file_and_a_wrong_key():
    """--verify-sources' check: a YAML key by its path, any other key by its text, a file absent at the commit."""
    commit = "0" * 40
    files = {"cfg.yaml": "data:\n  batch_size: 64\nema: [0.996, 1.0]\n", "main.py": "parser.add_argument('--blr')\n"}
    src = {"c": {"repo": "a/b", "commit": commit}}
    entries = tuple(recipes.entry({"field": "optim.lr", "paper": 1, "source": [dict(code="c", file=f, key=k)]}, src)
                    for f, k in (("cfg.yaml", "data.batch_size"), ("cfg.yaml", "ema[1]"), ("main.py", "--blr"),
                                 ("cfg.yaml", "data.crop_size"), ("cfg.yaml", "ema[2]"), ("main.py", "--lr_base"),
                                 ("gone.py", "x")))
    recipe = recipes.Recipe("mae", "p", "x.yaml", "pretrain", "", entries)
    found = recipes.verify([recipe], lambda repo, c, file: files.get(file) if (repo, c) == ("a/b", commit) else None)
    assert [p.rsplit(": ", 1)[-1] for p in found] == ["no 'data.crop_size'", "no 'ema[2]'", "no '--lr_base'",
                                                       "no file gone.py"], found


def test_the_1pct_logistic_probe_reads_its_own_crop():
    """The StoP / I-JEPA 1% logistic probe reads its own crop (logistic_eval.py: Resize 224 + CenterCrop 224), the
    100% VISSL probes Resize 256 + CenterCrop 224; the crops are the cited ones."""
    by_file = {r.file: r for r in RECIPES}
    for name in ("stop_vitb16", "ijepa_vith14"):
        full, one = by_file[f"imagenet_{name}_linprobe.yaml"], by_file[f"imagenet_{name}_linprobe1pct.yaml"]
        crop = {r.file: recipes.value_at(recipes.shipped(r)[0], "data.crop_pct") for r in (full, one)}
        assert crop == {full.file: 0.875, one.file: 1.0}
        [cited] = [e for e in one.entries if e.field == "data.crop_pct"]
        assert any(c.key == "size = 256 if res == 24 else res" for c in cited.source) and cited.choice


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
    pages = recipes.doc_pages(ROOT / "docs")
    assert {r.method for r in RECIPES} <= set(pages), "a recipe of an unregistered method"
    for page in {pages[r.method] for r in RECIPES}:
        text = (ROOT / "docs" / "methods" / f"{page}.md").read_text()
        assert recipes.render_page(text, recipes.doc_section(RECIPES, page, pages)) == text, (
            f"docs/methods/{page}.md: run python -m patchplace.research.recipes --write-docs")
