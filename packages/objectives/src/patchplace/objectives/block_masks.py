"""Block-shaped mask generators shared by the methods that need them (written once).

* :func:`blockwise_mask` — BEiT's block-wise masking generator (Bao et al. 2022, ``MaskingGenerator``), which MJP
  uses to select the patches it shuffles (MJP Alg. 1 line 3). Rectangles of random area (>= ``min_block``) and
  log-uniform aspect in [min_aspect, 1/min_aspect] are added until ``round(ratio * N)`` patches are selected; as in
  BEiT, a rectangle may only add up to the patches still missing, and the loop stops after 10 failed attempts,
  so on small grids the count can fall slightly short. Drawn **per sample** (MJP's official code: one per batch).
* :func:`multiblock_masks` — I-JEPA's multi-block collator (Assran et al. 2023, used by StoP) with static shapes,
  drawn on the device: :mod:`.multiblock` (re-exported here).
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from .multiblock import MultiBlockMasks, multiblock_masks

__all__ = ["MultiBlockMasks", "blockwise_mask", "blockwise_masks", "multiblock_masks"]


def _blockwise(grid: tuple[int, int], ratio: float, min_block: int, min_aspect: float, max_block: int | None,
               rng: random.Random) -> np.ndarray:
    # NumPy, not torch, for the tiny per-rectangle reads and writes: the same draws and the same masks, ~4x
    # faster (each torch op on a few patches costs microseconds of dispatch).
    h, w = grid
    target = round(ratio * h * w)
    max_block = max_block or target
    log_aspect = (math.log(min_aspect), math.log(1 / min_aspect))
    mask = np.zeros((h, w), dtype=bool)
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
                new = bh * bw - int(np.count_nonzero(mask[top: top + bh, left: left + bw]))
                if 0 < new <= budget:
                    mask[top: top + bh, left: left + bw] = True
                    delta = new
            if delta > 0:
                break
        if delta == 0:
            break
        count += delta
    return mask


def blockwise_mask(grid: tuple[int, int], ratio: float, *, min_block: int = 8, min_aspect: float = 0.3,
                   max_block: int | None = None, rng: random.Random | None = None) -> torch.Tensor:
    """One (h, w) bool mask with ~``round(ratio * h * w)`` patches selected in rectangular blocks (BEiT)."""
    return torch.from_numpy(_blockwise(grid, ratio, min_block, min_aspect, max_block, rng or random.Random()))


def blockwise_masks(batch: int, grid: tuple[int, int], ratio: float, *, min_block: int = 8,
                    min_aspect: float = 0.3, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, N) bool: an independent block-wise mask per sample, raster order; deterministic given ``generator``."""
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    rng = random.Random(seed)
    masks = [_blockwise(grid, ratio, min_block, min_aspect, None, rng).reshape(-1) for _ in range(batch)]
    return torch.from_numpy(np.stack(masks)) if masks else torch.zeros(0, grid[0] * grid[1], dtype=torch.bool)
