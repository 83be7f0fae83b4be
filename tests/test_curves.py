"""Each method's curves (``patchplace.pipelines.curves``): what a kind declares is what it does — the pictures its
``draw`` writes are exactly its ``files`` (so evaluate.py's ``RESULT_FILES``, which ``run.overwrite=true`` clears,
holds them), its result goes into results.json as it is and its report lines render it."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
import torch

from patchplace.models import create_model
from patchplace.objectives import get_method, list_methods
from patchplace.pipelines import evaluate
from patchplace.pipelines.curves import CURVES, markdown

DRAWN = sorted(s.name for s in list_methods() if s.curves)
SMALL = {"decoder_dim": 32, "decoder_heads": 2, "decoder_depth": 1}


def test_the_kinds_own_distinct_keys_and_files_that_an_overwrite_clears():
    keys = [kind.key for kind in CURVES.values()]
    files = [name for kind in CURVES.values() for name in kind.files]
    assert len(set(keys)) == len(keys) and len(set(files)) == len(files)
    assert set(files) <= set(evaluate.RESULT_FILES)
    assert not set(keys) & {"classification", "consistency", "privacy", "plots", "position_probe"}
    assert all(name == kind.name for name, kind in CURVES.items())


@pytest.mark.parametrize("method", DRAWN)
def test_a_kind_writes_exactly_its_files_and_reports_its_result(method, tmp_path):
    spec = get_method(method)
    backbone = create_model("vit_micro", pos_embed=spec.pos_embed, img_size=32, patch_size=4, in_chans=1)
    names = {f.name for f in fields(spec.config_cls)}
    objective = spec.build(backbone, {k: v for k, v in SMALL.items() if k in names})
    kind = CURVES[spec.curves]
    images = torch.rand(8, 1, 32, 32, generator=torch.Generator().manual_seed(0))
    value = kind.draw(objective, images, images, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kind.files)
    assert json.loads(json.dumps(value)) == value  # results.json holds it unchanged
    lines = markdown({kind.key: value, "consistency": {}})
    assert lines == kind.markdown(value) and any(line.strip() for line in lines)
    assert markdown({}) == []
