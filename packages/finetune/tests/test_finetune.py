"""Fine-tuning setup (head, PE swap, layer decay, mixup), metrics and the frozen-backbone probes."""

from __future__ import annotations

import pytest
import torch

from patchplace.finetune import (
    Accuracy,
    build_mixup,
    confusion_matrix,
    extract_features,
    finetune_optimizer,
    knn_classify,
    knn_probe_per_layer,
    linear_probe,
    position_probe,
    prepare_for_finetune,
    subsample_per_class,
    topk_correct,
)
from patchplace.models import create_model


@pytest.fixture
def backbone():
    torch.manual_seed(0)
    return create_model("vit_micro", img_size=16, patch_size=4, in_chans=1, pos_embed="none")


def _batches(n=24, classes=3, seed=0, batch=8):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % classes
    x = torch.randn(n, 1, 16, 16, generator=g) * 0.3 + y.view(-1, 1, 1, 1).float()  # class = brightness
    return [(x[i: i + batch], y[i: i + batch]) for i in range(0, n, batch)]


def test_prepare_swaps_pe_keeps_weights_and_adds_head_and_drop_path(backbone):
    before = {k: v.clone() for k, v in backbone.state_dict().items()}
    model = prepare_for_finetune(backbone, 7, pos_embed="learned", drop_path_rate=0.2)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items() if not k.startswith("head"))
    assert "pos_table" in after and model.head.out_features == 7 and model.config.pos_embed == "learned"
    assert model.blocks[0].drop_path1.__class__.__name__ == "Identity"
    assert model.blocks[-1].drop_path1.drop_prob == pytest.approx(0.2)
    assert model(torch.randn(2, 1, 16, 16)).shape == (2, 7)


def test_layer_decay_scales_grow_with_depth_and_pe_has_no_weight_decay(backbone):
    model = prepare_for_finetune(backbone, 3, pos_embed="learned")
    opt = finetune_optimizer(model, lr=1e-3, weight_decay=0.05, layer_decay=0.5)
    scale_of = {}
    for group in opt.param_groups:
        for p in group["params"]:
            scale_of[id(p)] = (group["lr_scale"], group["weight_decay"])
    named = dict(model.named_parameters())
    assert scale_of[id(named["pos_table"])] == (0.125, 0.0)  # stem: 0.5^3 for depth 2
    assert scale_of[id(named["blocks.0.attn.qkv.weight"])] == (0.25, 0.05)
    assert scale_of[id(named["blocks.1.attn.qkv.weight"])][0] == 0.5
    assert scale_of[id(named["head.weight"])] == (1.0, 0.05)
    assert scale_of[id(named["cls_token"])][1] == 0.0 and scale_of[id(named["norm.weight"])][1] == 0.0


def test_mixup_produces_soft_targets():
    mixup = build_mixup(3, mixup_alpha=0.8, cutmix_alpha=0.0, label_smoothing=0.1)
    x, y = torch.randn(4, 1, 16, 16), torch.tensor([0, 1, 2, 0])
    mixed, soft = mixup(x, y)
    assert soft.shape == (4, 3) and torch.allclose(soft.sum(1), torch.ones(4)) and mixed.shape == x.shape
    assert build_mixup(3, mixup_alpha=0, cutmix_alpha=0) is None


def test_metrics():
    logits = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1], [0.2, 0.3, 0.5]])
    labels = torch.tensor([1, 2, 2])
    assert topk_correct(logits, labels, (1, 2)) == {1: 2, 2: 2}
    assert confusion_matrix(logits.argmax(1), labels, 3).tolist() == [[0, 0, 0], [0, 1, 0], [1, 0, 1]]
    acc = Accuracy(3)
    acc.update(logits[:2], labels[:2])
    acc.update(logits[2:], labels[2:])
    assert acc.compute()["top1"] == pytest.approx(2 / 3) and acc.compute()["count"] == 3


def test_linear_and_knn_probes_separate_separable_features():
    g = torch.Generator().manual_seed(0)
    y = torch.arange(200) % 4
    x = torch.randn(200, 8, generator=g) * 0.3 + torch.nn.functional.one_hot(y, 8).float() * 3
    assert linear_probe(x[:150], y[:150], x[150:], y[150:], num_classes=4)["top1"] == 1.0
    assert knn_classify(x[:150], y[:150], x[150:], y[150:], num_classes=4, k=5)["top1"] == 1.0
    shuffled = y[torch.randperm(200, generator=g)]
    assert knn_classify(x[:150], shuffled[:150], x[150:], shuffled[150:], num_classes=4)["top1"] < 0.6
    idx = subsample_per_class(y, 0.1)
    assert torch.bincount(y[idx]).tolist() == [5, 5, 5, 5]


def test_feature_extraction_and_layerwise_knn(backbone):
    feats, labels = extract_features(backbone, _batches(), layers=(0, -1), pool="mean")
    assert set(feats) == {0, 1} and feats[1].shape == (24, 32) and labels.shape == (24,)
    per_layer = knn_probe_per_layer(backbone, _batches(seed=0), _batches(seed=1), num_classes=3, k=5)
    assert sorted(per_layer) == [1, 2] and all(v > 0.6 for v in per_layer.values())  # brightness is easy


def test_position_probe_trains_only_its_head_and_reads_positions_from_content():
    torch.manual_seed(0)
    model = create_model("vit_micro", img_size=16, patch_size=4, in_chans=1, pos_embed="learned")

    texture = torch.randn(1, 1, 16, 16, generator=torch.Generator().manual_seed(99))

    def batches(n, seed):  # every position has its own fixed texture (+ noise): a probe can read it out
        g = torch.Generator().manual_seed(seed)
        x = texture + 0.05 * torch.randn(n, 1, 16, 16, generator=g)
        return [(x[i: i + 8], torch.zeros(8, dtype=torch.long)) for i in range(0, n, 8)]

    frozen = {k: v.clone() for k, v in model.state_dict().items()}
    result = position_probe(model, batches(64, 0) * 10, batches(32, 1), mask_ratio=0.75, lr=1e-2)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in frozen.items()), "the backbone stays frozen"
    assert result["top1"] > 0.5 and result["mask_ratio"] == 0.75  # chance is 1/16; measured 1.0
