"""Frozen-backbone evaluations: linear probe, layer-wise kNN probe (MP3 App. C), position probe (DropPos Table 7).

Every probe takes iterables of ``(inputs, labels)`` batches (e.g. a DataLoader over shards) and never updates the
backbone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from patchplace.models import Backbone
from patchplace.objectives import get_method, method_names

from .metrics import topk_correct
from .probe_recipes import ProbeRecipe, train_probe

Batches = Iterable[tuple[torch.Tensor, torch.Tensor]]


# Which pooled feature a checkpoint's training trained (docs/design.md); each method declares it where it is
# registered (``patchplace.objectives.register_method``) and the pipelines record it in the checkpoint metadata.
# "patch_mean" runs the patch tokens alone, without the class token (methods that never feed it: its value is
# untrained; I-JEPA, StoP, RandSAC), "mean" / "cls" the full sequence with it (MP3 feeds the class token since it
# follows §3.1: its checkpoints record "mean").
PROBE_FEATURES = ("cls", "mean", "patch_mean")


def probe_feature_of(metadata: dict, backbone: Backbone) -> str:
    """The feature to probe for a checkpoint: its recorded ``probe_feature``. A checkpoint that does not record it
    predates MP3 feeding its class token: ``patch_mean`` for the methods that average the patch outputs (registered
    probe feature ``mean`` or ``patch_mean``, e.g. MP3, I-JEPA), the head's pooling (``global_pool``)
    otherwise."""
    feature = metadata.get("probe_feature")
    if feature is None:
        method = metadata.get("method")
        averaged = method in method_names() and get_method(method).probe_feature in ("mean", "patch_mean")
        feature = "patch_mean" if averaged else backbone.config.global_pool
    check_feature(feature, backbone)
    return feature


def check_feature(feature: str, backbone: Backbone) -> None:
    if feature not in PROBE_FEATURES:
        raise ValueError(f"probe feature must be one of {PROBE_FEATURES}, got {feature!r}")
    if feature == "cls" and backbone.cls_token is None:
        raise ValueError("probe feature 'cls' needs a class token; use 'mean' or 'patch_mean'")
    if feature == "patch_mean" and backbone.config.pos_embed == "relbias2d" and backbone.cls_token is not None:
        raise ValueError("probe feature 'patch_mean' drops the class token, which a relbias2d backbone's bias table "
                         "includes: probe it with 'mean'")


def embed_tokens(backbone: Backbone, x: torch.Tensor, feature: str) -> torch.Tensor:
    """The token sequence a probe runs: patch tokens + PE, with the class token unless ``feature`` is
    ``patch_mean`` (then exactly what I-JEPA / StoP / RandSAC pretraining fed the blocks)."""
    if feature == "patch_mean":
        return backbone.pos_drop(backbone.patch_embed(x) + backbone.pos_embed())
    return backbone.embed(x)


def _pool(tokens: torch.Tensor, backbone: Backbone, feature: str) -> torch.Tensor:
    if feature == "cls":
        return tokens[:, 0]
    if feature == "mean":
        return tokens[:, backbone.num_prefix_tokens:].mean(dim=1)
    return tokens.mean(dim=1)  # patch_mean: the sequence holds patch tokens only


@torch.no_grad()
def layer_features(backbone: Backbone, x: torch.Tensor, layers: Sequence[int], pool: str = "mean",
                   norm: bool = True) -> dict[int, torch.Tensor]:
    """Pooled outputs of the given blocks (0-based; -1 = last) for one batch; ``norm`` applies the final norm.
    ``pool`` is a probe feature (:data:`PROBE_FEATURES`): ``cls``, ``mean`` or ``patch_mean``."""
    check_feature(pool, backbone)
    depth = len(backbone.blocks)
    wanted = {layer % depth for layer in layers}
    out, h = {}, embed_tokens(backbone, x, pool)
    for i, block in enumerate(backbone.blocks):
        h = block(h)
        if i in wanted:
            out[i] = _pool(backbone.norm(h) if norm else h, backbone, pool)
    return out


@torch.no_grad()
def extract_features(backbone: Backbone, batches: Batches, *, layers: Sequence[int] = (-1,), pool: str = "mean",
                     norm: bool = True, device: torch.device | str = "cpu"
                     ) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """{block index: (N, D) features} and (N,) labels over all batches (eval mode, no grad)."""
    was_training = backbone.training
    backbone.eval()
    feats: dict[int, list[torch.Tensor]] = {}
    labels = []
    try:
        for x, y in batches:
            for layer, f in layer_features(backbone, x.to(device), layers, pool, norm).items():
                feats.setdefault(layer, []).append(f.float().cpu())
            labels.append(y.cpu())
    finally:
        backbone.train(was_training)
    return {k: torch.cat(v) for k, v in feats.items()}, torch.cat(labels)


def subsample_per_class(labels: torch.Tensor, fraction: float, seed: int = 0) -> torch.Tensor:
    """Indices of a class-balanced ``fraction`` of the samples (at least one per class), e.g. 1% labels."""
    g = torch.Generator().manual_seed(seed)
    keep = []
    for c in labels.unique():
        idx = (labels == c).nonzero().squeeze(1)
        n = max(1, round(fraction * len(idx)))
        keep.append(idx[torch.randperm(len(idx), generator=g)[:n]])
    return torch.cat(keep).sort().values


def linear_probe(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, test_y: torch.Tensor, *,
                 num_classes: int, epochs: int = 100, lr: float = 1e-2, weight_decay: float = 0.0,
                 batch_size: int = 256, seed: int = 0, progress: Callable[[], object] | None = None,
                 recipe: ProbeRecipe | None = None) -> dict[str, float]:
    """Linear classifier on in-memory frozen features, tested on ``test_x``: by default a non-affine BatchNorm in
    front (MAE's linear probe), AdamW, a per-step cosine to 0; ``recipe`` (:class:`ProbeRecipe`) replaces all of
    it (then ``epochs`` / ``lr`` / ``weight_decay`` / ``batch_size`` are the recipe's). Returns test top-1 /
    top-5. ``progress`` is called after every epoch (e.g. a bar's update)."""
    recipe = recipe or ProbeRecipe(lr=lr, weight_decay=weight_decay, batch_size=batch_size, epochs=epochs)
    head = train_probe(recipe, lambda index: (train_x[index], train_y[index]), len(train_x), train_x.shape[1],
                       num_classes, seed=seed, progress=progress)
    with torch.no_grad():
        correct = topk_correct(head(test_x), test_y)
    return {"top1": correct[1] / len(test_y), "top5": correct[5] / len(test_y)}


@torch.no_grad()
def knn_classify(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, test_y: torch.Tensor, *,
                 num_classes: int, k: int = 20, temperature: float = 0.07, chunk: int = 1024) -> dict[str, float]:
    """Weighted kNN on cosine similarity (votes exp(sim / T) of the k nearest training features, as DINO)."""
    train_x, test_x = F.normalize(train_x, dim=1), F.normalize(test_x, dim=1)
    k = min(k, len(train_x))
    correct = {1: 0, 5: 0}
    for start in range(0, len(test_x), chunk):
        sim, idx = (test_x[start: start + chunk] @ train_x.T).topk(k, dim=1)
        votes = torch.zeros(len(sim), num_classes).scatter_add_(1, train_y[idx], (sim / temperature).exp())
        for key, n in topk_correct(votes, test_y[start: start + chunk]).items():
            correct[key] += n
    return {"top1": correct[1] / len(test_y), "top5": correct[5] / len(test_y)}


def knn_probe_per_layer(backbone: Backbone, train: Batches, test: Batches, *, num_classes: int, k: int = 20,
                        temperature: float = 0.07, device: torch.device | str = "cpu",
                        pool: str = "mean") -> dict[int, float]:
    """MP3 App. C: kNN top-1 of every layer's average-pooled representation (block outputs, before the final
    norm), keyed by 1-based layer index. ``pool="patch_mean"`` runs the patch tokens without the class token (for
    backbones whose pretraining never fed it)."""
    if pool == "cls":
        raise ValueError("the layer-wise kNN probe averages patch outputs (MP3 App. C): pool 'mean' or 'patch_mean'")
    layers = list(range(len(backbone.blocks)))
    tr, tr_y = extract_features(backbone, train, layers=layers, pool=pool, norm=False, device=device)
    te, te_y = extract_features(backbone, test, layers=layers, pool=pool, norm=False, device=device)
    return {layer + 1: knn_classify(tr[layer], tr_y, te[layer], te_y, num_classes=num_classes, k=k,
                                    temperature=temperature)["top1"] for layer in layers}


def position_probe(backbone: Backbone, train: Batches, test: Batches, *, mask_ratio: float = 0.75, epochs: int = 1,
                   lr: float = 1e-3, device: torch.device | str = "cpu", seed: int = 0,
                   class_token: bool = True) -> dict[str, float]:
    """DropPos Table 7: freeze the backbone, train a linear position head on its patch outputs, with a random
    ``mask_ratio`` of the PEs removed per sample; accuracy is over the tokens whose PE was removed.
    ``class_token=False`` runs the patch tokens alone (backbones whose pretraining never fed the class token).
    The head's initial weights and the masks are drawn from ``seed`` alone (the caller's RNG is left as it was, and
    whatever drew from it before — a DataLoader's workers seed from it — changes nothing)."""
    gen = torch.Generator().manual_seed(seed)
    backbone.eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = nn.Linear(backbone.embed_dim, backbone.num_patches)
    head = head.to(device)
    opt = torch.optim.AdamW(head.parameters(), lr=lr)

    def features(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            tokens = backbone.patch_embed(x)
            b, n, _ = tokens.shape
            dropped = torch.rand(b, n, generator=gen).argsort(1).argsort(1).to(x.device) < round(mask_ratio * n)
            pos = torch.where(dropped.unsqueeze(-1), 0.0, backbone.pos_embed())
            tokens = tokens + pos
            prefix = backbone.num_prefix_tokens if class_token else 0
            out = backbone.forward_tokens(backbone.prepend_cls(tokens) if class_token else tokens)
        return out[:, prefix:], dropped

    for _ in range(epochs):
        for x, _ in train:
            out, dropped = features(x.to(device))
            target = torch.arange(out.shape[1], device=device).expand(out.shape[0], -1)
            loss = F.cross_entropy(head(out[dropped]), target[dropped])
            opt.zero_grad()
            loss.backward()
            opt.step()
    hits = total = 0
    with torch.no_grad():
        for x, _ in test:
            out, dropped = features(x.to(device))
            target = torch.arange(out.shape[1], device=device).expand(out.shape[0], -1)
            hits += int((head(out[dropped]).argmax(-1) == target[dropped]).sum())
            total += int(dropped.sum())
    return {"top1": hits / max(total, 1), "mask_ratio": mask_ratio}
