"""MJP's ``decay_pos_embed``: the official code decays its PE (one ``nn.Embedding`` of patch, class-token and
unknown rows, not named by its no-decay set); with the knob the optimizer puts the learned PE table and ``E_unk``
in the decayed group, and nothing else changes group, lr scale or decay."""

from __future__ import annotations

import pytest

from patchplace.finetune import build_optimizer, parameter_groups
from patchplace.models import create_model
from patchplace.objectives import MJP, MJPConfig, ObjectiveError

DECAYED = {"backbone.pos_table", "backbone.unknown_pos_embed"}


def groups(decay_pos_embed: bool, layer_decay: float | None = None) -> dict[str, dict]:
    backbone = create_model("vit_micro", in_chans=1, num_classes=10, pos_embed="learned")
    model = MJP(backbone, MJPConfig(ratio=0.15, decay_pos_embed=decay_pos_embed))
    return parameter_groups(build_optimizer(model, lr=1e-3, weight_decay=0.05, layer_decay=layer_decay), model)


@pytest.mark.parametrize("layer_decay", [None, 0.75])
def test_only_the_pe_table_and_the_unknown_pe_move_to_the_decayed_group(layer_decay):
    exempt, decayed = groups(False, layer_decay), groups(True, layer_decay)
    assert exempt.keys() == decayed.keys() and exempt.keys() >= DECAYED
    for name in DECAYED:
        assert exempt[name]["weight_decay"] == 0.0 and decayed[name]["weight_decay"] == 0.05, name
        assert exempt[name]["lr_scale"] == decayed[name]["lr_scale"], name  # the stem's layer either way
    assert {n: g for n, g in exempt.items() if n not in DECAYED} == {n: g for n, g in decayed.items()
                                                                      if n not in DECAYED}
    assert decayed["backbone.cls_token"]["weight_decay"] == 0.0  # official no-decay set: cls_token


def test_decay_pos_embed_is_a_bool():
    with pytest.raises(ObjectiveError, match="decay_pos_embed must be true or false"):
        MJPConfig(decay_pos_embed="yes").validate()
