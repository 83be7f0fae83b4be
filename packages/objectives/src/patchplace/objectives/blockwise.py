"""BEiT's block-wise masking generator, drawn for a whole batch at once on the device.

The generator is ``MaskingGenerator`` of BEiT (Bao et al., "BEiT: BERT Pre-Training of Image Transformers",
arXiv:2106.08254; microsoft/unilm ``beit/masking_generator.py``), the class MJP selects its shuffled patches with
(Ren et al., "Masked Jigsaw Puzzle", arXiv:2205.12551, Alg. 1 line 3; yhlleo/MJP ``data/masking_generator.py``):

* target count ``int(ratio * N)`` (yhlleo/MJP ``MaskingGenerator._num_patches_decaying``:
  ``self.num_masking_patches = int(self.num_patches * cur_ratio)``); ``count_rule="round"`` is ``round(ratio * N)``;
* ``__call__``: while fewer than the target are selected, one *round* of ``_mask`` with
  ``budget = min(target - count, max_block)``; a round that adds nothing ends the loop;
* ``_mask``: up to 10 attempts, each a rectangle of area ``uniform(min_block, budget)`` and aspect
  ``exp(uniform(log min_aspect, log 1 / min_aspect))``, ``h = round(sqrt(area aspect))``,
  ``w = round(sqrt(area / aspect))``; if it fits strictly inside the grid, a uniformly random place; accepted when
  it adds ``0 < new <= budget`` patches; the first accepted attempt ends the round.

Batched here: the mask does not change between the attempts of one round, so all 10 attempts of every sample are
evaluated at once against the same mask and the first accepted one is kept: exactly the sequential loop's law. The
rounds are a fixed number (:func:`default_rounds`), so the shapes and the op sequence never depend on the draws (no
host synchronisation, ``torch.compile(fullgraph=True)`` traces it once); a sample that has stopped (target reached,
or a failed round) takes no further rectangle. The only difference from the loop is truncation: a sample that would
need more rounds than the fixed number stops short. :func:`default_rounds` makes that negligible (measured in
``tests/test_block_masks.py`` and docs/methods/mjp.md: at most 1.5e-4 of the samples at ratio 0.5, none measured at
the training ratios); ``rounds`` overrides it.
"""

from __future__ import annotations

import math

import torch

from .common import ObjectiveError, noise_device
from .configs import COUNT_RULES

ATTEMPTS = 10  # BEiT's attempts per rectangle


def target_count(ratio: float, n: int, rule: str = "int") -> int:
    """Patches the generator aims for: ``int(ratio * n)`` (BEiT / official MJP) or ``round(ratio * n)``."""
    if rule == "int":
        return int(ratio * n)
    if rule == "round":
        return round(ratio * n)
    raise ObjectiveError(f"count_rule must be one of {COUNT_RULES}, got {rule!r}")


def default_rounds(target: int, min_block: int) -> int:
    """Fixed rounds that leave truncation negligible: each accepted rectangle adds >= 1 patch, so ``target`` rounds
    are always enough (exact for small targets); otherwise a rectangle usually adds about ``min_block`` or more, and
    5 spare rounds cover the tail (docs/methods/mjp.md: the measured truncation)."""
    return max(0, min(target, math.ceil(target / max(min_block, 1)) + 5))


def _blockwise_rounds(batch: int, grid: tuple[int, int], target: int, *, min_block: int, min_aspect: float,
                      max_block: int, rounds: int, device: torch.device, generator: torch.Generator | None,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask (B, h, w) bool, unfinished (B,) bool): the masks after ``rounds`` rounds, and which samples would still
    draw another round (below the target, no failed round yet): an upper bound of the truncated ones.

    A rectangle's rows and columns are handled as one (B, K, 2) tensor of (height, width), (top, left) and one
    (B, K, 2, max(h, w)) membership of the row and column coordinates: half the ops of two separate axes."""
    h, w = grid
    u = torch.rand(rounds, batch, ATTEMPTS, 5, generator=generator,
                   device=noise_device(device, generator)).to(device)
    log_low, log_high = math.log(min_aspect), math.log(1.0 / min_aspect)
    root_aspect = torch.exp(0.5 * (log_low + (log_high - log_low) * u[..., 1:2]))  # sqrt(aspect), (R, B, K, 1)
    # per round, everything that does not depend on the mask so far, drawn and shaped before the loop
    scales = torch.cat([root_aspect, root_aspect.reciprocal()], dim=-1).unbind(0)  # sqrt(area) -> (height, width)
    lows = (min_block * (1.0 - u[..., 0])).unbind(0)  # area = uniform(min_block, budget) = low + budget u
    ups = u[..., 0].unbind(0)
    places = u[..., 3:5].unbind(0)  # (top, left) = randint(0, size - extent) = floor(u (size - extent + 1))
    size = (h + (w - h) * torch.arange(2, device=device)).float()  # (h, w), built on the device
    size1 = size + 1
    coord = torch.arange(max(h, w), device=device).float()  # row and column coordinates
    mask = torch.zeros(batch, h, w, device=device)  # float: overlaps and updates are batched matmuls
    count = torch.zeros(batch, 1, device=device)
    active = torch.ones(batch, 1, dtype=torch.bool, device=device)
    with torch.autocast(device.type, enabled=False):  # exact counts: no reduced-precision matmul
        for r in range(rounds):
            budget = target - count if max_block >= target else (target - count).clamp_max(max_block)  # (B, 1)
            extent = ((lows[r] + budget * ups[r]).sqrt().unsqueeze(-1) * scales[r]).round()  # (B, K, 2)
            fits = (extent < size).all(dim=-1)
            start = torch.minimum((places[r] * (size1 - extent)).floor(), size - extent)
            inside = ((coord >= start.unsqueeze(-1)) & (coord < (start + extent).unsqueeze(-1))).float()
            rows, cols = inside.unbind(2)  # (B, K, L) each: the rectangle's rows, its columns
            if h != w:
                rows, cols = rows[..., :h], cols[..., :w]
            new = extent.prod(dim=-1) - (torch.bmm(rows, mask) * cols).sum(dim=-1)  # patches it would add
            accept = active & fits & (new > 0) & (new <= budget)
            first = accept.float()
            first = first * (first.cumsum(dim=1) == 1)  # the first accepted attempt ends the round
            rect = torch.bmm((rows * first.unsqueeze(-1)).transpose(1, 2), cols)  # (B, h, w), zero if none
            mask = torch.maximum(mask, rect)
            count = mask.flatten(1).sum(dim=1, keepdim=True)
            active = accept.any(dim=1, keepdim=True)  # a round that adds nothing ends the sample's loop
    return mask > 0, (active & (count < target)).squeeze(1)


def blockwise_masks(batch: int, grid: tuple[int, int], ratio: float, *, min_block: int = 8, min_aspect: float = 0.3,
                    max_block: int | None = None, count_rule: str = "int", rounds: int | None = None,
                    device: torch.device | str | None = None,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, N) bool on ``device``: one independent BEiT block-wise mask per sample, raster order (module docstring).

    ``device`` None = the generator's device (CPU without one). Random numbers come from ``generator`` on its device
    (then moved: the same masks on any device), else from ``device``'s default generator (checkpointed by the
    trainer's RNG state). ``max_block`` None = the target (BEiT's default, and the official MJP training's 75 exceeds
    every training target on 14 x 14). ``rounds`` None = :func:`default_rounds`."""
    h, w = grid
    target = target_count(ratio, h * w, count_rule)
    if device is None:
        device = generator.device if generator is not None else torch.device("cpu")
    device = torch.device(device)
    if target <= 0 or batch == 0:
        return torch.zeros(batch, h * w, dtype=torch.bool, device=device)
    rounds = default_rounds(target, min_block) if rounds is None else rounds
    mask, _ = _blockwise_rounds(batch, grid, target, min_block=min_block, min_aspect=min_aspect,
                                max_block=target if max_block is None else max_block, rounds=rounds, device=device,
                                generator=generator)
    return mask.flatten(1)


def blockwise_mask(grid: tuple[int, int], ratio: float, *, min_block: int = 8, min_aspect: float = 0.3,
                   max_block: int | None = None, count_rule: str = "int",
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """One (h, w) bool block-wise mask (:func:`blockwise_masks` of one sample)."""
    return blockwise_masks(1, grid, ratio, min_block=min_block, min_aspect=min_aspect, max_block=max_block,
                           count_rule=count_rule, generator=generator).view(grid)
