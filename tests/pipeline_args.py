"""Command-line pieces shared by the end-to-end tests: a tiny model and batch, small objective heads, and the
``data.*`` overrides of the test shards (``conftest.shards``)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

TINY = ["model.preset=vit_micro", "data.batch_size=8", "data.num_workers=0", "run.tensorboard=false",
        "run.log_every=1", "data.shuffle_buffer=16"]
SMALL_HEADS = {
    "droppos": ["objective.decoder_dim=32", "objective.decoder_heads=2", "objective.decoder_depth=1"],
    "mae": ["objective.decoder_dim=32", "objective.decoder_heads=2", "objective.decoder_depth=1"],
    "randsac": ["objective.decoder_dim=32", "objective.decoder_heads=2", "objective.decoder_depth=1"],
    "ijepa": ["objective.predictor_dim=32", "objective.predictor_heads=2", "objective.predictor_depth=1",
              "objective.min_keep=2"],
    "stop": ["objective.predictor_dim=32", "objective.predictor_heads=2", "objective.predictor_depth=1",
             "objective.min_keep=2"],
    "mjp": ["objective.ratio=0.15"],
}


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
