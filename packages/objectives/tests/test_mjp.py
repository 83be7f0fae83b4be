"""MJP: the block-wise jigsaw (Alg. 1), the unknown PE (Eq. 4-5), DAL (Eq. 1-2), the schedules, learning."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from patchplace.models.pos_embed import sincos_2d
from patchplace.objectives.audit import count_step
from patchplace.objectives.common import ObjectiveError, grid_coords
from patchplace.objectives.mjp import MJP, DALRegressor, MJPConfig, dal_loss, jigsaw, permute_selected


def _patches(x: torch.Tensor, p: int) -> torch.Tensor:
    b, c, h, w = x.shape
    return x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // p) * (w // p), -1)


def _mjp(micro, **config):
    """A tiny MJP model on 32 x 32 images (8 x 8 = 64 positions), so gamma = 0.15 selects ~10 patches."""
    return MJP(micro(num_classes=4, img_size=32), MJPConfig(**{"ratio": 0.15, **config}))


# ---------------------------------------------------------------------------------------------- Alg. 1
@pytest.mark.parametrize("derange", [True, False])
def test_jigsaw_moves_exactly_the_selected_patches(images, derange):
    x = images(6, size=32)
    shuffled, mask = jigsaw(x, 4, 0.25, generator=torch.Generator().manual_seed(0), derange=derange)
    assert shuffled.shape == x.shape and shuffled.dtype == x.dtype and mask.shape == (6, 64)
    before, after = _patches(x, 4), _patches(shuffled, 4)
    fixed = 0
    for b in range(6):
        assert len({tuple(p.tolist()) for p in before[b]}) == 64, "test images need distinct patches"
        assert torch.equal(after[b][~mask[b]], before[b][~mask[b]]), "unselected patches must stay bit-identical"
        selected = mask[b].nonzero().squeeze(1).tolist()
        sources = []
        for i in selected:
            hits = [j for j in range(64) if torch.equal(after[b, i], before[b, j])]
            assert len(hits) == 1 and mask[b, hits[0]], "a selected position holds a patch of a selected position"
            sources.append(hits[0])
            fixed += hits[0] == i
        assert sorted(sources) == selected, "the selected patches are permuted: their multiset is preserved"
    if derange:
        assert fixed == 0, "with derange=True every selected patch moves (m >= 2)"
    again, mask2 = jigsaw(x, 4, 0.25, generator=torch.Generator().manual_seed(0), derange=derange)
    assert torch.equal(again, shuffled) and torch.equal(mask2, mask), "deterministic given a generator"


def test_jigsaw_selects_about_ratio_n_per_sample(images):
    x = images(64, size=32)
    _, mask = jigsaw(x, 4, 0.25, generator=torch.Generator().manual_seed(1))
    counts = mask.sum(1).float()
    # BEiT's generator never exceeds int(0.25 * 64) = 16 and rarely falls short (measured mean 15.9).
    assert counts.max() <= 16 and counts.mean() >= 0.9 * 16, counts
    assert len({tuple(m.tolist()) for m in mask}) >= 60, "one block-wise mask per sample"


def test_permute_selected_edge_cases():
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[1, 2] = True  # one selected patch: nothing to swap it with
    mask[2, [0, 3]] = True  # two: they must swap
    source = permute_selected(mask, torch.Generator().manual_seed(0))
    assert source[0].tolist() == list(range(5)) and source[1].tolist() == list(range(5))
    assert source[2].tolist() == [3, 1, 2, 0, 4]
    with pytest.raises(ObjectiveError, match="bool"):
        permute_selected(mask.long())


# ---------------------------------------------------------------------------------------------- Eq. 4-5
def test_only_shuffled_positions_get_the_unknown_pe(micro, images):
    model = _mjp(micro, apply_prob=1.0, warmup_fraction=0.0)
    bb = model.backbone
    assert "unknown_pos_embed" in bb.state_dict(), "E_unk lives in the backbone (checkpoint, export)"
    x, y = images(3, size=32), torch.tensor([0, 1, 2])
    seen = {}
    hook = bb.blocks[0].register_forward_pre_hook(lambda _, args: seen.setdefault("tokens", args[0].detach()))
    out = model((x, y), progress=0.5, generator=torch.Generator().manual_seed(3))
    hook.remove()
    assert out["jigsaw"] == 1.0
    with torch.no_grad():
        shuffled, mask = model.apply_jigsaw(x, 0.5, torch.Generator().manual_seed(3))  # the same draws
        assert mask.any(1).all() and (~mask).any(1).all()
        pe = torch.where(mask.unsqueeze(-1), bb.unknown_pos_embed, bb.pos_table[:, 1:])
        expected = bb.patch_embed(shuffled) + pe
        cls = bb.cls_token + bb.pos_table[:, :1]
    torch.testing.assert_close(seen["tokens"][:, 1:], expected)
    torch.testing.assert_close(seen["tokens"][:, :1], cls.expand(3, -1, -1))  # CLS keeps its PE


# ---------------------------------------------------------------------------------------------- DAL (Eq. 1-2)
def test_dal_mlp_learns_a_fixed_pe_table():
    torch.manual_seed(0)
    table = sincos_2d((4, 4), 32)  # fixed
    g = DALRegressor(32, "mlp")
    assert sum(isinstance(m, torch.nn.Linear) for m in g.modules()) == 3
    opt = torch.optim.Adam(g.parameters(), lr=1e-2)
    first = None
    for _ in range(200):
        loss = dal_loss(g, table)
        first = first or loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    # measured: 1.50 (a constant prediction) -> 0.075 mean L1 in grid cells
    assert loss.item() < 0.2 * first, (first, loss.item())


def test_dal_pca_gives_gradients_to_the_pe_table(micro):
    bb = micro(num_classes=4)  # learned PE, 4 x 4 grid
    g = DALRegressor(bb.embed_dim, "pca")
    assert not list(g.parameters())
    loss = dal_loss(g, bb.pos_embed(), grid=bb.grid)
    loss.backward()
    grad = bb.pos_table.grad
    assert torch.isfinite(loss) and grad[0, 1:].abs().sum(1).gt(0).all(), "every patch PE row gets a gradient"
    assert grad[0, 0].abs().sum() == 0, "the CLS row is no grid position"


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_dal_ignores_shuffled_positions(kind):
    torch.manual_seed(0)
    g = DALRegressor(32, kind)
    table = sincos_2d((4, 4), 32).requires_grad_()
    keep = torch.ones(2, 16, dtype=torch.bool)
    keep[0, [1, 2, 5]] = False
    keep[1, [2, 5, 9]] = False  # 2 and 5 are shuffled in both samples
    loss = dal_loss(g, table, keep)
    loss.backward()
    assert table.grad[[2, 5]].abs().sum() == 0 and table.grad[[1, 9]].abs().sum() > 0
    moved = table.detach().clone()
    moved[[2, 5]] += 10.0
    torch.testing.assert_close(dal_loss(g, moved, keep), loss.detach())
    per_sample = (dal_loss(g, table, keep[0]) + dal_loss(g, table, keep[1])) / 2
    torch.testing.assert_close(loss, per_sample)  # mean over samples of each sample's mean


def test_mjp_dal_uses_the_unshuffled_positions(micro, images):
    model = _mjp(micro, apply_prob=1.0, warmup_fraction=0.0, dal="linear")
    x, y = images(2, size=32), torch.tensor([0, 1])
    out = model((x, y), progress=0.5, generator=torch.Generator().manual_seed(4))
    _, mask = model.apply_jigsaw(x, 0.5, torch.Generator().manual_seed(4))
    torch.testing.assert_close(out["dal"], dal_loss(model.dal, model.backbone.pos_embed(), ~mask, grid=(8, 8)))
    torch.testing.assert_close(out["loss"], out["ce"] + 0.01 * out["dal"])
    model.eval()  # training only: the plain classifier loss
    out = model((x, y), progress=0.5)
    assert out["dal"] == 0 and out["jigsaw"] == 0 and out["loss"] == out["ce"]


def test_mjp_loss_is_the_supervised_loss_with_soft_targets(micro, images):
    model = _mjp(micro, label_smoothing=0.0).eval()
    x, y = images(3, size=32), torch.tensor([0, 3, 1])
    hard = model((x, y))
    torch.testing.assert_close(hard["ce"], torch.nn.functional.cross_entropy(model.backbone(x), y))
    soft = model((x, torch.nn.functional.one_hot(y, 4).float()))  # timm Mixup / CutMix targets
    torch.testing.assert_close(soft["loss"], hard["loss"], atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------- schedules
def test_jigsaw_only_after_warmup_on_about_apply_prob_of_batches(micro, images):
    model = _mjp(micro, warmup_fraction=0.25, apply_prob=0.5)
    g = torch.Generator().manual_seed(0)
    assert not any(model.jigsaw_applies(p, g) for p in torch.linspace(0, 0.249, 50).tolist())
    draws = [model.jigsaw_applies(0.6, g) for _ in range(400)]
    assert 0.42 <= sum(draws) / 400 <= 0.58, sum(draws)
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert [model.jigsaw_applies(0.6, g1) for _ in range(30)] == [model.jigsaw_applies(0.6, g2) for _ in range(30)]
    x, y = images(2, size=32), torch.tensor([0, 1])
    assert model((x, y), progress=0.1)["jigsaw"] == 0
    always = _mjp(micro, apply_prob=1.0)
    assert always((x, y), progress=0.5)["jigsaw"] == 1 and always((x, y))["jigsaw"] == 1  # None: no schedule


def _official_cosine_scheduler(base, final, epochs, niter_per_ep, warmup_epochs):
    """The official MJP ``utils.cosine_scheduler`` (DeiT / BEiT's), written out as the reference."""
    warmup = np.linspace(0, base, warmup_epochs * niter_per_ep) if warmup_epochs > 0 else np.array([])
    iters = np.arange(epochs * niter_per_ep - warmup_epochs * niter_per_ep)
    return np.concatenate((warmup, final + 0.5 * (base - final) * (1 + np.cos(np.pi * iters / len(iters)))))


def test_dal_weight_schedules(micro):
    official = _mjp(micro, dal_schedule="official")  # the official recipe: 300 epochs, 20 of warm-up
    reference = _official_cosine_scheduler(0.01, 0.005, 300, 1, 20)
    ours = np.array([official.dal_weight_at(e / 300) for e in range(300)])
    assert np.abs(ours - reference).max() < 1e-12
    assert ours[0] == 0.0 and ours[19] == pytest.approx(0.01) and ours[18] < 0.01  # the warm-up ends at epoch 19
    assert ours[20] == pytest.approx(0.01) and official.dal_weight_at(1.0) == pytest.approx(ours[-1])
    assert 0.005 < ours[-1] < 0.00501 and official.dal_weight_at(None) == 0.01
    short = _mjp(micro, dal_schedule="official", warmup_fraction=0.2, schedule_epochs=10)
    assert [short.dal_weight_at(e / 10 + 0.01) for e in range(10)] == pytest.approx(
        _official_cosine_scheduler(0.01, 0.005, 10, 1, 2).tolist())
    constant = _mjp(micro)
    assert {constant.dal_weight_at(p) for p in (0.0, 0.5, 1.0, None)} == {0.01}
    with pytest.raises(ObjectiveError, match="progress"):
        constant.dal_weight_at(1.5)
    with pytest.raises(ObjectiveError, match="schedule_epochs"):
        MJPConfig(schedule_epochs=1, warmup_fraction=0.9).validate()


# ---------------------------------------------------------------------------------------------- learning
def test_mjp_learns_a_small_labelled_set(micro, images):
    torch.manual_seed(0)
    model = _mjp(micro, warmup_fraction=0.1)
    x, y = images(8, size=32), torch.arange(8) % 4
    with torch.no_grad():
        before = model.eval()((x, y))["ce"].item()  # ~ln 4
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    shuffled = 0
    for step in range(100):
        out = model((x, y), progress=step / 100, generator=g)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        shuffled += int(out["jigsaw"].item())
    assert 30 <= shuffled <= 60, shuffled  # ~half of the 90 post-warm-up batches
    with torch.no_grad():
        after = model.eval()((x, y))
    # measured (seeds 0-4): clean CE 1.39 -> 0.36-0.44 (label smoothing 0.1 bounds it below), accuracy 8/8
    assert after["ce"].item() < 0.5 * before and after["acc"] >= 0.875, (before, after)


# ---------------------------------------------------------------------------------------------- a static step
def test_every_training_step_feeds_a_mask_so_e_unk_is_never_unused(micro, images):
    """The jigsaw is computed every step and selected on the device: on a step without it the images pass
    unchanged with an all-False mask, so E_unk gets a zero gradient (not None) and DDP needs no unused-parameter
    search; the metrics stay device tensors."""
    model = _mjp(micro, apply_prob=1.0, warmup_fraction=0.5)
    assert model.leaves_parameters_unused is False
    x, y = images(4, size=32), torch.tensor([0, 1, 2, 3])
    for progress, shuffled in ((torch.full((), 0.25), False), (torch.full((), 0.75), True)):
        model.zero_grad()
        out = model((x, y), progress=progress)
        out["loss"].backward()
        assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in out.values())
        grad = model.backbone.unknown_pos_embed.grad
        assert grad is not None and bool(grad.abs().sum() > 0) is shuffled
        assert bool(out["jigsaw"]) is shuffled
        images_in, unknown_pos = model.apply_jigsaw(x, progress)
        assert unknown_pos.shape == (4, 64) and bool(unknown_pos.any()) is shuffled
        assert torch.equal(images_in, x) is not shuffled
    never = _mjp(micro, ratio=0.0)
    _, mask = never.apply_jigsaw(x, 0.5)
    assert mask.shape == (4, 64) and not mask.any()
    assert never.eval().apply_jigsaw(x, 0.5) == (x, None)


def test_a_step_draws_from_the_global_streams_and_never_syncs(micro, images):
    """generator=None: the masks, the permutation and the coin come from the default generator (what a trainer
    checkpoints), so re-seeding repeats the step exactly; the PCA map too runs without a host sync."""
    x, y = images(4, size=32), torch.tensor([0, 1, 2, 3])
    for dal in ("mlp", "pca"):
        model = _mjp(micro, apply_prob=0.5, warmup_fraction=0.0, dal=dal)
        losses = []
        for _ in range(2):
            torch.manual_seed(11)
            losses.append(model((x, y), progress=torch.full((), 0.5))["loss"])
        assert torch.equal(*losses)
        counts = count_step(lambda m=model: m((x, y), progress=torch.full((), 0.5))["loss"].backward())
        assert counts.num_syncs == 0, (dal, dict(counts.syncs))


def test_schedules_on_tensor_progress_equal_the_float_path(micro):
    official = _mjp(micro, dal_schedule="official")
    floats = [official.dal_weight_at(e / 300) for e in range(300)] + [official.dal_weight_at(1.0)]
    tensors = [official.dal_weight_at(torch.full((), e / 300)) for e in range(300)] + [
        official.dal_weight_at(torch.full((), 1.0))]
    assert all(isinstance(t, torch.Tensor) for t in tensors)
    torch.testing.assert_close(torch.stack(tensors), torch.tensor(floats, dtype=torch.float32))
    assert _mjp(micro).dal_weight_at(torch.full((), 0.3)) == 0.01  # constant: the float
    model = _mjp(micro, warmup_fraction=0.25, apply_prob=1.0)
    assert not any(bool(model.jigsaw_applies(torch.full((), p))) for p in (0.0, 0.1, 0.249))
    assert all(bool(model.jigsaw_applies(torch.full((), p))) for p in (0.25, 0.6, 1.0))


def test_dal_targets_are_a_buffer_outside_the_checkpoint(micro):
    model = _mjp(micro, dal="linear")
    assert torch.equal(model.dal_coords, grid_coords((8, 8)).float())
    assert "dal_coords" not in model.state_dict()
    table = model.backbone.pos_embed()
    torch.testing.assert_close(dal_loss(model.dal, table, coords=model.dal_coords), dal_loss(model.dal, table))


def test_the_count_rule_decides_what_small_grids_accept(micro):
    with pytest.raises(ObjectiveError, match="count_rule"):
        MJPConfig(count_rule="ceil").validate()
    with pytest.raises(ObjectiveError, match=r"int\(0.03 \* 64\) = 1 .* or count_rule='round'"):
        _mjp(micro, ratio=0.03)
    model = _mjp(micro, ratio=0.03, count_rule="round", apply_prob=1.0, warmup_fraction=0.0)
    _, mask = model.apply_jigsaw(torch.zeros(64, 1, 32, 32), 0.5, torch.Generator().manual_seed(0))
    assert int(mask.sum(1).max()) == 2  # round(1.92)
    official = _mjp(micro, ratio=0.15, apply_prob=1.0, warmup_fraction=0.0)
    _, mask = official.apply_jigsaw(torch.zeros(64, 1, 32, 32), 0.5, torch.Generator().manual_seed(0))
    assert int(mask.sum(1).max()) == 9  # int(9.6), the official rule


# ---------------------------------------------------------------------------------------------- validation
def test_bad_configs_and_backbones_raise(micro, images):
    for bad in (dict(ratio=1.0), dict(ratio=-0.1), dict(dal="umap"), dict(dal_schedule="step"),
                dict(apply_prob=1.5), dict(warmup_fraction=1.0), dict(min_block=0), dict(min_aspect=2.0),
                dict(dal_weight=-1.0), dict(label_smoothing=1.0)):
        with pytest.raises(ObjectiveError):
            MJPConfig(**bad).validate()
    with pytest.raises(ObjectiveError, match="unknown MJPConfig field"):
        MJPConfig.from_dict({"gamma": 0.1})
    for mode in ("none", "relbias2d"):
        with pytest.raises(ObjectiveError, match="MJP needs a backbone with pos_embed in"):
            MJP(micro(num_classes=4, pos_embed=mode))
    with pytest.raises(ObjectiveError, match="num_classes"):
        MJP(micro(num_classes=0))
    with pytest.raises(ObjectiveError, match="at least 2"):
        MJP(micro(num_classes=4))  # default gamma = 0.03 selects round(0.48) = 0 of 16 patches
    model = _mjp(micro)
    with pytest.raises(ObjectiveError, match="labels"):
        model(images(2, size=32))
    with pytest.raises(ObjectiveError, match="divide"):
        jigsaw(images(1, size=30), 4, 0.2)
    with pytest.raises(ObjectiveError):
        DALRegressor(32, "svm")
