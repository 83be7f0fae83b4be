"""Command-line pieces shared by the end-to-end tests: a tiny model and batch, small objective heads (from each
registered method's config), and the ``data.*`` overrides of the test shards (``conftest.shards``)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import fields
from pathlib import Path

from patchplace.objectives import get_method

TINY = ["model.preset=vit_micro", "data.batch_size=8", "data.num_workers=0", "run.tensorboard=false",
        "run.log_every=1", "data.shuffle_buffer=16"]
# Per-method test settings beside the small widths: MJP's jigsaw on 0.15 of the patches (the study's gamma).
TEST_FIELDS = {"mjp": ["objective.ratio=0.15"]}


def small_heads(method: str) -> list[str]:
    """Overrides that shrink a method's decoder / predictor to the tiny test model (by its config's fields), plus
    its :data:`TEST_FIELDS`."""
    names = {f.name for f in fields(get_method(method).config_cls)}
    out = [f"objective.{part}_{what}={value}" for part in ("decoder", "predictor") if f"{part}_dim" in names
           for what, value in (("dim", 32), ("heads", 2), ("depth", 1))]
    return out + (["objective.min_keep=2"] if "min_keep" in names else []) + TEST_FIELDS.get(method, [])


def method_args(shards: Path, method: str) -> list[str]:
    """``pretrain.py`` arguments of a tiny run of ``method`` on the test shards of its modality (audio: the MP3
    speech Transformer)."""
    audio_method = get_method(method).modality == "audio"
    data = audio(shards) if audio_method else img(shards)
    model = ["model.preset=audio_mp3", "data.batch_size=8"] if audio_method else []
    return [f"method={method}", *data, *TINY, *model, *small_heads(method)]


def img(shards: Path) -> list[str]:
    return [f"data.train={shards / 'img' / 'train'}", f"data.val={shards / 'img' / 'test'}"]


def audio(shards: Path) -> list[str]:
    return [f"data.train={shards / 'audio' / 'train'}", f"data.val={shards / 'audio' / 'validation'}",
            f"data.noise_split={shards / 'audio' / 'background_noise'}"]


def state_dir(run: Path) -> Path:
    """The Accelerate state of a run's last complete checkpoint (``checkpoints/step-N/state``)."""
    steps = sorted((run / "checkpoints").glob("step-*"))
    assert len(steps) == 1, f"one complete checkpoint in {run}, found {steps}"
    return steps[0] / "state"


def run_log(out: Path, everything: bool = False) -> list[dict]:
    """A run's ``log.jsonl``: its training-step records (``everything``: also evaluations, snapshots, early
    stops; pretraining logs its closing validation after the last step)."""
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return records if everything else [r for r in records if "loss" in r]


def files_of(out: Path) -> dict[str, str]:
    """Every file of a run directory (the lock file included) by its sha256, and every link by its target."""
    return {str(p.relative_to(out)): os.readlink(p) if p.is_symlink() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_symlink() or p.is_file()}
