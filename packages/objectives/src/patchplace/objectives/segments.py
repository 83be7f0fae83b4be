"""RandSAC segments and serializations (Hua et al. 2022, RandSAC, arXiv:2203.12054, §3.1-§3.3), as pure functions on an
(h, w) token grid, deterministic given a ``torch.Generator``.

Segment generators map every token (raster order) to a segment id 0..K-1 without gaps:

* :func:`square_segments` — M x M squares (§3.2, Table 4);
* :func:`blob_segments` — K random Gaussians, each token goes to the blob of highest density (§3.2, Eq. 1).

:func:`serialize` draws a random order of the segments, flat or hierarchical (§3.3, Fig. 3, Table 7), and returns
``order_ids``: each token's rank of its segment in the sequence (0 = first segment), so that the segment-causal
attention mask is ``order_ids[key] <= order_ids[query]``. :func:`raster_order` and :func:`patch_random_order` are the
segment-free ablations (one token per segment, Tables 1-3).

Every function takes an optional ``batch``: ``None`` gives one sample ((N,) tensors), an int gives (batch, N) with
independent draws per sample (segment ids may take a (B, N) tensor too). Everything is computed on the CPU.
"""

from __future__ import annotations

import math

import torch

from .common import ObjectiveError, grid_coords

# §3.2: blob means ~ U(-1.75, 1.75) and stds ~ U(0.5, 1) per axis, on token positions spread over [-2, 2].
BLOB_MEAN_RANGE = (-1.75, 1.75)
BLOB_STD_RANGE = (0.5, 1.0)
GRID_EXTENT = 2.0


def _check_grid(grid: tuple[int, ...]) -> tuple[int, int]:
    if len(grid) != 2 or min(grid) < 1:
        raise ObjectiveError(f"RandSAC segments need a 2-D token grid (h, w), got {tuple(grid)}")
    return int(grid[0]), int(grid[1])


def token_positions(grid: tuple[int, int]) -> torch.Tensor:
    """(N, 2) normalized (x, y) token positions in [-2, 2]: the top-left token at (-2, -2), the bottom-right one
    at (2, 2) (§3.2). A grid side of 1 sits at -2."""
    h, w = _check_grid(grid)
    rc = grid_coords((h, w)).double()
    x = -GRID_EXTENT + 2 * GRID_EXTENT * rc[:, 1] / max(w - 1, 1)
    y = -GRID_EXTENT + 2 * GRID_EXTENT * rc[:, 0] / max(h - 1, 1)
    return torch.stack([x, y], dim=1)


def _batched(x: torch.Tensor, batch: int | None) -> torch.Tensor:
    return x if batch is None else x.unsqueeze(0).expand(batch, *x.shape).clone()


# ---------------------------------------------------------------------------------------------- segments
def square_segments(grid: tuple[int, int], size: int, batch: int | None = None) -> torch.Tensor:
    """M x M squares in raster order of squares (§3.2: K = hw / M^2). When ``size`` does not divide a side, the
    last row / column of squares is cut short (rectangles of the remaining tokens), so every token still belongs to
    exactly one segment. (N,) or (batch, N) long ids."""
    h, w = _check_grid(grid)
    if size < 1:
        raise ObjectiveError(f"square segment size must be >= 1, got {size}")
    rc = grid_coords((h, w))
    ids = (rc[:, 0] // size) * math.ceil(w / size) + rc[:, 1] // size
    return _batched(ids, batch)


def _sample_gaussians(batch: int, k: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    lo, hi = BLOB_MEAN_RANGE
    mean = lo + (hi - lo) * torch.rand(batch, k, 2, generator=generator, dtype=torch.float64)
    lo, hi = BLOB_STD_RANGE
    std = lo + (hi - lo) * torch.rand(batch, k, 2, generator=generator, dtype=torch.float64)
    return mean, std


def _argmax_density(points: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Eq. 1: index of the axis-aligned Gaussian of highest density at each point. points (B, P, 2), mean / std
    (B, K, 2) -> (B, P). Log-densities, the shared 2 pi constant dropped."""
    z = (points[:, :, None, :] - mean[:, None]) / std[:, None]
    log_density = -0.5 * (z**2).sum(-1) - std.log().sum(-1)[:, None, :]
    return log_density.argmax(-1)


def compact_ids(ids: torch.Tensor) -> torch.Tensor:
    """Relabel ids per sample to 0..K'-1 without gaps, keeping their relative order. (N,) or (B, N)."""
    flat = ids.reshape(-1, ids.shape[-1])
    present = torch.zeros(flat.shape[0], int(flat.max()) + 1, dtype=torch.long).scatter_(1, flat, 1)
    return torch.gather(present.cumsum(1) - 1, 1, flat).reshape(ids.shape)


def blob_segments(grid: tuple[int, int], num_blobs: int, generator: torch.Generator | None = None,
                  batch: int | None = None) -> torch.Tensor:
    """K random Gaussian blobs (§3.2, Eq. 1): means ~ U(-1.75, 1.75)^2, stds ~ U(0.5, 1)^2 on the [-2, 2] grid;
    each token goes to the blob of highest density. A blob may win no token: ids are relabelled to 0..K'-1
    without gaps (K' <= K). (N,) or (batch, N) long ids."""
    if num_blobs < 1:
        raise ObjectiveError(f"num_blobs must be >= 1, got {num_blobs}")
    pos = token_positions(grid)
    mean, std = _sample_gaussians(batch or 1, num_blobs, generator)
    ids = compact_ids(_argmax_density(pos.expand(batch or 1, -1, -1), mean, std))
    return ids if batch is not None else ids[0]


# ---------------------------------------------------------------------------------------------- orders
def raster_order(grid: tuple[int, int], batch: int | None = None) -> torch.Tensor:
    """Ablation *patch-raster* (Table 1-2): one token per segment, in raster order."""
    h, w = _check_grid(grid)
    return _batched(torch.arange(h * w), batch)


def patch_random_order(grid: tuple[int, int], generator: torch.Generator | None = None,
                       batch: int | None = None) -> torch.Tensor:
    """Ablation *patch-random* (Tables 2-3): one token per segment, in random order."""
    h, w = _check_grid(grid)
    return serialize(raster_order((h, w), batch), (h, w), (), generator)


def _centroids(ids: torch.Tensor, pos: torch.Tensor, k: int) -> torch.Tensor:
    """(B, k, 2) mean position of the tokens with each id (0 for ids no token has)."""
    b = ids.shape[0]
    index = ids.unsqueeze(-1).expand(-1, -1, 2)
    sums = torch.zeros(b, k, 2, dtype=pos.dtype).scatter_add(1, index, pos.expand(b, -1, -1))
    counts = torch.zeros(b, k, dtype=pos.dtype).scatter_add(1, ids, torch.ones_like(ids, dtype=pos.dtype))
    return sums / counts.clamp_min(1).unsqueeze(-1)


def partition_segments(segment_ids: torch.Tensor, grid: tuple[int, int], hierarchy: tuple[int, ...],
                       generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Group segments into partitions, level by level (§3.3: "we then group these 7 segments into 3 larger
    partitions following the same logic for segment generation"): for a level with P partitions, sample P Gaussians
    as for blobs and put each group of the level below (a segment, or a partition of the previous level) into the
    partition of highest density at the group's centroid (the mean position of its tokens). Groups are never
    split, so the partitions nest. Returns one (B, N) tensor per level: each token's partition id (not compacted:
    a partition may be empty)."""
    if any(parts < 1 for parts in hierarchy):
        raise ObjectiveError(f"every hierarchy level needs >= 1 partition, got {tuple(hierarchy)}")
    pos = token_positions(grid)
    below = segment_ids
    levels = []
    for parts in hierarchy:
        k = int(below.max()) + 1
        mean, std = _sample_gaussians(below.shape[0], parts, generator)
        group_of = _argmax_density(_centroids(below, pos, k), mean, std)  # (B, k): group below -> partition
        below = torch.gather(group_of, 1, below)
        levels.append(below)
    return levels


def serialize(segment_ids: torch.Tensor, grid: tuple[int, int], hierarchy: tuple[int, ...] = (),
              generator: torch.Generator | None = None, *, return_partitions: bool = False):
    """Random serialization of segments -> ``order_ids``: each token's rank of its segment (0 = first).

    ``hierarchy = ()``: flat, a uniformly random order of the segments (§3.1 stochastic serialization).
    ``hierarchy = (P1, P2, ...)`` with P1 > P2 > ...: segments are grouped into P1 partitions, those into P2, ...
    (:func:`partition_segments`; e.g. blobs "11 -> 7 -> 3" is ``num_blobs=11, hierarchy=(7, 3)``). The order is
    random at every level: a random order of the top partitions, inside each a random order of its sub-partitions,
    ..., inside the lowest partition a random order of its segments — so a partition's segments are contiguous.

    ``segment_ids``: (N,) or (B, N) ids 0..K-1 without gaps (as the generators return). Returns (N,) or (B, N)
    long ranks in 0..K-1, and with ``return_partitions`` also the per-level partition ids of every token."""
    single = segment_ids.dim() == 1
    ids = segment_ids.reshape(1, -1) if single else segment_ids
    h, w = _check_grid(grid)
    if ids.shape[1] != h * w:
        raise ObjectiveError(f"segment_ids cover {ids.shape[1]} tokens but the grid {(h, w)} has {h * w}")
    b, k = ids.shape[0], int(ids.max()) + 1
    levels = partition_segments(ids, (h, w), tuple(hierarchy), generator)
    # Sort keys per segment, lowest level first: a random key per segment, then per partition of each level.
    keys = [torch.rand(b, k, generator=generator)]
    for level in levels:
        group_of = torch.zeros(b, k, dtype=torch.long).scatter_(1, ids, level)  # a segment lies in one partition
        random_key = torch.rand(b, int(level.max()) + 1, generator=generator)
        keys.append(torch.gather(random_key, 1, group_of))
    used = torch.zeros(b, k, dtype=torch.bool).scatter_(1, ids, True)
    keys.append((~used).float())  # ids no token has (only in batches of unequal K) go last
    order = torch.arange(k).expand(b, k)
    for key in keys:  # stable sorts, least significant key first = lexicographic order (top level wins)
        order = torch.gather(order, 1, torch.gather(key, 1, order).sort(dim=1, stable=True).indices)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(k).expand(b, k))
    order_ids = torch.gather(rank, 1, ids)
    if single:
        order_ids, levels = order_ids[0], [level[0] for level in levels]
    return (order_ids, levels) if return_partitions else order_ids
