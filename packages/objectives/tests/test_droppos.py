"""DropPos (docs/methods/droppos.md): masking + [MASK] PE, smoothed targets (Eq. 5-7), attentive weights
(Eq. 8-9), the loss
ignoring anchors and masked patches, the evaluation grid, and a tiny learning check. CPU, seconds."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from patchplace.models import create_model
from patchplace.objectives.common import ObjectiveError, num_kept
from patchplace.objectives.droppos import DropPos, DropPosConfig, position_accuracy_grid

SMALL = dict(decoder_dim=32, decoder_depth=1, decoder_heads=2)
PATCH = 4


@pytest.fixture
def make_backbone():
    def make(**overrides):
        torch.manual_seed(0)
        kwargs = dict(img_size=16, patch_size=PATCH, in_chans=3, pos_embed="sincos2d") | overrides
        return create_model("vit_micro", **kwargs)

    return make


@pytest.fixture
def make_model(make_backbone):
    def make(backbone=None, **config):
        backbone = backbone if backbone is not None else make_backbone()
        return DropPos(backbone, DropPosConfig(**(SMALL | config)))

    return make


@pytest.fixture
def images():
    return torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(7))


def _masks(model: DropPos, batch: int, seed: int, gamma: float, gamma_pos: float):
    """The masks ``forward(generator=Generator().manual_seed(seed))`` draws (patch mask first, then the PE drop)."""
    g = torch.Generator().manual_seed(seed)
    ids_vis = model.mask_patches(batch, gamma, "cpu", g)
    dropped = model.drop_positions(batch, ids_vis.shape[1], gamma_pos, "cpu", g)
    return ids_vis, dropped


def _capture_block_inputs(model: DropPos) -> tuple[list[torch.Tensor], torch.utils.hooks.RemovableHandle]:
    seen: list[torch.Tensor] = []
    handle = model.backbone.blocks[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    return seen, handle


def _patch_pixels(position: int, grid_w: int) -> tuple[slice, slice]:
    r, c = divmod(position, grid_w)
    return slice(r * PATCH, (r + 1) * PATCH), slice(c * PATCH, (c + 1) * PATCH)


# ---------------------------------------------------------------------------------------------- position smoothing
@pytest.mark.parametrize("img_size", [16, (16, 8)])
def test_smoothing_rows_normalized_peaked_and_spreading(make_backbone, make_model, img_size):
    model = make_model(make_backbone(img_size=img_size))
    n = model.num_patches
    d2 = model.grid_sq_dist
    diag, spread = [], []
    for sigma in (0.25, 0.5, 1.0, 2.0):
        w = model.smoothing_matrix(sigma)
        # Eq. 5-6: w*(y, j) = exp(-d2 / sigma^2) / sum_k exp(-d2(y, k) / sigma^2); ROWS sum to 1 (not columns).
        torch.testing.assert_close(w.sum(dim=1), torch.ones(n))
        raw = torch.exp(-d2 / sigma**2)
        torch.testing.assert_close(w, raw / raw.sum(dim=1, keepdim=True))
        assert torch.equal(w.argmax(dim=1), torch.arange(n))  # the target of position y peaks at y
        diag.append(w.diagonal().mean())
        spread.append((w * d2).sum(dim=1).mean())  # expected squared distance from y under the target
    # a larger sigma moves mass from y to its neighbours (and further)
    assert all(a > b for a, b in itertools.pairwise(diag))
    assert all(a < b for a, b in itertools.pairwise(spread))
    assert model.smoothing_matrix(1.0)[0, 1] > model.smoothing_matrix(0.5)[0, 1] > 0
    # the official code's column normalization would not give unit rows on a grid with borders
    raw = torch.exp(-d2)
    assert not torch.allclose((raw / raw.sum(dim=0, keepdim=True)).sum(dim=1), torch.ones(n))


def test_sigma_zero_is_exactly_one_hot(make_model):
    model = make_model()
    assert torch.equal(model.smoothing_matrix(0.0), torch.eye(model.num_patches))
    labels = torch.tensor([[3, 0, 15], [7, 7, 1]])
    targets = model.smoothed_targets(labels, 0.0)
    assert torch.equal(targets, torch.nn.functional.one_hot(labels, model.num_patches).float())
    # a tiny sigma underflows every off-diagonal entry but never divides 0 by 0
    assert torch.equal(model.smoothing_matrix(1e-4), torch.eye(model.num_patches))


def test_sigma_schedule(make_model, images):
    model = make_model(sigma_start=1.0, sigma_end=0.0)
    assert model.sigma_at(None) == 1.0
    assert model.sigma_at(0.0) == 1.0
    assert model.sigma_at(0.5) == pytest.approx(0.5)
    assert model.sigma_at(1.0) == 0.0
    assert make_model(sigma_start=2.0, sigma_end=0.5).sigma_at(0.5) == pytest.approx(1.25)
    assert float(model(images, progress=0.5)["sigma"]) == pytest.approx(0.5)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ObjectiveError, match="progress"):
            model.sigma_at(bad)


# ---------------------------------------------------------------------------------------------- config
def test_config_defaults_and_bad_configs(make_backbone):
    c = DropPosConfig()
    assert c.validate() is c
    assert (c.mask_ratio, c.pos_mask_ratio, c.decoder_dim, c.decoder_depth, c.decoder_heads) == (
        .75, .75, None, 2, None)
    paper = DropPosConfig.paper()
    assert (paper.decoder_dim, paper.decoder_depth, paper.decoder_heads) == (512, 2, 16)
    assert (c.sigma_start, c.sigma_end, c.tau) == (1.0, 0.0, 0.1)
    DropPosConfig(tau=float("inf")).validate()
    for bad in (dict(mask_ratio=1.0), dict(pos_mask_ratio=-0.1), dict(decoder_dim=0), dict(decoder_depth=0),
                dict(decoder_heads=0), dict(decoder_dim=30, decoder_heads=4), dict(sigma_start=-1.0),
                dict(sigma_end=float("nan")), dict(tau=0.0), dict(tau=float("nan"))):
        with pytest.raises(ObjectiveError):
            DropPosConfig(**bad).validate()
    with pytest.raises(ObjectiveError, match="sincos2d"):
        DropPos(make_backbone(pos_embed="learned"), DropPosConfig(**SMALL))
    with pytest.raises(ObjectiveError, match="class token"):
        DropPos(make_backbone(class_token=False, global_pool="mean"), DropPosConfig(**SMALL))
    with pytest.raises(ObjectiveError, match="mask_ratio"):
        DropPos(make_backbone(), DropPosConfig(mask_ratio=1.0))


# ---------------------------------------------------------------------------------------------- encoder input (Eq. 3)
def test_dropped_tokens_get_mask_pe_and_kept_tokens_their_sincos_pe(make_model, images):
    model = make_model(mask_ratio=0.5, pos_mask_ratio=0.75, tau=0.1)
    bb = model.backbone
    # zero patch embeddings: what reaches the first block is then exactly the PE part of z'
    bb.patch_embed.register_forward_hook(lambda module, args, out: torch.zeros_like(out))
    bb.pos_table[:, 0] = 0.5  # sincos2d gives CLS a zero PE (as MAE); make "CLS keeps its own PE" observable
    seen, handle = _capture_block_inputs(model)
    model(images, generator=torch.Generator().manual_seed(3))
    handle.remove()
    b, n, v = images.shape[0], model.num_patches, num_kept(model.num_patches, 0.5)
    masked_input = next(t for t in seen if t.shape[1] == 1 + v)
    reference_input = next(t for t in seen if t.shape[1] == 1 + n)

    ids_vis, dropped = _masks(model, b, 3, 0.5, 0.75)
    assert ids_vis.shape == (b, v)
    assert (dropped.sum(dim=1) == v - num_kept(v, 0.75)).all()  # per sample gamma_pos
    assert len({tuple(row) for row in ids_vis.tolist()}) > 1  # per-sample masks
    cls_row = bb.prepend_cls(torch.zeros(1, 0, bb.embed_dim))[0, 0]
    sincos = bb.pos_table[0, 1:]  # the fixed sin-cos table (sincos2d buffer)
    mask_pe = model.mask_pos_token[0, 0].detach()
    assert mask_pe.abs().sum() > 0
    for i in range(b):
        assert torch.equal(masked_input[i, 0], cls_row)  # CLS keeps its own PE
        for k in range(v):
            expected = mask_pe if dropped[i, k] else sincos[ids_vis[i, k]]
            assert torch.equal(masked_input[i, 1 + k], expected)
    # attentive reconstruction sees the full image with every true PE (Eq. 9)
    torch.testing.assert_close(reference_input, bb.prepend_cls(bb.pos_embed()).expand(b, -1, -1), rtol=0, atol=0)


def test_mask_token_is_learned(make_model, images):
    model = make_model()
    model(images, generator=torch.Generator().manual_seed(0))["loss"].backward()
    assert model.mask_pos_token.grad is not None and model.mask_pos_token.grad.abs().sum() > 0
    assert model.mask_pos_token.shape == (1, 1, model.backbone.embed_dim)


# ---------------------------------------------------------------------------------------------- loss (Eq. 8)
def test_anchors_contribute_zero_loss(make_model):
    model = make_model()
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 8, model.num_patches, generator=g, requires_grad=True)
    labels = torch.randint(0, model.num_patches, (3, 8), generator=g)
    dropped = torch.rand(3, 8, generator=g) < 0.6
    weights = torch.rand(3, 8, generator=g)
    loss = model.forward_loss(logits, labels, dropped, weights, sigma=0.7)
    loss.backward()
    row_grad = logits.grad.abs().sum(-1)
    assert torch.equal(row_grad[~dropped], torch.zeros(int((~dropped).sum())))  # anchors: exactly zero
    assert (row_grad[dropped] > 0).all()
    # Eq. 8, normalized: sum(w * CE_smooth) / sum(w) over dropped tokens, softmax over all N positions
    targets = model.smoothing_matrix(0.7)[labels]
    ce = -(targets * logits.detach().log_softmax(-1)).sum(-1)
    w = weights * dropped
    torch.testing.assert_close(loss.detach(), (w * ce).sum() / w.sum())
    # changing an anchor's logits or label does not change the loss
    anchor = (~dropped).nonzero()[0]
    logits2, labels2 = logits.detach().clone(), labels.clone()
    logits2[anchor[0], anchor[1]] += 5.0
    labels2[anchor[0], anchor[1]] = (labels2[anchor[0], anchor[1]] + 1) % model.num_patches
    torch.testing.assert_close(model.forward_loss(logits2, labels2, dropped, weights, 0.7), loss.detach())
    # no dropped token at all: zero loss, not nan
    assert float(model.forward_loss(logits.detach(), labels, torch.zeros_like(dropped), weights, 0.7)) == 0.0


def test_masked_patches_contribute_zero_loss(make_model, images):
    model = make_model(mask_ratio=0.5, tau=0.1)
    b, gw = images.shape[0], model.backbone.grid[1]
    ids_vis, _ = _masks(model, b, 5, 0.5, 0.75)
    masked = torch.ones(b, model.num_patches, dtype=torch.bool)
    masked[torch.arange(b)[:, None], ids_vis] = False
    x = images.clone().requires_grad_(True)
    model(x, generator=torch.Generator().manual_seed(5))["loss"].backward()
    for i in range(b):
        for p in range(model.num_patches):
            rows, cols = _patch_pixels(p, gw)
            grad = x.grad[i, :, rows, cols].abs().sum()
            assert (grad == 0) if masked[i, p] else (grad > 0)
    # without attentive weights the loss does not depend on masked pixels at all
    model_inf = make_model(mask_ratio=0.5, tau=float("inf"))
    perturbed = images.clone()
    for i in range(b):
        for p in masked[i].nonzero().flatten().tolist():
            rows, cols = _patch_pixels(p, gw)
            perturbed[i, :, rows, cols] += 3.0
    a = model_inf(images, generator=torch.Generator().manual_seed(5))["loss"]
    c = model_inf(perturbed, generator=torch.Generator().manual_seed(5))["loss"]
    torch.testing.assert_close(a, c, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------ attentive weights (Eq. 9)
def test_attentive_weights(make_model, images):
    model = make_model(tau=0.1)
    b, n = images.shape[0], model.num_patches
    full = model.attention_map(images)
    assert not full.requires_grad
    torch.testing.assert_close(full.sum(dim=1), torch.ones(b))
    # Eq. 9 on the ordinary full-image path of the backbone (patch_embed + PE + CLS, blocks, norm)
    with torch.no_grad():
        f = model.backbone.forward_features(images)
    cos = torch.nn.functional.cosine_similarity(f[:, :1], f[:, 1:], dim=-1)
    torch.testing.assert_close(full, torch.softmax(cos / 0.1, dim=-1))
    for seed in (0, 1):
        ids_vis, _ = _masks(model, b, seed, 0.75, 0.75)
        w = model.attentive_weights(images, ids_vis)
        assert w.shape == ids_vis.shape and not w.requires_grad
        torch.testing.assert_close(w.sum(dim=1), torch.ones(b))
        # the reference forward does not depend on the mask: weights are the full map, gathered and renormalized
        gathered = torch.gather(full, 1, ids_vis)
        torch.testing.assert_close(w, gathered / gathered.sum(dim=1, keepdim=True))
    assert full.std() > 0  # not trivially uniform at tau = 0.1
    # tau = inf: weight 1 for every token and no extra encoder forward
    model_inf = make_model(tau=float("inf"))
    ids_vis, _ = _masks(model_inf, b, 0, 0.75, 0.75)
    assert torch.equal(model_inf.attentive_weights(images, ids_vis), torch.ones(b, num_kept(n, 0.75)))
    seen, handle = _capture_block_inputs(model_inf)
    model_inf(images)
    handle.remove()
    assert len(seen) == 1


# ---------------------------------------------------------------------------------------------- forward + evaluation
def test_forward_outputs_and_determinism(make_model, images):
    model = make_model(mask_ratio=0.5)
    out = model((images, torch.zeros(4)), progress=0.25, generator=torch.Generator().manual_seed(2))
    assert set(out) == {"loss", "pos_acc", "pos_acc_top5", "pos_acc_attn_weighted", "sigma"}
    assert out["loss"].requires_grad and math.isfinite(float(out["loss"].detach()))
    for key in ("pos_acc", "pos_acc_top5", "pos_acc_attn_weighted", "sigma"):
        assert not out[key].requires_grad
    assert 0.0 <= float(out["pos_acc"]) <= float(out["pos_acc_top5"]) <= 1.0
    again = model(images, progress=0.25, generator=torch.Generator().manual_seed(2))
    assert torch.equal(out["loss"], again["loss"])
    logits, _, _ = model.predict_positions(images, 0.5, 0.75, torch.Generator().manual_seed(2))
    assert logits.shape == (4, num_kept(model.num_patches, 0.5), model.num_patches)  # softmax over ALL N positions
    with pytest.raises(ObjectiveError, match="pos_mask_ratio"):
        model(images, pos_mask_ratio=1.0)


def test_plain_and_attention_weighted_position_accuracy(make_model, images):
    """pos_acc counts every dropped-PE token once; pos_acc_attn_weighted (the official log) weights each by A."""
    model = make_model()
    predict = model.predict_positions

    def half_right(*args, **kwargs):  # right for every other visible token, wrong for the rest
        logits, labels, dropped = predict(*args, **kwargs)
        guess = torch.where(torch.arange(labels.shape[1]) % 2 == 0, labels, (labels + 1) % model.num_patches)
        return logits + 100.0 * F.one_hot(guess, model.num_patches), labels, dropped

    model.predict_positions = half_right
    out = model(images, progress=0.5, generator=torch.Generator().manual_seed(3))
    logits, labels, dropped = model.predict_positions(images, 0.75, 0.75, torch.Generator().manual_seed(3))
    hit = (logits.argmax(-1) == labels).float()
    weights = model.attentive_weights(images, labels) * dropped
    assert float(out["pos_acc"]) == pytest.approx(float(hit[dropped].mean()))
    assert float(out["pos_acc_attn_weighted"]) == pytest.approx(float((hit * weights).sum() / weights.sum()))
    assert 0 < float(hit[dropped].mean()) < 1 and float(out["pos_acc"]) != pytest.approx(
        float(out["pos_acc_attn_weighted"]), abs=1e-4)
    flat = make_model(tau=float("inf"))  # no attentive weights: the two accuracies coincide
    predict = flat.predict_positions
    flat.predict_positions = half_right
    same = flat(images, generator=torch.Generator().manual_seed(3))
    assert 0 < float(same["pos_acc"]) < 1
    assert float(same["pos_acc"]) == pytest.approx(float(same["pos_acc_attn_weighted"]))


def test_position_accuracy_grid(make_model, images):
    model = make_model()
    model.train()
    config_before = DropPosConfig(**vars(model.config))
    table = position_accuracy_grid(model, images, generator=torch.Generator().manual_seed(0))
    assert len(table) == 17 and "mean" in table
    cells = {k: v for k, v in table.items() if k != "mean"}
    assert set(cells) == {(g, p) for g in (0.0, 0.25, 0.5, 0.75) for p in (0.25, 0.5, 0.75, 0.95)}
    assert all(0.0 <= v <= 1.0 for v in table.values())
    assert table["mean"] == pytest.approx(sum(cells.values()) / 16)
    assert model.training and model.config == config_before  # mode restored, config not mutated
    assert table == position_accuracy_grid(model, images, generator=torch.Generator().manual_seed(0))
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------------------------------------- learning
def _structured_images(n: int, seed: int, size: int = 16) -> torch.Tensor:
    """Smooth images whose content makes positions inferable: red / green ramps along x / y with random sign
    (which anchors disambiguate), contrast and brightness, a random Gaussian blob in blue, a little noise."""
    g = torch.Generator().manual_seed(seed)
    ys, xs = torch.meshgrid(torch.linspace(-1, 1, size), torch.linspace(-1, 1, size), indexing="ij")
    sx, sy = (torch.randint(0, 2, (2, n, 1, 1), generator=g) * 2 - 1).float()
    contrast = 0.7 + 0.6 * torch.rand(n, 1, 1, generator=g)
    bright = 0.2 * (torch.rand(n, 1, 1, generator=g) - 0.5)
    cy, cx = torch.rand(2, n, 1, 1, generator=g) * 2 - 1
    blob = torch.exp(-((xs - cx) ** 2 + (ys - cy) ** 2) / 0.3)
    img = torch.stack([sx * contrast * xs + bright, sy * contrast * ys + bright, blob], dim=1)
    return img + 0.05 * torch.randn(img.shape, generator=g)


def test_droppos_learns_positions(make_model):
    torch.manual_seed(0)
    model = make_model(mask_ratio=0.5, pos_mask_ratio=0.75, sigma_start=0.0, sigma_end=0.0, tau=float("inf"))
    data = _structured_images(32, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    steps = 200
    for step in range(steps):
        loss = model(data, progress=step / steps, generator=g)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    train = position_accuracy_grid(model, data, (0.5,), (0.75,), torch.Generator().manual_seed(2))["mean"]
    held_out = position_accuracy_grid(model, _structured_images(64, seed=99), (0.5,), (0.75,),
                                      torch.Generator().manual_seed(2))["mean"]
    # measured (torch 2.x CPU, seeds 0-2): ~1.00 train and 0.99-1.00 held-out after 200 steps; chance is 1/16.
    assert train > 0.6, train
    assert held_out > 0.6, held_out


# ---------------------------------------------------------------------------------------------- a static step
def test_sigma_is_tensor_math_on_a_tensor_progress(make_model, images):
    """The trainer's progress is a 0-d tensor: sigma (Eq. 7) and the smoothing (Eq. 5-6) stay tensors, with the
    sigma = 0 one-hot kept exact without a branch on its value; the step's outputs equal the float path's."""
    model = make_model(sigma_start=1.0, sigma_end=0.0)
    for p in (0.0, 0.3, 1.0):
        sigma = model.sigma_at(torch.full((), p))
        assert isinstance(sigma, torch.Tensor) and sigma.dim() == 0
        torch.testing.assert_close(sigma, model.sigma_at(p))
        torch.testing.assert_close(model.smoothing_matrix(sigma), model.smoothing_matrix(1.0 - p))
    assert torch.equal(model.smoothing_matrix(torch.zeros(())), torch.eye(model.num_patches))
    as_float = model(images, progress=0.75, generator=torch.Generator().manual_seed(4))
    as_tensor = model(images, progress=torch.full((), 0.75), generator=torch.Generator().manual_seed(4))
    for key, value in as_float.items():
        assert isinstance(value, torch.Tensor), key
        torch.testing.assert_close(as_tensor[key], value, msg=key)
    assert float(as_tensor["sigma"]) == pytest.approx(0.25)


def test_the_step_embeds_the_patches_once_for_both_forwards(make_model, images):
    """The attention map's full-image forward (Eq. 9) reuses the step's patch embedding: one patch_embed call per
    step, and the same loss as the separate forwards (the map is still the current encoder on the full image)."""
    model = make_model(tau=0.1)
    calls = []
    handle = model.backbone.patch_embed.register_forward_hook(lambda *args: calls.append(1))
    out = model(images, progress=0.5, generator=torch.Generator().manual_seed(6))
    handle.remove()
    assert len(calls) == 1
    logits, labels, dropped = model.predict_positions(images, 0.75, 0.75, torch.Generator().manual_seed(6))
    separate = model.forward_loss(logits, labels, dropped, model.attentive_weights(images, labels), 0.5)
    torch.testing.assert_close(out["loss"], separate, rtol=0, atol=0)
