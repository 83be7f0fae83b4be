"""The static-shape multi-block masks against the authors' collator (I-JEPA ``src/masks/multiblock.py``
``MaskCollator``, arXiv:2301.08243), re-implemented here as its per-sample loop: the block sizes exactly, the
context's fixed length K against the collator's batch minimum, and the places and counts by statistics within
sampling error; then the padding's and the ladder's bounds."""

from __future__ import annotations

import bisect
import math
import random

import pytest
import torch

from patchplace.objectives.multiblock import MultiBlockMasker, calibrated_keep, size_table

TARGET = dict(scale=(0.15, 0.2), aspect=(0.75, 1.5))
CONTEXT = dict(scale=(0.85, 1.0), aspect=(1.0, 1.0))


def official_size(u: float, grid: tuple[int, int], scale, aspect) -> tuple[int, int]:
    """``_sample_block_size``: one uniform for scale and aspect, ``int`` of the area, sides clipped below the grid."""
    height, width = grid
    mask_scale = scale[0] + u * (scale[1] - scale[0])
    max_keep = int(height * width * mask_scale)
    ratio = aspect[0] + u * (aspect[1] - aspect[0])
    h = round(math.sqrt(max_keep * ratio))
    w = round(math.sqrt(max_keep / ratio))
    while h >= height:
        h -= 1
    while w >= width:
        w -= 1
    return h, w


def official_batch(batch: int, grid: tuple[int, int], rng: random.Random, u: tuple[float, float],
                   min_keep: int = 10, num_targets: int = 4) -> list[tuple[list[set[int]], set[int]]]:
    """The collator's per-sample loop: (target blocks, untruncated context) per sample, sizes from ``u``."""
    height, width = grid
    th, tw = official_size(u[0], grid, **TARGET)
    ch, cw = official_size(u[1], grid, **CONTEXT)

    def block(top: int, left: int, h: int, w: int) -> set[int]:
        return {(top + r) * width + left + c for r in range(h) for c in range(w)}

    samples = []
    for _ in range(batch):
        targets = [block(rng.randrange(height - th), rng.randrange(width - tw), th, tw) for _ in range(num_targets)]
        tries, timeout = 0, 20
        while True:
            context = block(rng.randrange(height - ch), rng.randrange(width - cw), ch, cw)
            for region in targets[:max(num_targets - tries, 0)]:
                context -= region
            if len(context) > min_keep:
                break
            timeout -= 1
            if timeout == 0:
                tries, timeout = tries + 1, 20
        samples.append((targets, context))
    return samples


def stratified(n: int) -> list[tuple[float, float]]:
    """Evenly spread size uniforms (the batch's sizes dominate its statistics: paired strata cut the noise)."""
    return [((i + 0.5) / n, ((i + 0.5) * 0.6180339887498949) % 1) for i in range(n)]


@pytest.mark.parametrize("grid", [(14, 14), (8, 8), (16, 16), (7, 9), (28, 28)])
@pytest.mark.parametrize("kind", [TARGET, CONTEXT, dict(scale=(0.05, 0.6), aspect=(0.3, 3.0))])
def test_the_size_table_is_the_official_block_size(grid, kind):
    edges, sizes = size_table(grid, kind["scale"], kind["aspect"])
    rng = random.Random(0)
    for u in [rng.random() for _ in range(3000)] + [i / 997 for i in range(997)]:
        assert sizes[bisect.bisect_right(edges, u)] == official_size(u, grid, **kind), u
    masker = MultiBlockMasker(grid, target_scale=TARGET["scale"], target_aspect=TARGET["aspect"], min_keep=1,
                              context_keep=1)
    assert masker.target_len == max(h * w for h, w in size_table(grid, **TARGET)[1])


def test_the_drawn_sizes_and_places_follow_the_collator():
    """Per sample at the collator's own rule (a context keeps > min_keep): the same block areas, the same share of
    samples covering each patch with a target and with the context, the same context counts."""
    grid, n, batch = (14, 14), 196, 64
    masker = MultiBlockMasker(grid, min_keep=10, context_keep=1)
    gen, rng = torch.Generator().manual_seed(0), random.Random(0)
    ours = {"target": torch.zeros(n), "context": torch.zeros(n), "counts": []}
    theirs = {"target": torch.zeros(n), "context": torch.zeros(n), "counts": []}
    strata = stratified(100)
    for u in strata:
        targets, valid, context, counts = masker.draw(batch, 11, gen, torch.tensor(u, dtype=torch.float32))
        assert int(valid.sum()) == math.prod(official_size(u[0], grid, **TARGET)), "the official target area"
        covered = torch.zeros(batch, n, dtype=torch.bool).scatter_(1, targets.flatten(1), True)
        ours["target"] += covered.sum(0)
        ours["context"] += context.flatten(1).sum(0)
        ours["counts"].append(counts.float())
        assert torch.equal(counts, context.flatten(1).sum(1))
        for blocks, kept in official_batch(batch, grid, rng, u):
            theirs["target"][sorted(set().union(*blocks))] += 1
            theirs["context"][sorted(kept)] += 1
            theirs["counts"].append(torch.tensor([float(len(kept))]))
    samples = batch * len(strata)
    for key in ("target", "context"):  # per-patch shares, within 5 standard errors of their difference
        p, q = ours[key] / samples, theirs[key] / samples
        se = ((p * (1 - p) + q * (1 - q)) / samples).sqrt().clamp_min(1e-3)
        assert ((p - q).abs() / se).max() < 5, key
    a, b = torch.cat(ours["counts"]), torch.cat(theirs["counts"])
    assert abs(a.mean() - b.mean()) < 5 * math.sqrt((a.var() + b.var()) / samples)
    assert abs(a.quantile(0.05) - b.quantile(0.05)) <= 2


def test_the_fixed_context_length_is_the_collators_expected_batch_minimum():
    """K (calibrated once, on its own generator) against the mean batch minimum of the collator at batch 128."""
    grid, batch, strata = (14, 14), 128, stratified(60)
    rng = random.Random(1)
    minima = torch.tensor([float(min(len(kept) for _, kept in official_batch(batch, grid, rng, u))) for u in strata])
    keep = calibrated_keep(grid, 4, TARGET["scale"], TARGET["aspect"], CONTEXT["scale"], 10, batch)
    assert abs(keep - minima.mean()) < 0.5 + 3 * minima.std() / math.sqrt(len(strata)), (keep, minima.mean())
    assert calibrated_keep(grid, 4, TARGET["scale"], TARGET["aspect"], CONTEXT["scale"], 10, batch) == keep
    assert MultiBlockMasker(grid, min_keep=10).context_keep == keep, "the default K is the calibrated one"


def test_short_contexts_take_the_ladder_rarely_and_keep_their_first_k():
    """Samples short of K climb the collator's ladder (the last target blocks stop being removed): rare at 14 x 14
    (measured: ~0.8% of samples); every sample then keeps exactly its first K context patches."""
    grid = (14, 14)
    masker = MultiBlockMasker(grid, min_keep=10)
    gen = torch.Generator().manual_seed(0)
    overlapping = total = 0
    for _ in range(40):
        masks = masker(128, gen)
        assert masks.context.shape == (128, masker.context_keep)
        covered = torch.zeros(128, 196, dtype=torch.bool).scatter_(1, masks.targets.flatten(1), True)
        in_context = torch.zeros(128, 196, dtype=torch.bool).scatter_(1, masks.context, True)
        overlapping += int((covered & in_context).any(1).sum())
        total += 128
        assert (masks.context.diff(dim=1) > 0).all()
    assert overlapping / total < 0.02, overlapping / total


def test_masks_are_drawn_on_the_maskers_device_from_the_global_rng():
    masker = MultiBlockMasker((14, 14), min_keep=10)
    torch.manual_seed(3)
    first = masker(16)
    torch.manual_seed(3)
    again = masker(16)
    assert torch.equal(first.context, again.context) and torch.equal(first.targets, again.targets)
    assert first.context.device == masker.target_edges.device
    assert not masker.state_dict(), "nothing of the masker enters a checkpoint"
