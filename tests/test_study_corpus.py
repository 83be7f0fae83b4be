"""An earlier results file's rows are merged by corpus: a study row records the manifest fingerprints of the splits it
read, and is reported only on that corpus; a row made before the rule stands for the built-in corpus."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from patchplace.data import SplitWriter
from patchplace.pipelines import config as pipeline_config
from patchplace.research.reproduction.corpora import CORPUS_SPLITS, corpus_record, same_corpus
from patchplace.research.reproduction.metrics import HARNESS_VERSION, earlier_rows
from patchplace.research.reproduction.plan import StudyConfig
from patchplace.research.reproduction.runner import Study

SPEECH_ROWS = ("speech_supervised", "speech_mp3")
CLASSES = [f"k{i}" for i in range(12)]  # the same labels in both corpora: only the clips differ


def write_corpus(root: Path, seed: int) -> Path:
    """A tiny keyword corpus (every split a speech row reads) whose clips depend on ``seed``."""
    rng = np.random.default_rng(seed)
    for split in CORPUS_SPLITS["spoken_keywords"]:
        noise = split == "background_noise"
        with SplitWriter(root, split, dataset="kws", modality="audio",
                         classes=["_background_noise_"] if noise else CLASSES,
                         info={"sample_rate": 16000, "clip_samples": None if noise else 1600}, source="test",
                         recipe="test", recipe_version=1) as w:
            for i in range(1 if noise else 12):
                w.add_audio(f"{i:04d}", 0 if noise else i, (0.1 * rng.standard_normal(1600)).astype(np.float32))
    return root


@pytest.fixture
def corpora(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """Corpus A where the built-in one lives (shards/spoken_keywords under the working directory), corpus B beside."""
    monkeypatch.chdir(tmp_path)
    return write_corpus(Path("shards/spoken_keywords"), 0), write_corpus(tmp_path / "speech_b", 1)


def config(tmp_path: Path, corpus: Path) -> StudyConfig:
    return pipeline_config.load(StudyConfig, None, [
        f"runs={tmp_path / 'runs'}", f"results={tmp_path / 'results'}", "groups=[speech]", "speech_seeds=[0]",
        "unit_per_row=true", f"spoken_keywords={corpus}"])


def write_study(cfg: StudyConfig, corpus: dict | None) -> None:
    """results/study.json at cfg's budget holding every speech row of seed 0, made on ``corpus`` (None: unrecorded)."""
    row = {"seed": 0, "top1": 0.9, "pretrain_epochs": 0.0, **({"corpus": corpus} if corpus else {})}
    Path(cfg.results).mkdir(parents=True, exist_ok=True)
    (Path(cfg.results) / "study.json").write_text(json.dumps({
        "harness": HARNESS_VERSION, "config": dataclasses.asdict(cfg), "results": {r: [row] for r in SPEECH_ROWS}}))


def test_a_row_made_on_one_corpus_is_merged_for_it_and_not_for_another(tmp_path, corpora):
    a, b = corpora
    on_a, on_b = config(tmp_path, a), config(tmp_path, b)
    write_study(on_a, corpus_record(a, "spoken_keywords"))
    assert {r: sorted(seeds) for r, seeds in earlier_rows(Study(on_a)).items()} == {r: [0] for r in SPEECH_ROWS}
    assert earlier_rows(Study(on_b)) == {}, "same labels and budget, other clips: not reported as corpus B's"


def test_a_row_without_a_record_stands_for_the_built_in_corpus(tmp_path, corpora):
    a, b = corpora
    on_a, on_b = config(tmp_path, a), config(tmp_path, b)
    write_study(on_a, None)
    assert set(earlier_rows(Study(on_a))) == set(SPEECH_ROWS)
    assert earlier_rows(Study(on_b)) == {}


def test_fingerprints_decide_where_both_are_built_else_the_path(tmp_path, corpora):
    a, b = corpora
    moved = corpus_record(a, "spoken_keywords") | {"path": "elsewhere/spoken_keywords"}
    assert same_corpus(moved, corpus_record(a, "spoken_keywords"), "spoken_keywords"), "another machine's path"
    assert not same_corpus(corpus_record(b, "spoken_keywords"), corpus_record(a, "spoken_keywords"),
                           "spoken_keywords")
    unbuilt = corpus_record(tmp_path / "missing", "spoken_keywords")
    assert unbuilt == {"path": str(tmp_path / "missing")}
    assert same_corpus(unbuilt, unbuilt, "spoken_keywords") and not same_corpus(
        corpus_record(b, "spoken_keywords"), unbuilt, "spoken_keywords")
