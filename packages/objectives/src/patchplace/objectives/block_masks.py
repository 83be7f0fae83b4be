"""Block-shaped mask generators shared by the methods that need them (written once).

* :func:`blockwise_mask` — BEiT's block-wise masking generator (Bao et al. 2022, ``MaskingGenerator``), which MJP
  uses to select the patches it shuffles (MJP Alg. 1 line 3). Rectangles of random area (>= ``min_block``) and
  log-uniform aspect in [min_aspect, 1/min_aspect] are added until ``round(ratio * N)`` patches are selected; as in
  BEiT, a rectangle may only add up to the patches still missing, and the loop stops after 10 failed attempts,
  so on small grids the count can fall slightly short. Drawn **per sample** (MJP's official code: one per batch).
* :func:`multiblock_masks` — I-JEPA's multi-block collator (Assran et al. 2023, used by StoP): per batch one
  target-block size (scale 0.15-0.2, aspect 0.75-1.5) and one context-block size (scale 0.85-1.0, aspect 1);
  per sample 4 target blocks at random places and a context block minus every target block; index lists are
  truncated to the shortest in the batch so they stack (as the official collator does, keeping the first indices).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from .common import ObjectiveError


def blockwise_mask(grid: tuple[int, int], ratio: float, *, min_block: int = 8, min_aspect: float = 0.3,
                   max_block: int | None = None, rng: random.Random | None = None) -> torch.Tensor:
    """One (h, w) bool mask with ~``round(ratio * h * w)`` patches selected in rectangular blocks (BEiT)."""
    h, w = grid
    rng = rng or random.Random()
    target = round(ratio * h * w)
    max_block = max_block or target
    log_aspect = (math.log(min_aspect), math.log(1 / min_aspect))
    mask = torch.zeros(h, w, dtype=torch.bool)
    count = 0
    while count < target:
        budget = min(target - count, max_block)
        delta = 0
        for _ in range(10):  # BEiT: up to 10 attempts per rectangle
            area = rng.uniform(min_block, budget)
            aspect = math.exp(rng.uniform(*log_aspect))
            bh, bw = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
            if bw < w and bh < h:
                top, left = rng.randint(0, h - bh), rng.randint(0, w - bw)
                new = bh * bw - int(mask[top: top + bh, left: left + bw].sum())
                if 0 < new <= budget:
                    mask[top: top + bh, left: left + bw] = True
                    delta = new
            if delta > 0:
                break
        if delta == 0:
            break
        count += delta
    return mask


def blockwise_masks(batch: int, grid: tuple[int, int], ratio: float, *, min_block: int = 8,
                    min_aspect: float = 0.3, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, N) bool: an independent block-wise mask per sample, raster order; deterministic given ``generator``."""
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    rng = random.Random(seed)
    return torch.stack([blockwise_mask(grid, ratio, min_block=min_block, min_aspect=min_aspect, rng=rng).reshape(-1)
                        for _ in range(batch)])


@dataclass(frozen=True)
class MultiBlockMasks:
    """I-JEPA masks of a batch: ``context`` (B, K) indices and ``targets`` (B, n_targets, T) indices."""

    context: torch.Tensor
    targets: torch.Tensor


def _block_size(gen: torch.Generator, grid: tuple[int, int], scale: tuple[float, float],
                aspect: tuple[float, float]) -> tuple[int, int]:
    h, w = grid
    s = scale[0] + float(torch.rand(1, generator=gen)) * (scale[1] - scale[0])
    a = aspect[0] + float(torch.rand(1, generator=gen)) * (aspect[1] - aspect[0])
    area = s * h * w
    bh, bw = round(math.sqrt(area * a)), round(math.sqrt(area / a))
    return max(1, min(bh, h - 1)), max(1, min(bw, w - 1))


def _place(gen: torch.Generator, grid: tuple[int, int], size: tuple[int, int]) -> torch.Tensor:
    h, w = grid
    top = int(torch.randint(0, h - size[0] + 1, (1,), generator=gen))
    left = int(torch.randint(0, w - size[1] + 1, (1,), generator=gen))
    block = torch.zeros(h, w, dtype=torch.bool)
    block[top: top + size[0], left: left + size[1]] = True
    return block


def multiblock_masks(batch: int, grid: tuple[int, int], *, num_targets: int = 4,
                     target_scale: tuple[float, float] = (0.15, 0.2), target_aspect: tuple[float, float] = (0.75, 1.5),
                     context_scale: tuple[float, float] = (0.85, 1.0), min_keep: int = 4,
                     generator: torch.Generator | None = None, max_tries: int = 20) -> MultiBlockMasks:
    """I-JEPA multi-block masks for a batch (see module docstring)."""
    gen = generator or torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,))))
    target_size = _block_size(gen, grid, target_scale, target_aspect)
    context_size = _block_size(gen, grid, context_scale, (1.0, 1.0))
    contexts, targets = [], []
    for _ in range(batch):
        for _ in range(max_tries):
            blocks = [_place(gen, grid, target_size) for _ in range(num_targets)]
            context = _place(gen, grid, context_size) & ~torch.stack(blocks).any(0)
            if int(context.sum()) >= min_keep:
                break
        else:
            raise ObjectiveError(f"could not leave {min_keep} context patches on a {grid} grid with {num_targets} "
                                 f"target blocks of {target_size}: lower num_targets or target_scale")
        contexts.append(context.reshape(-1).nonzero().squeeze(1))
        targets.append(torch.stack([b.reshape(-1).nonzero().squeeze(1) for b in blocks]))
    keep = min(len(c) for c in contexts)
    return MultiBlockMasks(context=torch.stack([c[:keep] for c in contexts]), targets=torch.stack(targets))
