"""Which corpus a study row was made on: the manifest fingerprints of every split it reads, so the report's
merge of an earlier results file never carries a row of one corpus over to another.

A row records ``corpus``: ``{"path": <the configured directory>, <split>: <manifest fingerprint>, ...}``. Two
records name the same corpus when their fingerprints are equal (the path may differ: another machine); where a side
has no fingerprints (its corpus is not built here, e.g. ``--report-only`` on a fresh clone), by the path. A row
without a record (every row measured before this rule) was made on the built-in corpus: the directory the
``StudyConfig`` field names by default (``shards/fashion_mnist``, ``shards/spoken_keywords``), as it is now.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from patchplace.data.errors import DataError
from patchplace.data.manifest import MANIFEST_NAME, Manifest
from patchplace.research.reproduction.plan import RUNS, StudyConfig

# The splits a row of each corpus reads (runner.Study.data, evaluate, probes): a different one is another corpus.
CORPUS_SPLITS: dict[str, tuple[str, ...]] = {
    "fashion_mnist": ("train", "test"),
    "spoken_keywords": ("train", "validation", "test", "background_noise"),
}


def corpus_of(row: str) -> str:
    """The ``StudyConfig`` field naming the corpus a row (by name) reads; a name no longer a row: the images."""
    speech = {r.name for r in RUNS if r.speech}
    return "spoken_keywords" if row in speech else "fashion_mnist"


def corpus_record(root: str | Path, corpus: str) -> dict[str, str]:
    """``{"path": root, split: fingerprint, ...}`` of the corpus at ``root``: no fingerprints where a split it reads
    has no (valid) manifest here."""
    prints = {}
    for split in CORPUS_SPLITS[corpus]:
        path = Path(root) / split
        try:
            prints[split] = Manifest.load(path).fingerprint() if (path / MANIFEST_NAME).is_file() else None
        except DataError:
            prints[split] = None
    whole = all(prints.values())
    return {"path": str(Path(root)), **(prints if whole else {})}


def builtin_record(corpus: str) -> dict[str, str]:
    """The record a row without one stands for: the built-in corpus (the field's default directory) as it is now."""
    default = {f.name: f.default for f in fields(StudyConfig)}[corpus]
    return corpus_record(default, corpus)


def same_corpus(recorded: dict[str, Any] | None, current: dict[str, Any], corpus: str) -> bool:
    """Whether a row's ``recorded`` corpus (None: made before the rule, the built-in one) is ``current``."""
    recorded = recorded or builtin_record(corpus)
    prints = [{k: v for k, v in r.items() if k != "path"} for r in (recorded, current)]
    return prints[0] == prints[1] if all(prints) else recorded.get("path") == current.get("path")


def study_corpora(cfg: StudyConfig) -> dict[str, dict[str, str]]:
    """The record of each corpus this study's config reads, by its field."""
    return {corpus: corpus_record(getattr(cfg, corpus), corpus) for corpus in CORPUS_SPLITS}
