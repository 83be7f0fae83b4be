"""MAE (loss only on masked patches) and the supervised objective; the shared masking and metric pieces."""

from __future__ import annotations

import pytest
import torch

from patchplace.objectives import (
    MAE,
    MAEConfig,
    ObjectiveError,
    Supervised,
    SupervisedConfig,
    patchify,
    random_masking,
    topk_accuracy,
)
from patchplace.objectives.mae import pixel_targets


def _mae(micro, **config):
    return MAE(micro(pos_embed="sincos2d"), MAEConfig(decoder_dim=32, decoder_depth=1, decoder_heads=2, **config))


def test_random_masking_keeps_the_requested_count_and_restores_order():
    keep, mask, restore = random_masking(4, 10, 3, generator=torch.Generator().manual_seed(0))
    assert keep.shape == (4, 3) and mask.sum(1).tolist() == [7] * 4
    assert all(not mask[b, keep[b]].any() for b in range(4)), "kept tokens are not masked"
    shuffle = restore.argsort(1)
    assert torch.equal(torch.gather(shuffle, 1, restore), torch.arange(10).expand(4, 10))
    assert len({tuple(k.tolist()) for k in keep}) > 1, "masks are drawn per sample"


def test_patchify_follows_mae_layout():
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).reshape(2, 3, 8, 8)
    p = patchify(x, 4)
    assert p.shape == (2, 4, 48)
    assert torch.equal(p[0, 1].reshape(4, 4, 3), x[0, :, :4, 4:8].permute(1, 2, 0))  # patch (0, 1): h, w, c


def test_mae_loss_only_sees_masked_patches(micro):
    model = _mae(micro).eval()
    x = torch.randn(2, 1, 16, 16)
    latent, mask, restore = model.forward_encoder(x, 0.75, torch.Generator().manual_seed(5))
    pred = model.forward_decoder(latent, restore)
    pred.retain_grad()
    loss = model.forward_loss(x, pred, mask.float())
    loss.backward()
    # predictions of visible patches get no gradient; masked ones do
    assert pred.grad[~mask].abs().max() == 0 and pred.grad[mask].abs().max() > 0
    assert mask.sum(1).tolist() == [12, 12]
    torch.testing.assert_close(model(x, generator=torch.Generator().manual_seed(5))["loss"], loss.detach())


def test_mae_learns_to_reconstruct(micro, images):
    torch.manual_seed(0)
    model = _mae(micro, norm_pix_loss=False)
    x = images(8, size=16)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    first = None
    for _ in range(60):
        loss = model(x)["loss"]
        first = first or loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first, (first, loss.item())


def test_mae_requires_fixed_sincos_pe(micro):
    with pytest.raises(ObjectiveError, match="MAE needs a backbone with pos_embed in"):
        MAE(micro(pos_embed="learned"))
    with pytest.raises(ObjectiveError, match="mask_ratio"):
        MAEConfig(mask_ratio=1.2).validate()


def test_supervised_hard_and_soft_labels(micro):
    model = Supervised(micro(num_classes=4), SupervisedConfig(label_smoothing=0.0)).eval()
    x, y = torch.randn(3, 1, 16, 16), torch.tensor([0, 3, 1])
    out = model((x, y))
    torch.testing.assert_close(out["loss"], torch.nn.functional.cross_entropy(model.backbone(x), y))
    soft = torch.nn.functional.one_hot(y, 4).float()
    torch.testing.assert_close(model((x, soft))["loss"], out["loss"], atol=1e-6, rtol=0)
    assert model({"inputs": x, "labels": y})["acc"] == out["acc"]
    with pytest.raises(ObjectiveError, match="needs a classifier head"):
        Supervised(micro(num_classes=0))
    with pytest.raises(ObjectiveError, match=r"needs \(inputs, labels\)"):
        model(x)


def test_topk_accuracy_with_weights():
    logits = torch.tensor([[[3.0, 2.0, 1.0], [0.0, 1.0, 2.0]]])
    targets = torch.tensor([[1, 2]])
    assert topk_accuracy(logits, targets, 1) == 0.5
    assert topk_accuracy(logits, targets, 2) == 1.0
    assert topk_accuracy(logits, targets, 1, torch.tensor([[0, 1]])) == 1.0


def test_random_masking_mask_is_maes_ones_slice_gather():
    """The removed-token mask (one comparison of the inverse permutation) is MAE's ones / [:keep] = 0 / gather."""
    for n, keep in ((10, 3), (196, 49), (5, 5), (4, 0)):
        _, mask, restore = random_masking(6, n, keep, generator=torch.Generator().manual_seed(n))
        official = torch.ones(6, n)
        official[:, :keep] = 0
        assert torch.equal(mask, torch.gather(official, 1, restore).bool())


def test_mae_loss_takes_a_bool_or_float_mask(micro):
    model = _mae(micro)
    x = torch.randn(2, 1, 16, 16)
    latent, mask, restore = model.forward_encoder(x, 0.75, torch.Generator().manual_seed(1))
    pred = model.forward_decoder(latent, restore)
    target = pixel_targets(x, 4)
    expected = (((pred - target) ** 2).mean(-1) * mask).sum() / mask.sum()
    torch.testing.assert_close(model.forward_loss(x, pred, mask), expected)
    torch.testing.assert_close(model.forward_loss(x, pred, mask.float()), expected)
    out = model(x, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(out["loss"], expected)
