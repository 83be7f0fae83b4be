"""The method facts patchplace.models' converter records (``layouts.METHODS``) held to the methods' registrations.

patchplace-models imports nothing of ours (docs/design.md, "Packages"), so the converter cannot read the objectives'
registry: what a converted checkpoint records for evaluation (paper, probe feature, fine-tuning pooling, a head the
method trains) is written in the models package, and this test, which sees both packages, fails where the two part.
"""

from __future__ import annotations

import re

import pytest

from patchplace.models import create_model
from patchplace.models.layouts import LAYOUTS, METHODS
from patchplace.objectives import get_method, method_names

# the paper's backbone, which has a class token (the registry states probe_feature / finetune_pool for it)
BACKBONE = create_model("vit_tiny", img_size=32, patch_size=8, num_classes=10)


def test_the_converter_names_only_registered_methods():
    assert set(METHODS) <= set(method_names())
    assert {layout.method for layout in LAYOUTS.values()} - {None} <= set(METHODS)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_a_converted_checkpoint_records_what_the_registration_states(name):
    facts, spec = METHODS[name], get_method(name)
    assert facts.trains_head == spec.needs_head
    assert facts.probe_feature == spec.probe_feature_for(BACKBONE)
    assert facts.finetune_pool == spec.finetune_pool_for(BACKBONE)
    if spec.paper:  # "authors year, title (tag)": the converter's adds the arXiv id
        title = re.sub(r" \((MP3|StoP|RandSAC|DeiT)\)$", "", spec.paper)
        assert facts.paper.startswith(title), (facts.paper, spec.paper)
