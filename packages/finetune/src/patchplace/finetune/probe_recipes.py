"""The papers' frozen-feature probe protocols as data: :class:`ProbeRecipe` (head, optimizer, lr rule, batch,
schedule) trained by :func:`train_probe` on features read in seeded random mini-batches; StoP's low-shot
:func:`logistic_regression` (full batch, its objective summed chunk by chunk); the chunked kNN vote
(:func:`knn_vote_counts`). Memory: a batch / a chunk, whatever the number of stored samples.

Recipes the shipped linear-probe configs use:

* MAE ("Masked Autoencoders Are Scalable Vision Learners", arXiv 2111.06377, App. A.1 Table 10; main_linprobe.py):
  BatchNorm1d(affine=False, eps=1e-6) + Linear (weight trunc-normal std 0.01, bias 0), LARS (momentum 0.9, no
  weight decay), base lr 0.1 per 256 at batch 16384 (6.4), 90 epochs, 10 warm-up epochs then a half-cycle cosine to
  0 by fractional epoch. RandSAC (arXiv 2203.12054, App. B.2 Table 16) states the same values.
* StoP / I-JEPA (arXiv 2308.00566 §4.1; the authors' VISSL linear evaluation
  eval_resnet_8gpu_transfer_in1k_linear.yaml with the vit_*_no_cls head): BatchNorm (affine) + Linear ("eval_mlp"),
  SGD with Nesterov momentum 0.9, lr 0.01 per 256, x0.1 at epochs 8 / 16 / 24 of 28, weight decay 5e-4 (not on the
  BatchNorm), batch 256.
* StoP's 1% probe (logistic_eval.py): multinomial logistic regression without intercept, L2 penalty lambda / n
  (README --lambd 0.0025) on standardized features — :func:`logistic_regression`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .metrics import topk_correct

HEADS = ("bn_linear", "bn_affine_linear", "linear")
OPTIMIZERS = ("adamw", "lars", "sgd")
SCHEDULES = ("cosine", "step")

Rows = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class ProbeRecipe:
    """One linear-probe protocol. ``lr`` is absolute when ``lr_batch`` is 0, else per ``lr_batch`` samples and
    scaled linearly to ``batch_size`` (MAE: ``lr = blr * batch / 256``; VISSL's auto_lr_scaling)."""

    head: str = "bn_linear"  # bn_linear (MAE: BatchNorm without affine) | bn_affine_linear (VISSL) | linear
    optimizer: str = "adamw"  # adamw | lars (timm.optim.Lars, as MAE's LARS) | sgd (Nesterov)
    lr: float = 1e-2
    lr_batch: int = 0
    batch_size: int = 256
    epochs: int = 100
    warmup_epochs: float = 0.0
    schedule: str = "cosine"  # cosine (half cycle to 0, per step) | step (x gamma at each milestone epoch)
    milestones: tuple[int, ...] = ()
    gamma: float = 0.1
    weight_decay: float = 0.0
    momentum: float = 0.9
    init_std: float = 0.0  # > 0: the linear weight trunc-normal with this std and a zero bias; 0: torch's init

    def validate(self) -> None:
        """ValueError naming the field, for a recipe that cannot train."""
        for name, value, choices in (("head", self.head, HEADS), ("optimizer", self.optimizer, OPTIMIZERS),
                                     ("schedule", self.schedule, SCHEDULES)):
            if value not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
        if not (self.lr > 0 and self.batch_size >= 1 and self.epochs >= 1 and self.lr_batch >= 0):
            raise ValueError(f"lr must be > 0, batch size and epochs >= 1 and the lr's batch >= 0, got {self.lr}, "
                             f"{self.batch_size}, {self.epochs}, {self.lr_batch}")
        if not 0 <= self.warmup_epochs < self.epochs:
            raise ValueError(f"warm-up epochs must be in [0, {self.epochs}), got {self.warmup_epochs}")
        if self.weight_decay < 0 or not 0 <= self.momentum < 1 or self.init_std < 0 or not 0 < self.gamma <= 1:
            raise ValueError("weight decay and init std must be >= 0, momentum in [0, 1), gamma in (0, 1]")
        if (self.schedule == "step") != bool(self.milestones) or sorted(self.milestones) != list(self.milestones):
            raise ValueError(f"milestones (increasing epochs) go with the step schedule only, got "
                             f"{list(self.milestones)} with {self.schedule}")

    def peak_lr(self) -> float:
        return self.lr * self.batch_size / self.lr_batch if self.lr_batch else self.lr

    def lr_at(self, epoch: float) -> float:
        """The lr at (fractional) ``epoch``: a linear warm-up from 0, then the cosine (per step, MAE's
        lr_sched.adjust_learning_rate) or the step schedule (per whole epoch, VISSL's multistep)."""
        peak = self.peak_lr()
        if epoch < self.warmup_epochs:
            return peak * epoch / self.warmup_epochs
        if self.schedule == "step":
            return peak * self.gamma ** sum(int(epoch) >= m for m in self.milestones)
        progress = (epoch - self.warmup_epochs) / (self.epochs - self.warmup_epochs)
        return peak * 0.5 * (1.0 + math.cos(math.pi * progress))

    def record(self) -> dict:
        """What results.json records of the recipe (the peak lr after the batch rule included)."""
        return {**asdict(self), "milestones": list(self.milestones), "peak_lr": self.peak_lr()}


def build_head(recipe: ProbeRecipe, dim: int, num_classes: int) -> nn.Sequential:
    linear = nn.Linear(dim, num_classes)
    if recipe.init_std:  # MAE main_linprobe.py: trunc_normal_(head.weight, std=0.01), bias 0 (MoCo v3)
        nn.init.trunc_normal_(linear.weight, std=recipe.init_std)
        nn.init.zeros_(linear.bias)
    if recipe.head == "linear":
        return nn.Sequential(linear)
    norm = (nn.BatchNorm1d(dim, affine=False, eps=1e-6) if recipe.head == "bn_linear"  # MAE
            else nn.BatchNorm1d(dim, eps=1e-5))  # VISSL eval_mlp: BatchNorm with affine, HEAD.BATCHNORM_EPS 1e-5
    return nn.Sequential(norm, linear)


def build_probe_optimizer(recipe: ProbeRecipe, head: nn.Sequential) -> torch.optim.Optimizer:
    """The recipe's optimizer. No weight decay on BatchNorm parameters (VISSL regularize_bn: False); LARS neither
    decays nor adapts 1-D parameters (MAE's util/lars.py), so its weights form an ``always_adapt`` group of
    timm's Lars; SGD and AdamW decay the linear bias (VISSL regularize_bias: True)."""
    norm_params = [p for m in head if isinstance(m, nn.BatchNorm1d) for p in m.parameters()]
    linear = next(m for m in head if isinstance(m, nn.Linear))
    lr, wd = recipe.peak_lr(), recipe.weight_decay
    if recipe.optimizer == "lars":
        from timm.optim import Lars

        groups = [{"params": [linear.weight], "weight_decay": wd, "always_adapt": True},
                  {"params": [linear.bias, *norm_params], "weight_decay": 0.0, "always_adapt": False}]
        return Lars(groups, lr=lr, momentum=recipe.momentum)
    groups = [{"params": [linear.weight, linear.bias], "weight_decay": wd}]
    groups += [{"params": norm_params, "weight_decay": 0.0}] if norm_params else []
    if recipe.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=recipe.momentum, nesterov=recipe.momentum > 0)
    return torch.optim.AdamW(groups, lr=lr)


def train_probe(recipe: ProbeRecipe, rows: Rows, n: int, dim: int, num_classes: int, *, seed: int = 0,
                device: torch.device | str = "cpu", progress: Callable[[], object] | None = None) -> nn.Sequential:
    """Train the recipe's head on ``n`` samples: each epoch a permutation drawn from ``seed`` cut into batches of
    ``min(batch_size, n)``; ``rows(index)`` gives the (features, labels) of a batch (sorted indices: a memory map
    reads them in order). The lr is set before every step (:meth:`ProbeRecipe.lr_at`); a batch of one sample is
    skipped under BatchNorm. The head starts from ``seed`` too (the caller's RNG is left as it was)."""
    recipe.validate()
    batch = min(recipe.batch_size, n)
    per_epoch = -(-n // batch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = build_head(recipe, dim, num_classes)
    head = head.to(device)
    optimizer = build_probe_optimizer(recipe, head)
    order = torch.Generator().manual_seed(seed)
    step = 0
    for _ in range(recipe.epochs):
        head.train()
        for index in torch.randperm(n, generator=order).split(batch):
            lr = recipe.lr_at(step / per_epoch)
            step += 1
            if len(index) < 2 and recipe.head != "linear":
                continue
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = rows(index.sort().values)
            loss = F.cross_entropy(head(x.to(device)), y.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        if progress is not None:
            progress()
    return head.eval()


@torch.no_grad()
def score(predict: Callable[[torch.Tensor], torch.Tensor], batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
          device: torch.device | str = "cpu") -> dict[str, float]:
    """Top-1 / top-5 of ``predict`` (features -> logits) over ``batches`` of (features, labels)."""
    correct, count = {1: 0, 5: 0}, 0
    for x, y in batches:
        for k, hits in topk_correct(predict(x.to(device)).float().cpu(), y).items():
            correct[k] += hits
        count += len(y)
    return {"top1": correct[1] / max(count, 1), "top5": correct[5] / max(count, 1), "count": count}


# ---------------------------------------------------------------------------------------------- logistic regression
@dataclass
class LogisticModel:
    """A multinomial logistic regression on standardized features: ``weight`` (C, D) float64, no intercept."""

    weight: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    iterations: int

    def logits(self, x: torch.Tensor, mean: torch.Tensor | None = None, std: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Logits of ``x`` standardized with (``mean``, ``std``) — default: the training features'."""
        mean = self.mean if mean is None else mean
        std = self.std if std is None else std
        return ((x.double() - mean) / std) @ self.weight.T


def standardization(batches: Iterable[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-feature mean and (unbiased) std over batches of rows, in float64 (a zero std is taken as 1)."""
    total = squares = None
    n = 0
    for x in batches:
        x = x.double()
        total = x.sum(0) if total is None else total + x.sum(0)
        squares = (x * x).sum(0) if squares is None else squares + (x * x).sum(0)
        n += len(x)
    mean = total / n
    var = (squares - n * mean * mean).clamp_min(0) / max(n - 1, 1)
    std = var.sqrt()
    return mean, torch.where(std > 0, std, torch.ones_like(std))


Chunks = Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]]


def logistic_regression(x: torch.Tensor, y: torch.Tensor, num_classes: int, lambd: float = 0.0025, *,
                        max_iter: int = 1000, tolerance: float = 1e-7) -> LogisticModel:
    """StoP's low-shot probe (logistic_eval.py) on in-memory features: :func:`logistic_regression_chunked` of one
    chunk."""
    return logistic_regression_chunked(lambda: [(x, y)], num_classes, lambd, max_iter=max_iter, tolerance=tolerance)


def logistic_regression_chunked(chunks: Chunks, num_classes: int, lambd: float = 0.0025, *, max_iter: int = 1000,
                                tolerance: float = 1e-7) -> LogisticModel:
    """StoP's low-shot probe (logistic_eval.py): features standardized with their own mean / std, then the
    multinomial logistic regression without intercept minimizing ``mean cross-entropy + (lambd / n) / 2 * |W|^2``
    (logistic_eval.py divides --lambd by the sample count; cyanure's l2 penalty is lambda / 2 |w|^2), i.e.
    scikit-learn's ``LogisticRegression(C=1 / lambd, fit_intercept=False)``. ``chunks()`` gives the training
    ``(features, labels)`` afresh, chunk by chunk (e.g. rows of a memory-mapped store).

    Solved full batch in float64 by torch's L-BFGS (strong Wolfe line search) to a gradient norm of
    ``tolerance``: every objective evaluation sums the loss and its gradient chunk by chunk (:func:`objective`),
    so memory is the weights and L-BFGS's history (about ``2 x 20`` vectors of ``C x D`` float64: 16 MB for 10
    classes of 5,120-d features, 1.6 GB for ImageNet's 1,000) plus one chunk, whatever the number of samples.
    The authors' cyanure solver stops at a relative duality gap of 1e-3 within 100 epochs, and also rotates the
    features onto their principal components, which leaves an L2-penalized model without intercept — and so its
    predictions — unchanged (the penalty is rotation invariant): it is not done here."""
    mean, std = standardization(x for x, _ in chunks())
    n = sum(len(y) for _, y in chunks())
    lam = lambd / n
    weight = torch.zeros(num_classes, len(mean), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight], lr=1.0, max_iter=max_iter, tolerance_grad=tolerance,
                                  tolerance_change=1e-14, history_size=20, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        with torch.no_grad():
            loss, grad = objective(chunks, weight, mean, std, n)
            weight.grad = grad + lam * weight
            return loss + 0.5 * lam * (weight * weight).sum()

    optimizer.step(closure)
    iterations = int(optimizer.state[weight].get("n_iter", 0))
    return LogisticModel(weight.detach(), mean, std, iterations)


def objective(chunks: Chunks, weight: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, n: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean cross-entropy of the standardized rows and its gradient in ``weight``, summed chunk by chunk. The
    standardization is folded into the weights (``((x - mean) / std) W^T = x (W / std)^T - (mean / std) W^T``): a
    chunk costs one float64 copy of its rows and its (rows x C) logits."""
    scaled, offset = weight / std, (mean / std) @ weight.T
    loss = torch.zeros((), dtype=torch.float64)
    grad_scaled, grad_offset = torch.zeros_like(weight), torch.zeros_like(offset)
    for x, y in chunks():
        x, y = x.double(), y.long()
        logits = x @ scaled.T - offset
        norm = logits.logsumexp(1)
        loss += (norm - logits.gather(1, y[:, None]).squeeze(1)).sum() / n
        residual = (logits - norm[:, None]).exp_()  # softmax - one-hot, over n
        residual[torch.arange(len(y)), y] -= 1
        residual /= n
        grad_scaled += residual.T @ x
        grad_offset -= residual.sum(0)
    return loss, (grad_scaled + grad_offset[:, None] * mean) / std


def logistic_objective_grad(model: LogisticModel, x: torch.Tensor, y: torch.Tensor, lambd: float) -> torch.Tensor:
    """The gradient of the regression's objective at the solution (its optimality: ~0)."""
    weight = model.weight.clone().requires_grad_(True)
    z = (x.double() - model.mean) / model.std
    loss = F.cross_entropy(z @ weight.T, y.long()) + 0.5 * (lambd / len(z)) * (weight * weight).sum()
    loss.backward()
    return weight.grad


# ---------------------------------------------------------------------------------------------- kNN
@torch.no_grad()
def knn_vote_counts(train_chunks: Iterable[tuple[torch.Tensor, torch.Tensor]],
                    test_blocks: Sequence[tuple[torch.Tensor, torch.Tensor]], *, num_classes: int, k: int = 20,
                    temperature: float = 0.07, device: torch.device | str = "cpu") -> dict[int, int]:
    """Correct top-1 / top-5 counts of the weighted kNN (:func:`~patchplace.finetune.probes.knn_classify`:
    cosine similarity, votes exp(sim / T) of the k nearest) of every test block against the training features
    read chunk by chunk, keeping a running top-k per test sample: memory of the test blocks plus one (block x
    chunk) similarity matrix, whatever the number of training samples."""
    tests = [(F.normalize(x.float().to(device), dim=1), y.to(device)) for x, y in test_blocks]
    best: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(tests)
    for x, y in train_chunks:
        train, labels = F.normalize(x.float().to(device), dim=1), y.to(device)
        for b, (test, _) in enumerate(tests):
            sim = test @ train.T
            kept = 0 if best[b] is None else best[b][0].shape[1]
            if kept:
                sim = torch.cat([best[b][0], sim], dim=1)
            top, where = sim.topk(min(k, sim.shape[1]), dim=1)
            # the labels of the k nearest: from the running top-k (column < kept) or from this chunk
            found = labels[(where - kept).clamp_min(0)]
            if kept:
                found = torch.where(where < kept, best[b][1].gather(1, where.clamp_max(kept - 1)), found)
            best[b] = (top, found)
    correct = {1: 0, 5: 0}
    for (test, y), found in zip(tests, best, strict=True):
        if found is None:
            continue
        votes = torch.zeros(len(test), num_classes, device=device).scatter_add_(1, found[1],
                                                                               (found[0] / temperature).exp())
        for key, hits in topk_correct(votes.cpu(), y.cpu()).items():
            correct[key] += hits
    return correct
