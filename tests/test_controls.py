"""The probe controls (``pipelines/controls.py``): raw pixels and random-init backbones on the study's sets."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from patchplace.data import SplitWriter
from patchplace.research import controls

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def separable(tmp_path_factory) -> Path:
    """3 classes told apart by where a bright square sits (pixels separate them; 100 train images per class)."""
    root = tmp_path_factory.mktemp("separable")
    rng = np.random.default_rng(0)
    for split, n in (("train", 300), ("test", 60)):
        with SplitWriter(root, split, dataset="toy", modality="image", classes=["a", "b", "c"],
                         info={"image_size": [28, 28], "channels": 1}, source="test", recipe="test",
                         recipe_version=1, max_count=100) as w:
            for i in range(n):
                image = rng.integers(0, 60, (28, 28), dtype=np.uint8)
                image[4:12, 4 + 8 * (i % 3): 12 + 8 * (i % 3)] = 255
                w.add_image(f"{i:04d}", i % 3, image)
    return root


def test_controls_measure_pixels_and_random_init_on_the_studys_sets(separable, tmp_path):
    study = tmp_path / "study.json"
    study.write_text(json.dumps({"results": {
        "good": [{"seed": s, "linear_probe@0.1": 0.99, "linear_probe": 0.99, "probe_feature": "cls",
                  "probe_pos_embed": "sincos2d"}
                 for s in range(3)],
        "bad": [{"seed": s, "linear_probe@0.1": 0.2 + 0.01 * s} for s in range(3)]}}))
    out = tmp_path / "controls"
    assert controls.main([f"data.train={separable / 'train'}", f"data.val={separable / 'test'}", "data.batch_size=32",
                          "data.num_workers=0", "model.preset=vit_micro", "controls.label_fractions=[0.1]",
                          "controls.probe_train_samples=120", "controls.probe_epochs=20", "controls.seeds=[0,1]",
                          "controls.random_inits=[mean,sincos2d/cls]",
                          f"run.output={out}", "--study", str(study)]) == 0
    measured = json.loads((out / "controls.json").read_text())
    assert measured["sets"] == {"0.1": 30, "probe_set": 120} and measured["test_samples"] == 60
    found = measured["controls"]
    assert min(found["pixels_knn"]["probe_set"] + found["pixels_linear"]["probe_set"]) > 0.9, "pixels separate them"
    assert len(found["random_linear"]["0.1"]) == 2 and len(found["random_knn"]["probe_set"]) == 2
    assert found["random_linear"]["probe_set"][0] != found["random_linear"]["probe_set"][1] or \
        found["random_knn"]["probe_set"][0] != found["random_knn"]["probe_set"][1], "one backbone per seed"
    assert found["random_linear"] == found["random_linear@mean"] != found["random_linear@sincos2d/cls"], \
        "one control per architecture and feature"
    text = (out / "controls.md").read_text()
    assert "| raw pixels, linear probe |" in text and "| random-init backbone (sincos2d/cls), kNN |" in text
    bad = next(line for line in text.splitlines() if line.startswith("| bad | 0.1 |"))
    assert "not learned at this budget" in bad, bad
    good = next(line for line in text.splitlines() if line.startswith("| good | 0.1 |"))
    assert "| learned (+" in good or "not learned" in good  # decided by the measured control (2 seeds: fails closed)
    own = controls.cell(found["random_linear@sincos2d/cls"]["0.1"])
    assert f"| {own} |" in good, "read against the random init of its own architecture and feature"
    assert f"| {controls.cell(found['random_linear@mean']['0.1'])} |" in bad, "no probe_feature: the first control"
    assert controls.learned([0.9, 0.91, 0.92], [0.5, 0.52, 0.48]).startswith("learned (+41.0 pt, one-sided Welch p")
    # +4.0 pt with a seed spread of 5 pt: the heuristic "mean gap > spread" said no, and so does the test (p ~ 0.17)
    assert controls.learned([0.54, 0.49, 0.59], [0.5, 0.52, 0.48]).startswith("not learned at this budget (+4.0 pt")
    assert controls.learned([0.9, 0.91], [0.5, 0.52]).startswith("not learned at this budget (+39.5 pt; 2 / 2 seeds")
