"""The batched mask generators: deterministic given the generator, within their ratio, I-JEPA's multi-block
invariants (ascending raster order, disjoint context and targets, rectangular targets, redraws of small contexts)."""

from __future__ import annotations

import pytest
import torch

from patchplace.objectives import ObjectiveError
from patchplace.objectives.block_masks import blockwise_masks, multiblock_masks


@pytest.mark.parametrize(("grid", "ratio"), [((8, 8), 0.15), ((14, 14), 0.03), ((14, 14), 0.27), ((7, 9), 0.5)])
def test_blockwise_masks_are_deterministic_and_never_exceed_the_ratio(grid, ratio):
    for seed in range(5):
        first = blockwise_masks(32, grid, ratio, generator=torch.Generator().manual_seed(seed))
        again = blockwise_masks(32, grid, ratio, generator=torch.Generator().manual_seed(seed))
        assert first.dtype == torch.bool and torch.equal(first, again)
        assert int(first.sum(1).max()) <= int(ratio * grid[0] * grid[1])  # the official count rule
    assert blockwise_masks(0, (8, 8), 0.15).shape == (0, 64)


def _is_rectangle(index: torch.Tensor, grid: tuple[int, int]) -> bool:
    rows, cols = index // grid[1], index % grid[1]
    h, w = int(rows.max() - rows.min()) + 1, int(cols.max() - cols.min()) + 1
    return h * w == len(index)


def _kept_after_removing(blocks: torch.Tensor, first: int, grid: tuple[int, int], rect: set[int]) -> set[int]:
    return rect - set(blocks[:first].reshape(-1).tolist())


@pytest.mark.parametrize(("batch", "grid"), [(128, (8, 8)), (8, (14, 14))])
def test_batched_multiblock_masks_keep_the_loop_invariants(batch, grid):
    n = grid[0] * grid[1]
    masks = multiblock_masks(batch, grid, generator=torch.Generator().manual_seed(0))
    keep, length = masks.context.shape[1], int(masks.target_valid.sum())
    assert masks.targets.shape[:2] == (batch, 4) and masks.context.shape[0] == batch
    assert keep >= 5 and int(masks.context.max()) < n and int(masks.targets.max()) < n
    assert masks.target_valid[:length].all() and not masks.target_valid[length:].any(), "real slots come first"
    # on these grids the context block is (H - 1) x (W - 1) and has one place: the top-left corner
    rect = {r * grid[1] + c for r in range(grid[0] - 1) for c in range(grid[1] - 1)}
    for b in range(batch):
        ctx, blocks = masks.context[b], masks.targets[b, :, :length]
        assert (ctx.diff() > 0).all() and (blocks.diff(dim=-1) > 0).all(), "ascending raster order"
        assert all(_is_rectangle(t, grid) for t in blocks) and len({t.numel() for t in blocks}) == 1
        assert (masks.targets[b, :, length:] == blocks[:, :1]).all(), "padding repeats the block's first patch"
        # the collator's ladder: every target removed unless that left fewer than K, then the last ones first
        removed = next(e for e in range(4, -1, -1) if len(_kept_after_removing(blocks, e, grid, rect)) >= keep)
        assert set(ctx.tolist()) <= _kept_after_removing(blocks, removed, grid, rect)
        assert ctx.tolist() == sorted(_kept_after_removing(blocks, removed, grid, rect))[:keep], "the first K"
    first, again = (multiblock_masks(batch, grid, generator=torch.Generator().manual_seed(0)) for _ in range(2))
    assert torch.equal(first.context, again.context) and torch.equal(first.targets, again.targets)


def test_batched_multiblock_masks_redraw_small_contexts_and_fail_clearly():
    # min_keep 30 of 64: every sample must still keep more than 30 context patches.
    masks = multiblock_masks(64, (8, 8), num_targets=2, min_keep=30, generator=torch.Generator().manual_seed(0))
    assert masks.context.shape[1] > 30
    with pytest.raises(ObjectiveError, match="could not leave"):  # the 3 x 3 context block can never hold 13
        multiblock_masks(4, (4, 4), num_targets=4, target_scale=(0.5, 0.5), min_keep=12,
                         generator=torch.Generator().manual_seed(0))
    with pytest.raises(ObjectiveError, match="context_keep"):
        multiblock_masks(4, (8, 8), context_keep=50)
