"""Pretraining step benchmarks (called by ``pipelines/benchmark.py --suite objectives``).

Measures forward + backward + AdamW step time of each objective on the same backbone and batch, interleaved
round-robin in one run so machine noise hits all alike, and reports each one's time ratio to the supervised
step beside its FLOP ratio counted from the shapes (matmul FLOPs of projections, attention and MLPs; a training
step = 3x the forward FLOPs of everything that gets gradients, 1x for no-grad passes such as DropPos's
full-image reference forward).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from patchplace.models import Backbone, create_model
from patchplace.models.benchmark import block_flops

from .common import num_kept
from .droppos import DropPos, DropPosConfig
from .ijepa import IJEPA, IJEPAConfig
from .mae import MAE, MAEConfig
from .mjp import MJP, MJPConfig
from .mp3 import MP3, MP3Config
from .randsac import RandSAC, RandSACConfig
from .supervised import Supervised


def _encoder_flops(backbone: Backbone, tokens: int, keys: int | None = None) -> int:
    c = backbone.config
    patch = 2 * backbone.num_patches * (c.patch_size**2 * c.in_chans) * c.embed_dim
    return patch + c.depth * block_flops(tokens, tokens if keys is None else keys, c.embed_dim, c.mlp_ratio)


def _decoder_flops(in_dim: int, dim: int, depth: int, tokens: int, out: int) -> int:
    return 2 * tokens * in_dim * dim + depth * block_flops(tokens, tokens, dim) + 2 * tokens * dim * out


def train_flops(objective: nn.Module) -> int:
    """FLOPs of one training step of ``objective`` (see module docstring for the model)."""
    bb = objective.backbone if hasattr(objective, "backbone") else objective
    n, d = bb.num_patches, bb.embed_dim
    if isinstance(objective, (Supervised, MJP)):
        flops = 3 * (_encoder_flops(bb, n + 1) + 2 * d * bb.config.num_classes)
        if isinstance(objective, MJP):  # + the DAL regressor on the N PE-table rows (mlp: D -> D -> D -> 2)
            flops += 3 * 2 * n * (2 * d * d + 2 * d)
        return flops
    if isinstance(objective, MP3):
        m = num_kept(n, objective.config.eta)
        return 3 * (_encoder_flops(bb, n, m) + 2 * n * d * n)
    if isinstance(objective, MAE):
        c, k = objective.config, num_kept(n, objective.config.mask_ratio)
        out = bb.config.patch_size**2 * bb.config.in_chans
        return 3 * (_encoder_flops(bb, k + 1) + _decoder_flops(d, c.decoder_dim, c.decoder_depth, n + 1, out))
    if isinstance(objective, DropPos):
        c, k = objective.config, num_kept(n, objective.config.mask_ratio)
        grad = _encoder_flops(bb, k + 1) + _decoder_flops(d, c.decoder_dim, c.decoder_depth, k + 1, n)
        reference = 0 if c.tau == float("inf") else _encoder_flops(bb, n + 1)
        return 3 * grad + reference
    if isinstance(objective, IJEPA):
        c = objective.config
        masks = objective.sample_masks(64, torch.Generator().manual_seed(0))
        k, t = masks.context.shape[1], masks.targets.shape[2]
        predictor = c.num_targets * _decoder_flops(d, c.predictor_dim, c.predictor_depth, k + t, 0)
        predictor += c.num_targets * 2 * t * c.predictor_dim * d
        return 3 * (_encoder_flops(bb, k) + predictor) + _encoder_flops(bb, n)  # + no-grad target encoder
    if isinstance(objective, RandSAC):
        c, out = objective.config, bb.config.patch_size**2 * bb.config.in_chans
        dd = c.decoder_dim
        cross = 2 * n * dd * dd * 2 + 2 * n * dd * dd * 2 + 2 * n * n * dd * 2  # Q + out, K + V, attention
        layer = block_flops(n, n, dd, c.decoder_mlp_ratio) + cross + 2 * n * d * dd  # + memory projection
        return 3 * (_encoder_flops(bb, n) + c.decoder_depth * layer + 2 * n * dd * out)
    raise TypeError(f"no FLOP model for {type(objective).__name__}")


def default_objectives(in_chans: int = 1, num_classes: int = 10, decoder_dim: int = 128,
                       decoder_depth: int = 2, decoder_heads: int = 4) -> dict[str, Callable[[], nn.Module]]:
    """Builders for the CPU study setting: ``vit_cpu`` (192 x 6, 32 px, patch 4 -> N = 64) for every method."""

    def backbone(pos: str, classes: int = 0) -> Backbone:
        return create_model("vit_cpu", in_chans=in_chans, pos_embed=pos, num_classes=classes)

    predictor = dict(predictor_dim=decoder_dim // 2, predictor_depth=decoder_depth * 2, predictor_heads=decoder_heads)
    return {
        "supervised": lambda: Supervised(backbone("learned", num_classes)),
        "mp3_eta0": lambda: MP3(backbone("none"), MP3Config(eta=0.0)),
        "mp3_eta0.5": lambda: MP3(backbone("none"), MP3Config(eta=0.5)),
        "mp3_eta0.75": lambda: MP3(backbone("none"), MP3Config(eta=0.75)),
        "droppos": lambda: DropPos(backbone("sincos2d"), DropPosConfig(decoder_dim=decoder_dim,
                                                                       decoder_depth=decoder_depth,
                                                                       decoder_heads=decoder_heads)),
        "mae": lambda: MAE(backbone("sincos2d"), MAEConfig(decoder_dim=decoder_dim, decoder_depth=decoder_depth,
                                                           decoder_heads=decoder_heads)),
        # MJP with the jigsaw on every step (the recipe shuffles half the batches after warm-up): the worst case.
        "mjp": lambda: MJP(backbone("learned", num_classes), MJPConfig(ratio=0.15, apply_prob=1.0,
                                                                       warmup_fraction=0.0)),
        "randsac": lambda: RandSAC(backbone("sincos2d"), RandSACConfig(decoder_dim=decoder_dim,
                                                                       decoder_depth=decoder_depth,
                                                                       decoder_heads=decoder_heads)),
        "ijepa": lambda: IJEPA(backbone("sincos2d"), IJEPAConfig(**predictor)),
        "stop": lambda: IJEPA(backbone("sincos2d"), IJEPAConfig(stop=True, **predictor)),
        "stop_noema": lambda: IJEPA(backbone("sincos2d"), IJEPAConfig(stop=True, **predictor)),
    }


def step_times(builders: dict[str, Callable[[], nn.Module]], *, batch: int = 64, img_size: int = 32,
               in_chans: int = 1, num_classes: int = 10, repeats: int = 10, warmup: int = 2,
               seed: int = 0) -> list[dict[str, Any]]:
    """Median step time and FLOPs of each objective, with ratios to ``supervised`` (must be among them).
    Objectives with an EMA target encoder also run its update, unless their name ends in ``_noema``."""
    torch.manual_seed(seed)
    images = torch.randn(batch, in_chans, img_size, img_size)
    labels = torch.randint(0, num_classes, (batch,))
    objectives = {name: build() for name, build in builders.items()}
    optimizers = {name: torch.optim.AdamW([p for p in obj.parameters() if p.requires_grad], lr=1e-4)
                  for name, obj in objectives.items()}
    times: dict[str, list[float]] = {name: [] for name in objectives}
    names = list(objectives)
    for i in range(warmup + repeats):
        for name in names[i % len(names):] + names[: i % len(names)]:  # rotated round-robin: shared noise, no
            obj = objectives[name]  # systematic advantage for whoever runs first in a round
            start = time.perf_counter()
            loss = obj((images, labels), progress=0.5)["loss"]
            optimizers[name].zero_grad(set_to_none=True)
            loss.backward()
            optimizers[name].step()
            if hasattr(obj, "update_target") and not name.endswith("_noema"):  # EMA target encoder (I-JEPA)
                obj.update_target(0.5)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    base_t = statistics.median(times["supervised"])
    base_f = train_flops(objectives["supervised"])
    rows = []
    for name, obj in objectives.items():
        t, f = statistics.median(times[name]), train_flops(obj)
        rows.append({"name": f"pretrain_step/{name}", "step_ms": round(t * 1e3, 1),
                     "time_vs_supervised": round(t / base_t, 3), "gflops_per_sample": round(f / 1e9, 3),
                     "flop_ratio": round(f / base_f, 3), "batch": batch, "threads": torch.get_num_threads()})
    return rows
