"""I-JEPA + StoP: masks, the sigma = 0 equivalence, EMA target encoder, noise placement, learning."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from patchplace.objectives import IJEPA, IJEPAConfig, ObjectiveError
from patchplace.objectives.block_masks import blockwise_masks, multiblock_masks

SMALL = dict(predictor_dim=32, predictor_depth=1, predictor_heads=2, min_keep=2)


def _model(micro, **config):
    return IJEPA(micro(pos_embed="sincos2d", img_size=32), IJEPAConfig(**{**SMALL, **config}))


def test_multiblock_masks_keep_context_and_targets_apart():
    masks = multiblock_masks(6, (14, 14), generator=torch.Generator().manual_seed(0))
    assert masks.targets.shape[:2] == (6, 4)
    for b in range(6):
        assert not set(masks.context[b].tolist()) & set(masks.targets[b].reshape(-1).tolist())
    sizes = int(masks.target_valid.sum()) / 196
    assert 0.1 <= sizes <= 0.25, "target blocks cover 15-20% of the grid (rounded)"
    assert len({tuple(m.tolist()) for m in masks.context}) > 1, "positions are drawn per sample"


def test_mask_shapes_are_fixed_for_the_run(micro):
    """One (K, T) over 400 batches (the official collator's change every batch: 81 pairs at 14 x 14), K the
    collator's expected batch minimum unless ``context_keep`` sets it; the step reports it as a device tensor."""
    model = IJEPA(micro(pos_embed="sincos2d", img_size=56, patch_size=4), IJEPAConfig(**{**SMALL, "min_keep": 10}))
    assert model.backbone.grid == (14, 14)
    shapes = {(m.context.shape, m.targets.shape, m.target_valid.shape) for m in (model.sample_masks(128)
                                                                                 for _ in range(400))}
    assert len(shapes) == 1, shapes
    (context, targets, valid), = shapes
    assert context == (128, model.masker.context_keep) and 45 <= context[1] <= 56  # the official mean: 50.3
    assert targets == (128, 4, model.masker.target_len) and valid == (model.masker.target_len,)
    fixed = _model(micro, context_keep=7)
    out = fixed(torch.randn(2, 1, 32, 32), generator=torch.Generator().manual_seed(0))
    assert isinstance(out["context_tokens"], torch.Tensor) and float(out["context_tokens"]) == 7.0
    with pytest.raises(ObjectiveError, match="context_keep"):
        IJEPAConfig(context_keep=0).validate()


def _unpadded_loss(model, images, context, targets):
    """The official computation on the batch's T real target tokens: no key mask, a plain mean."""
    b, blocks, t = targets.shape
    s_x = model.encode_context(images, context)
    ctx_in, masked_in = model.predictor_inputs(s_x.repeat_interleave(blocks, 0), context.repeat_interleave(blocks, 0),
                                               targets.reshape(b * blocks, t))
    prediction = model.predictor_proj(model.predictor(torch.cat([ctx_in, masked_in], 1))[:, ctx_in.shape[1]:])
    features = model.targets(images)
    target = torch.stack([features[i, targets[i, j]] for i in range(b) for j in range(blocks)])
    return F.smooth_l1_loss(prediction, target, beta=1.0), target.std(dim=1).mean()


@pytest.mark.parametrize("stop", [False, True])
def test_padded_targets_give_the_unpadded_loss_and_gradients(micro, stop):
    model = _model(micro, stop=stop, sigma=0.0)  # StoP at sigma 0: both paths see the same inputs
    x = torch.randn(3, 1, 32, 32)
    masks = next(m for m in (model.sample_masks(3, torch.Generator().manual_seed(s)) for s in range(50))
                 if int(m.target_valid.sum()) < model.masker.target_len)  # a batch with padding
    t = int(masks.target_valid.sum())
    params = [p for p in model.parameters() if p.requires_grad]
    out = model.loss_on(x, masks)
    padded = torch.autograd.grad(out["loss"], params, allow_unused=True)
    loss, target_std = _unpadded_loss(model, x, masks.context, masks.targets[..., :t])
    reference = torch.autograd.grad(loss, params, allow_unused=True)
    torch.testing.assert_close(out["loss"], loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out["target_std"], target_std, atol=1e-6, rtol=1e-5)
    for a, b in zip(padded, reference, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_blockwise_masks_select_about_the_ratio_in_blocks():
    masks = blockwise_masks(200, (14, 14), 0.15, generator=torch.Generator().manual_seed(0))
    counts = masks.sum(1).float()
    assert counts.max() <= 29 and counts.mean() > 26  # round(0.15 * 196) = 29
    grid = masks[0].reshape(14, 14)
    assert grid.any(0).sum() < grid.sum(), "selected patches come in blocks, not scattered"


def test_stop_at_sigma_zero_equals_ijepa_with_the_mask_token_tied_to_b(micro):
    stop = _model(micro, stop=True, sigma=0.0)
    ijepa = _model(micro, stop=False)
    ijepa.load_state_dict({**stop.state_dict(), "mask_token": stop.predictor.embed.bias.detach().view(1, 1, -1)})
    x = torch.randn(4, 1, 32, 32)
    a = stop(x, generator=torch.Generator().manual_seed(7))["loss"]
    b = ijepa(x, generator=torch.Generator().manual_seed(7))["loss"]
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    noisy = _model(micro, stop=True, sigma=0.25)
    noisy.load_state_dict(stop.state_dict())
    assert not torch.isclose(noisy(x, generator=torch.Generator().manual_seed(7))["loss"], a, atol=1e-5)


def test_stop_noise_goes_through_the_shared_input_layer_on_masked_tokens_only(micro):
    model = _model(micro, stop=True, sigma=0.5)
    s_x = torch.randn(2, 5, 32)
    context, target = torch.arange(5).expand(2, 5), torch.arange(10, 16).expand(2, 6)
    ctx1, m1 = model.predictor_inputs(s_x, context, target, torch.Generator().manual_seed(0))
    ctx2, m2 = model.predictor_inputs(s_x, context, target, torch.Generator().manual_seed(1))
    torch.testing.assert_close(ctx1, ctx2, atol=0, rtol=0)  # context is deterministic by default
    assert (m1 - m2).abs().amax() > 0.01  # masked tokens are stochastic
    with torch.no_grad():  # with A = 0 the noise vanishes: the same A carries features and noise
        model.predictor.embed.weight.zero_()
    _, z1 = model.predictor_inputs(s_x, context, target, torch.Generator().manual_seed(0))
    _, z2 = model.predictor_inputs(s_x, context, target, torch.Generator().manual_seed(1))
    torch.testing.assert_close(z1, z2, atol=0, rtol=0)
    both = _model(micro, stop=True, sigma=0.5, noise_on="both")
    c1, _ = both.predictor_inputs(s_x, context, target, torch.Generator().manual_seed(0))
    c2, _ = both.predictor_inputs(s_x, context, target, torch.Generator().manual_seed(1))
    assert (c1 - c2).abs().amax() > 0.01
    fixed = _model(micro, stop=True, sigma=0.5, covariance="fixed")
    with torch.no_grad():
        fixed.predictor.embed.weight.zero_()
    _, f1 = fixed.predictor_inputs(s_x, context, target, torch.Generator().manual_seed(0))
    _, f2 = fixed.predictor_inputs(s_x, context, target, torch.Generator().manual_seed(1))
    assert (f1 - f2).abs().amax() > 0.01, "fixed covariance noise does not depend on A"


def test_target_encoder_gets_no_gradient_and_ema_moves_it_toward_the_context_encoder(micro):
    model = _model(micro)
    loss = model(torch.randn(2, 1, 32, 32), generator=torch.Generator().manual_seed(0))["loss"]
    loss.backward()
    assert all(p.grad is None and not p.requires_grad for p in model.target_encoder.parameters())
    assert any(p.grad is not None for p in model.backbone.parameters())
    with torch.no_grad():
        for p in model.backbone.parameters():
            p.add_(1.0)
    distance = lambda: float(sum((t - o).detach().abs().sum() for t, o in zip(model.target_encoder.parameters(),  # noqa: E731
                                                                        model.backbone.parameters(), strict=True)))
    before = distance()
    assert model.update_target(0.0) == pytest.approx(0.996)
    assert distance() == pytest.approx(before * 0.996, rel=1e-4)
    assert model.momentum(1.0) == 1.0 and model.momentum(0.5) == pytest.approx(0.998)


def test_bad_configs(micro):
    with pytest.raises(ObjectiveError, match="sigma"):
        IJEPAConfig(sigma=-1).validate()
    with pytest.raises(ObjectiveError, match="noise_on"):
        IJEPAConfig(noise_on="everywhere").validate()
    with pytest.raises(ObjectiveError, match="I-JEPA needs a backbone with pos_embed"):
        IJEPA(micro(pos_embed="learned"))


def test_ijepa_with_stop_learns(micro, images):
    """Learning check: the loss falls clearly on a small fixed set (measured: 0.42 -> 0.10 over 80 steps, while the
    targets keep a spread across tokens of ~0.36, i.e. no collapse)."""
    torch.manual_seed(0)
    model = _model(micro, stop=True, ema_start=0.99)
    x = images(16, size=32)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for step in range(80):
        loss = model(x, progress=step / 80, generator=gen)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.update_target(step / 80)
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.5 * first, (first, last)


def test_stop_noise_is_drawn_where_the_features_are():
    from patchplace.objectives.ijepa import generator_on

    cpu = torch.Generator().manual_seed(0)
    assert generator_on(torch.device("cpu"), cpu) is cpu, "same device: the given generator, its stream unchanged"
    assert generator_on(torch.device("cpu"), None) is None, "no generator: the global RNG"
    if torch.cuda.is_available():  # a seeded host generator fixes the device's draws
        a = generator_on(torch.device("cuda"), torch.Generator().manual_seed(3))
        b = generator_on(torch.device("cuda"), torch.Generator().manual_seed(3))
        assert a.device.type == "cuda"
        draws = [torch.randn(8, generator=g, device="cuda") for g in (a, b)]
        torch.testing.assert_close(*draws)
