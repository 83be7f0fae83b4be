"""I-JEPA's multi-block masks with static shapes, drawn on the step's device.

The authors' collator (Assran et al. 2023, "Self-Supervised Learning from Images with a Joint-Embedding Predictive
Architecture", arXiv:2301.08243; official ``src/masks/multiblock.py`` ``MaskCollator``, which StoP's
``src/mask_generators.py`` repeats for its configs), per batch:

* one target-block size and one context-block size (``_sample_block_size``): **one** uniform ``u`` sets both the
  scale and the aspect, ``max_keep = int(N * scale)``, ``h = round(sqrt(max_keep * aspect))``,
  ``w = round(sqrt(max_keep / aspect))``, each clipped to the grid side minus one (the context's aspect is 1);
* per sample, ``num_targets`` target blocks at ``top ~ randint(0, H - h)``, ``left ~ randint(0, W - w)`` (the upper
  bound is exclusive: a block never touches the last row or column), then the context block at such a place minus
  every target block (``_sample_block_mask`` with the targets' complements as acceptable regions);
* a context keeping ``<= min_keep`` patches is redrawn at a new place; after each 20 failures (``tries``) the last
  target still removed from it no longer is;
* the context index lists (raster order) are cut to the batch's shortest, the target lists to ``h * w``: both
  lengths change every batch.

:class:`MultiBlockMasker` keeps the shapes of the run fixed, so a GPU step is one graph:

* the context keeps K = ``context_keep`` patches, its first K in raster order (as the collator keeps the first
  indices); by default K is the collator's expected batch minimum at the per-device batch, from a fixed-seed
  calibration on the host at construction (:func:`calibrated_keep`: deterministic per grid and config). A sample
  whose context keeps fewer than K is redrawn by the collator's own retry ladder, every candidate drawn at once and
  the first valid one chosen by tensor ops; its last rung (no target removed) always holds K (checked at
  construction), so every sample finds one;
* target indices are padded to T = the largest block the scale and aspect ranges give on the grid
  (``target_len``), with ``target_valid`` (T,) marking the batch's ``h * w`` real ones (the same for every block: one
  size per batch).

Everything after construction runs as tensor ops on the masker's device from the global RNG (or ``generator``): no
host synchronisation, no host-built data, no per-sample Python loop.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn

from .common import ObjectiveError

OFFICIAL_TRIES = 20  # the collator's redraws per rung of its ladder (``og_timeout``)
CALIBRATION_SAMPLES = 32768  # samples of the calibration of K, shared by the pairs of block sizes by their odds
CALIBRATION_CHUNK = 512  # (and at least this many per pair)
CALIBRATION_SEED = 0


@dataclass(frozen=True)
class MultiBlockMasks:
    """I-JEPA masks of a batch: ``context`` (B, K) and ``targets`` (B, num_targets, T) patch indices (raster order),
    ``target_valid`` (T,) bool: which target slots are real (the rest repeat the block's first patch)."""

    context: torch.Tensor
    targets: torch.Tensor
    target_valid: torch.Tensor


def official_block_size(u: float, grid: tuple[int, int], scale: tuple[float, float],
                        aspect: tuple[float, float]) -> tuple[int, int]:
    """The collator's ``_sample_block_size`` at the uniform draw ``u`` (in float64, as its ``.item()`` makes it).

    The official code has no lower bound (a zero side makes its sampling loop spin forever); here a side is >= 1."""
    height, width = grid
    max_keep = int(height * width * (scale[0] + u * (scale[1] - scale[0])))
    ratio = aspect[0] + u * (aspect[1] - aspect[0])
    h, w = round(math.sqrt(max_keep * ratio)), round(math.sqrt(max_keep / ratio))
    return max(1, min(h, height - 1)), max(1, min(w, width - 1))


def size_table(grid: tuple[int, int], scale: tuple[float, float],
               aspect: tuple[float, float]) -> tuple[list[float], list[tuple[int, int]]]:
    """The official block size as a step function of ``u`` in [0, 1): ``(edges, sizes)``, ``sizes[i]`` holding on
    ``[edges[i - 1], edges[i])`` (``len(edges) == len(sizes) - 1``).

    The size only changes where ``int(N * scale)`` steps (``N * scale`` an integer) or a rounded side does
    (``max_keep * aspect`` or ``max_keep / aspect`` a half-integer squared): between consecutive such points the
    size is the official one at their midpoint."""
    height, width = grid
    n = height * width
    (s0, s1), (a0, a1) = scale, aspect
    keeps = range(int(n * s0), int(n * s1) + 1)
    cuts = {(m / n - s0) / (s1 - s0) for m in keeps} if s1 > s0 else set()
    if a1 > a0:
        for m in keeps:
            for k in range(max(height, width) + 1):
                square = (k + 0.5) ** 2
                cuts |= {(square / max(m, 1) - a0) / (a1 - a0), (m / square - a0) / (a1 - a0)}
    points = [0.0, *sorted(c for c in cuts if 0 < c < 1), 1.0]
    edges: list[float] = []
    sizes: list[tuple[int, int]] = []
    for low, high in itertools.pairwise(points):
        size = official_block_size((low + high) / 2, grid, scale, aspect)
        if sizes and sizes[-1] == size:
            edges[-1] = high
        else:
            sizes.append(size)
            edges.append(high)
    return edges[:-1], sizes


def _rectangles(top: torch.Tensor, left: torch.Tensor, size: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """(..., H, W) bool: rectangles of ``size`` (2,) at ``top``, ``left`` (...)."""
    rows = torch.arange(grid[0], device=top.device)
    cols = torch.arange(grid[1], device=top.device)
    in_rows = (rows >= top[..., None]) & (rows < (top + size[0])[..., None])
    in_cols = (cols >= left[..., None]) & (cols < (left + size[1])[..., None])
    return in_rows[..., :, None] & in_cols[..., None, :]


def _first_indices(mask: torch.Tensor, count: int) -> torch.Tensor:
    """(B, n) bool with >= ``count`` True per row -> (B, count) long: the first ``count`` True positions, ascending
    (the k-th is where the running count first reaches k + 1: a search, not a sort)."""
    running = mask.to(torch.int32).cumsum(-1, dtype=torch.int32)
    wanted = torch.arange(1, count + 1, device=mask.device, dtype=torch.int32).expand(mask.shape[0], -1)
    return torch.searchsorted(running, wanted.contiguous())


def _block_indices(top: torch.Tensor, left: torch.Tensor, size: torch.Tensor, length: int,
                   width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Raster indices (..., length) of rectangles of ``size`` at ``top``, ``left`` (...), padded past their area
    with their first patch, and the (length,) validity of the slots."""
    slot = torch.arange(length, device=top.device)
    row, col = slot // size[1], slot % size[1]
    index = (top[..., None] + row) * width + left[..., None] + col
    valid = slot < size[0] * size[1]
    return torch.where(valid, index, index[..., :1]), valid


class MultiBlockMasker(nn.Module):
    """I-JEPA multi-block masks of fixed shapes for a grid (module docstring); ``masker(batch)`` draws a batch.

    ``context_keep``: K (None: :func:`calibrated_keep` at ``calibration_batch``, the per-device batch of the
    authors' recipe); ``tries``: candidates per rung of the retry ladder (the official 20)."""

    def __init__(self, grid: tuple[int, int], *, num_targets: int = 4,
                 target_scale: tuple[float, float] = (0.15, 0.2), target_aspect: tuple[float, float] = (0.75, 1.5),
                 context_scale: tuple[float, float] = (0.85, 1.0), min_keep: int = 4,
                 context_keep: int | None = None, calibration_batch: int = 128, tries: int = OFFICIAL_TRIES) -> None:
        super().__init__()
        self.grid = grid = (int(grid[0]), int(grid[1]))
        if min(grid) < 2 or num_targets < 1 or tries < 1:
            raise ObjectiveError(f"multi-block masks need a grid of at least 2 x 2, num_targets >= 1 and tries >= 1, "
                                 f"got {grid}, {num_targets}, {tries}")
        self.num_targets, self.min_keep, self.tries = num_targets, min_keep, tries
        target_edges, target_sizes = size_table(grid, tuple(target_scale), tuple(target_aspect))
        context_edges, context_sizes = size_table(grid, tuple(context_scale), (1.0, 1.0))
        self.target_len = max(h * w for h, w in target_sizes)
        smallest = min(h * w for h, w in context_sizes)
        if smallest <= min_keep:
            raise ObjectiveError(f"could not leave more than min_keep={min_keep} context patches on a {grid} grid: "
                                 f"the context block can be {smallest} patches; lower min_keep or raise context_scale")
        for name, edges, sizes in (("target", target_edges, target_sizes), ("context", context_edges, context_sizes)):
            self.register_buffer(f"{name}_edges", torch.tensor(edges, dtype=torch.float32), persistent=False)
            self.register_buffer(f"{name}_sizes", torch.tensor(sizes, dtype=torch.long), persistent=False)
        if context_keep is None:
            context_keep = calibrated_keep(grid, num_targets, tuple(target_scale), tuple(target_aspect),
                                           tuple(context_scale), min_keep, calibration_batch, tries)
        if not 1 <= context_keep <= smallest:
            raise ObjectiveError(f"context_keep must be in [1, {smallest}] (the smallest context block on a {grid} "
                                 f"grid), got {context_keep}")
        self.context_keep = int(context_keep)
        self.register_buffer("grid_sides", torch.tensor(grid), persistent=False)
        # the context block's places (top, left), over the range its smallest size allows
        span = (grid[0] - min(h for h, _ in context_sizes), grid[1] - min(w for _, w in context_sizes))
        place = torch.arange(span[0] * span[1])
        self.register_buffer("place_rows", place // span[1], persistent=False)
        self.register_buffer("place_cols", place % span[1], persistent=False)

    def extra_repr(self) -> str:
        return f"grid={self.grid}, context_keep={self.context_keep}, target_len={self.target_len}"

    def forward(self, batch: int, generator: torch.Generator | None = None) -> MultiBlockMasks:
        targets, valid, context, _ = self.draw(batch, max(self.context_keep, self.min_keep + 1), generator)
        return MultiBlockMasks(_first_indices(context.flatten(1), self.context_keep), targets, valid)

    def draw(self, batch: int, need: int, generator: torch.Generator | None = None, u: torch.Tensor | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One batch: target indices (B, num_targets, T), their validity (T,), the context (B, H, W) bool whose
        samples keep >= ``need`` patches each, and each sample's context count (B,); ``u`` (2,): the uniforms of
        the target and context sizes (None: drawn).

        The collator's ladder in closed form: rung r (the first nt - r targets removed) draws ``tries`` uniform
        places and takes the first valid one, so it succeeds with probability 1 - (1 - v / P)^tries (v of its P
        places valid) and then lands on a uniform valid place; the first rung to succeed is taken. Every rung and
        place is scored at once (integral images), so nothing loops on the draws."""
        (height, width), nt, device = self.grid, self.num_targets, self.target_edges.device
        if u is None:
            u = torch.rand(2, generator=generator, device=device)  # target size first, as the collator draws them
        t_size = self.target_sizes[torch.searchsorted(self.target_edges, u[:1], right=True)][0]  # (2,): h, w
        c_size = self.context_sizes[torch.searchsorted(self.context_edges, u[1:], right=True)][0]
        draws = torch.randint(2**31, (batch, nt, 2), generator=generator, device=device)
        t_top, t_left = (draws % (self.grid_sides - t_size)).unbind(-1)  # randint(0, H - h): biased < H / 2^31
        targets, valid = _block_indices(t_top, t_left, t_size, self.target_len, width)
        blocks = _rectangles(t_top, t_left, t_size, self.grid)
        unions = [torch.zeros_like(blocks[:, 0])]  # the union of the first e target blocks, e = 0..nt
        for j in range(nt):
            unions.append(unions[-1] | blocks[:, j])
        removed = torch.stack(unions[::-1], dim=1)  # (B, nt + 1, H, W): what rung r removes from the context
        integral = nn.functional.pad(removed.to(torch.int32).cumsum(-1, dtype=torch.int32).cumsum(
            -2, dtype=torch.int32), (1, 0, 1, 0)).flatten(1)
        # every place the context block may take (places past this batch's range are masked out)
        sides = self.grid_sides - c_size
        in_range = (self.place_rows < sides[0]) & (self.place_cols < sides[1])  # (P,)
        bottom = (self.place_rows + c_size[0]).clamp_max(height)
        right = (self.place_cols + c_size[1]).clamp_max(width)
        rows = torch.stack([bottom, self.place_rows, bottom, self.place_rows])  # (4, P): corners + - - +
        cols = torch.stack([right, right, self.place_cols, self.place_cols])
        rung_base = torch.arange(nt + 1, device=device).view(-1, 1, 1) * ((height + 1) * (width + 1))
        index = (rung_base + rows * (width + 1) + cols).flatten()  # (nt + 1, 4, P)
        reads = integral.gather(1, index.expand(batch, -1)).view(batch, nt + 1, 4, -1)
        overlap = reads[:, :, 0] - reads[:, :, 1] - reads[:, :, 2] + reads[:, :, 3]
        counts = c_size[0] * c_size[1] - overlap  # (B, nt + 1, P) context patches kept
        ok = (counts >= need) & in_range
        share = ok.sum(-1) / (sides[0] * sides[1])  # (B, nt + 1) valid share of the places
        coins = torch.rand(batch, nt + 1 + ok.shape[-1], generator=generator, device=device)
        succeeds = coins[:, :nt + 1] < 1 - (1 - share) ** self.tries  # the last rung always does
        rung = succeeds.to(torch.int32).argmax(dim=1, keepdim=True)  # (B, 1) the first that succeeds
        ok = ok.gather(1, rung[:, :, None].expand(-1, -1, ok.shape[-1])).squeeze(1)  # (B, P)
        place = torch.where(ok, coins[:, nt + 1:], -1.0).argmax(dim=1)  # uniform among the valid places
        count = counts.gather(1, rung[:, :, None].expand(-1, -1, ok.shape[-1])).squeeze(1).gather(1, place[:, None])
        inside = _rectangles(self.place_rows[place], self.place_cols[place], c_size, self.grid)
        cut = removed.gather(1, rung.view(batch, 1, 1, 1).expand(-1, 1, height, width)).squeeze(1)
        return targets, valid, inside & ~cut, count.squeeze(1)


@functools.lru_cache(maxsize=64)
def calibrated_keep(grid: tuple[int, int], num_targets: int, target_scale: tuple[float, float],
                    target_aspect: tuple[float, float], context_scale: tuple[float, float], min_keep: int,
                    batch: int = 128, tries: int = OFFICIAL_TRIES) -> int:
    """The official collator's expected batch minimum of the context count (its K) at ``batch``, rounded.

    Per pair of block sizes (the size tables give each its exact probability), the context counts of its share
    of :data:`CALIBRATION_SAMPLES` samples drawn by the collator's rule (a context keeps > ``min_keep``) give their
    distribution F, and E[min of ``batch``] = sum_k (1 - F(k - 1))^batch: every sample informs the tail, where the
    mean of batch minima would use one sample a batch. The places come from a fixed-seed host generator, so K is
    deterministic per grid and config and the training RNG is untouched."""
    masker = MultiBlockMasker(grid, num_targets=num_targets, target_scale=target_scale, target_aspect=target_aspect,
                              context_scale=context_scale, min_keep=min_keep, context_keep=1, tries=tries)
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    expected = 0.0
    for t_u, t_weight in _intervals(size_table(grid, target_scale, target_aspect)[0]):
        for c_u, c_weight in _intervals(size_table(grid, context_scale, (1.0, 1.0))[0]):
            u = torch.tensor([t_u, c_u], dtype=torch.float32)
            chunks = max(1, round(t_weight * c_weight * CALIBRATION_SAMPLES / CALIBRATION_CHUNK))
            counts = torch.cat([masker.draw(CALIBRATION_CHUNK, min_keep + 1, generator, u)[3] for _ in range(chunks)])
            at_least = (counts[:, None] >= torch.arange(1, int(counts.max()) + 1)).double().mean(0)  # P(count >= k)
            expected += t_weight * c_weight * float((at_least ** batch).sum())
    return round(expected)


def _intervals(edges: list[float]) -> list[tuple[float, float]]:
    """(midpoint, length) of each interval of a size table's step function on [0, 1)."""
    points = [0.0, *edges, 1.0]
    return [((low + high) / 2, high - low) for low, high in itertools.pairwise(points)]


@functools.lru_cache(maxsize=16)
def _masker(grid: tuple[int, int], device: str, **config) -> MultiBlockMasker:
    return MultiBlockMasker(grid, **config).to(device)


def multiblock_masks(batch: int, grid: tuple[int, int], *, num_targets: int = 4,
                     target_scale: tuple[float, float] = (0.15, 0.2), target_aspect: tuple[float, float] = (0.75, 1.5),
                     context_scale: tuple[float, float] = (0.85, 1.0), min_keep: int = 4,
                     context_keep: int | None = None, generator: torch.Generator | None = None,
                     device: torch.device | str = "cpu") -> MultiBlockMasks:
    """One batch of :class:`MultiBlockMasker` masks (a masker per configuration and device, built once)."""
    masker = _masker((int(grid[0]), int(grid[1])), str(device), num_targets=num_targets,
                     target_scale=tuple(target_scale), target_aspect=tuple(target_aspect),
                     context_scale=tuple(context_scale), min_keep=min_keep, context_keep=context_keep)
    return masker(batch, generator)
