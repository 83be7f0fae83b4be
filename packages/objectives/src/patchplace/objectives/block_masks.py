"""Block-shaped mask generators shared by the methods that need them (written once).

* :func:`blockwise_masks` — BEiT's block-wise masking generator (Bao et al. 2022, ``MaskingGenerator``), which MJP
  uses to select the patches it shuffles (MJP Alg. 1 line 3): rectangles of random area (>= ``min_block``) and
  log-uniform aspect in [min_aspect, 1/min_aspect] until ``int(ratio * N)`` patches are selected, a rectangle
  adding at most the patches still missing, 10 attempts per rectangle. Drawn **per sample** (MJP's official code:
  one per batch), the whole batch at once on the device: :mod:`.blockwise` (re-exported here).
* :func:`multiblock_masks` — I-JEPA's multi-block collator (Assran et al. 2023, used by StoP) with static shapes,
  drawn on the device: :mod:`.multiblock` (re-exported here).
"""

from __future__ import annotations

from .blockwise import blockwise_mask, blockwise_masks
from .multiblock import MultiBlockMasks, multiblock_masks

__all__ = ["MultiBlockMasks", "blockwise_mask", "blockwise_masks", "multiblock_masks"]
