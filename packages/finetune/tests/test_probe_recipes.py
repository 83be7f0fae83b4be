"""The papers' probe protocols as data: MAE / RandSAC's LARS recipe (lr per 256 scaled to the batch, warm-up,
cosine), VISSL's SGD step recipe, the trainer over stored rows, StoP's logistic regression and the chunked kNN."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from patchplace.finetune import (
    ProbeRecipe,
    knn_classify,
    knn_vote_counts,
    linear_probe,
    logistic_regression,
    score,
    train_probe,
)
from patchplace.finetune.probe_recipes import build_head, build_probe_optimizer, logistic_objective_grad

MAE = ProbeRecipe(head="bn_linear", optimizer="lars", lr=0.1, lr_batch=256, batch_size=16384, epochs=90,
                  warmup_epochs=10, init_std=0.01)
VISSL = ProbeRecipe(head="bn_affine_linear", optimizer="sgd", lr=0.01, lr_batch=256, batch_size=256, epochs=28,
                    schedule="step", milestones=(8, 16, 24), weight_decay=5e-4)


def test_lars_recipe_scales_its_lr_per_256_to_the_batch_warms_up_then_follows_the_cosine():
    assert MAE.peak_lr() == pytest.approx(6.4)  # 0.1 x 16384 / 256 (MAE FINETUNE.md)
    assert ProbeRecipe(lr=0.1, lr_batch=256, batch_size=1024).peak_lr() == pytest.approx(0.4)
    assert ProbeRecipe(lr=0.1, batch_size=1024).peak_lr() == 0.1  # lr_batch 0: absolute
    assert [MAE.lr_at(e) for e in (0, 5, 10)] == pytest.approx([0.0, 3.2, 6.4])
    assert MAE.lr_at(50) == pytest.approx(6.4 * 0.5 * (1 + math.cos(math.pi * 40 / 80)))
    assert MAE.lr_at(89.99) == pytest.approx(0.0, abs=1e-4) and MAE.record()["peak_lr"] == pytest.approx(6.4)


def test_lars_steps_as_maes_lars_weights_adapted_1d_parameters_plain_sgd():
    """One step of the recipe's optimizer (timm's Lars) against MAE util/lars.py's update written out: weights
    (ndim > 1) scaled by the trust ratio 0.001 |p| / |g|, biases by nothing, momentum 0.9, no weight decay."""
    torch.manual_seed(0)
    head = build_head(MAE, 8, 3)
    assert isinstance(head[0], nn.BatchNorm1d) and not head[0].affine and head[0].eps == 1e-6
    assert head[1].bias.abs().sum() == 0 and head[1].weight.std() < 0.02  # trunc-normal 0.01, zero bias
    optimizer = build_probe_optimizer(MAE, head)
    assert type(optimizer).__name__ == "Lars" and [g["always_adapt"] for g in optimizer.param_groups] == [True, False]
    weight, bias = head[1].weight.detach().clone(), head[1].bias.detach().clone()
    for group in optimizer.param_groups:
        group["lr"] = 0.5
    head(torch.randn(16, 8)).logsumexp(1).mean().backward()
    grad_w, grad_b = head[1].weight.grad.clone(), head[1].bias.grad.clone()
    optimizer.step()
    trust = 0.001 * weight.norm() / grad_w.norm()
    torch.testing.assert_close(head[1].weight.detach(), weight - 0.5 * trust * grad_w)
    torch.testing.assert_close(head[1].bias.detach(), bias - 0.5 * grad_b)


def test_vissl_recipe_steps_its_lr_down_at_the_milestones_and_spares_batchnorm_weight_decay():
    assert [VISSL.lr_at(e) for e in (0, 7.99, 8, 15.5, 16, 24, 27.9)] == pytest.approx(
        [0.01, 0.01, 1e-3, 1e-3, 1e-4, 1e-5, 1e-5])
    head = build_head(VISSL, 8, 3)
    assert head[0].affine and head[0].eps == 1e-5  # VISSL eval_mlp: BatchNorm with affine
    optimizer = build_probe_optimizer(VISSL, head)
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["nesterov"]
    decays = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    assert decays[id(head[1].weight)] == decays[id(head[1].bias)] == 5e-4
    assert decays[id(head[0].weight)] == decays[id(head[0].bias)] == 0.0


@pytest.mark.parametrize(("fields", "message"), [
    ({"optimizer": "adam"}, "optimizer must be one of"), ({"head": "mlp"}, "head must be one of"),
    ({"schedule": "step"}, "milestones"), ({"milestones": (8,)}, "milestones"),
    ({"schedule": "step", "milestones": (16, 8)}, "milestones"), ({"warmup_epochs": 100}, "warm-up"),
    ({"lr": 0.0}, "lr must be > 0"), ({"momentum": 1.0}, "momentum")])
def test_a_recipe_that_cannot_train_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ProbeRecipe(**fields).validate()


def blobs(n: int, classes: int = 4, dim: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % classes
    centres = torch.randn(classes, dim, generator=g) * 3
    return centres[y] + torch.randn(n, dim, generator=g), y


@pytest.mark.parametrize("recipe", [ProbeRecipe(epochs=30), ProbeRecipe(**{**VISSL.__dict__, "epochs": 9}),
                                    ProbeRecipe(**{**MAE.__dict__, "batch_size": 64, "epochs": 6, "warmup_epochs": 2})])
def test_the_trainer_reads_rows_by_sorted_index_is_seeded_and_leaves_the_callers_rng(recipe, tmp_path):
    x, y = blobs(300)
    stored = np.lib.format.open_memmap(tmp_path / "f.npy", mode="w+", dtype=np.float32, shape=tuple(x.shape))
    stored[:] = x.numpy()
    asked = []

    def rows(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        asked.append(index)
        return torch.from_numpy(np.ascontiguousarray(stored[index.numpy()])), y[index]

    torch.manual_seed(123)
    heads = [train_probe(recipe, rows, 300, 16, 4, seed=s) for s in (0, 0, 1)]
    after = torch.rand(1)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(1), after), "the caller's RNG is where it was"
    assert all(torch.equal(a, b) for a, b in zip(heads[0].state_dict().values(), heads[1].state_dict().values(),
                                                 strict=True))
    assert not torch.equal(heads[0][-1].weight, heads[2][-1].weight)
    assert all(bool((i[1:] > i[:-1]).all()) for i in asked), "batches are read in sorted order"
    per_epoch = -(-300 // min(recipe.batch_size, 300))
    assert len(asked) == 3 * recipe.epochs * per_epoch
    if recipe.optimizer == "adamw":  # (LARS and VISSL's SGD move a fresh head slowly: their lr is for 90 / 28 epochs)
        assert score(heads[0], [(x[i:i + 64], y[i:i + 64]) for i in range(0, 300, 64)])["top1"] > 0.95


def test_linear_probe_keeps_its_in_memory_interface():
    x, y = blobs(200)
    assert linear_probe(x[:150], y[:150], x[150:], y[150:], num_classes=4, epochs=40)["top1"] >= 0.96
    custom = linear_probe(x[:150], y[:150], x[150:], y[150:], num_classes=4, recipe=ProbeRecipe(epochs=3))
    assert set(custom) == {"top1", "top5"}


def test_logistic_regression_is_stops_objective_at_its_optimum_and_matches_scikit_learn():
    x, y = blobs(120, classes=3, dim=6, seed=2)
    x = x * torch.tensor([1.0, 10.0, 0.1, 3.0, 1.0, 5.0]) + 2  # standardization matters
    lambd = 0.0025 * 400  # a stronger penalty than StoP's keeps the problem well conditioned for the comparison
    model = logistic_regression(x, y, 3, lambd, tolerance=1e-10)
    assert logistic_objective_grad(model, x, y, lambd).abs().max() < 1e-6, "the gradient vanishes at the solution"
    torch.testing.assert_close(model.mean, x.double().mean(0))
    torch.testing.assert_close(model.std, x.double().std(0))
    sklearn = pytest.importorskip("sklearn.linear_model")
    z = ((x.double() - model.mean) / model.std).numpy()
    # scikit-learn: C sum(loss) + |W|^2 / 2  ==  (1 / (C n)) ... : C = 1 / (lambda_eff n) with lambda_eff = lambd / n
    reference = sklearn.LogisticRegression(C=1 / lambd, fit_intercept=False, tol=1e-12, max_iter=10000).fit(z, y)
    np.testing.assert_allclose(model.weight.numpy(), reference.coef_, rtol=1e-4, atol=1e-6)
    assert (model.logits(x).argmax(1).numpy() == reference.predict(z)).all()


def test_logistic_regression_standardizes_a_constant_feature_without_dividing_by_zero():
    x, y = blobs(30, classes=3, dim=4)
    x[:, 2] = 5.0
    model = logistic_regression(x, y, 3)
    assert model.std[2] == 1 and bool(model.weight.isfinite().all())


def test_chunked_knn_votes_as_the_whole_matrix_does():
    x, y = blobs(500, classes=5, dim=12, seed=3)
    test_x, test_y = blobs(70, classes=5, dim=12, seed=4)
    whole = knn_classify(x, y, test_x, test_y, num_classes=5, k=20)
    chunks = [(x[i:i + 33], y[i:i + 33]) for i in range(0, 500, 33)]
    blocks = [(test_x[i:i + 16], test_y[i:i + 16]) for i in range(0, 70, 16)]
    counts = knn_vote_counts(chunks, blocks, num_classes=5, k=20)
    assert counts[1] / 70 == whole["top1"] and counts[5] / 70 == whole["top5"]
    assert knn_vote_counts([(x[:7], y[:7])], blocks, num_classes=5, k=20)[1] >= 0  # fewer rows than k
