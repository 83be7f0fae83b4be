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
independent draws per sample (segment ids may take a (B, N) tensor too).

Everything runs on ``device`` (the segment ids' device for :func:`serialize`) with shapes fixed by the arguments:
the number of segments is passed (``num_segments``: K blobs, the squares of the grid) rather than read off the ids,
so a training step never waits for the device (no ``int(t.max())``) and keeps one shape under ``torch.compile``.
Random numbers come from ``generator`` on its own device when one is given (a CPU generator gives the same draws
whatever the device: tests, evaluation), else from the default generator of ``device`` (the training step: the
global RNG stream that checkpoints save).
"""

from __future__ import annotations

import math

import torch

from .common import ObjectiveError, noise_device

# §3.2: blob means ~ U(-1.75, 1.75) and stds ~ U(0.5, 1) per axis, on token positions spread over [-2, 2].
BLOB_MEAN_RANGE = (-1.75, 1.75)
BLOB_STD_RANGE = (0.5, 1.0)
GRID_EXTENT = 2.0

Device = torch.device | str | None


def _check_grid(grid: tuple[int, ...]) -> tuple[int, int]:
    if len(grid) != 2 or min(grid) < 1:
        raise ObjectiveError(f"RandSAC segments need a 2-D token grid (h, w), got {tuple(grid)}")
    return int(grid[0]), int(grid[1])


def _rows_cols(grid: tuple[int, int], device: Device) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) row and column index of every raster-ordered token, built on ``device`` (no host copy)."""
    h, w = _check_grid(grid)
    index = torch.arange(h * w, device=device)
    return index // w, index % w


def token_positions(grid: tuple[int, int], device: Device = None, dtype: torch.dtype = torch.float32
                    ) -> torch.Tensor:
    """(N, 2) normalized (x, y) token positions in [-2, 2]: the top-left token at (-2, -2), the bottom-right one
    at (2, 2) (§3.2). A grid side of 1 sits at -2."""
    h, w = _check_grid(grid)
    rows, cols = _rows_cols((h, w), device)
    x = -GRID_EXTENT + (2 * GRID_EXTENT / max(w - 1, 1)) * cols.to(dtype)
    y = -GRID_EXTENT + (2 * GRID_EXTENT / max(h - 1, 1)) * rows.to(dtype)
    return torch.stack([x, y], dim=1)


def _batched(x: torch.Tensor, batch: int | None) -> torch.Tensor:
    return x if batch is None else x.unsqueeze(0).expand(batch, *x.shape)


def _uniform(shape: tuple[int, ...], low: float, high: float, generator: torch.Generator | None,
             device: Device, dtype: torch.dtype) -> torch.Tensor:
    """U(low, high) of ``shape`` on ``device``: drawn from ``generator`` on its device, else from ``device``'s."""
    u = torch.rand(shape, generator=generator, device=noise_device(device or "cpu", generator), dtype=dtype)
    return low + (high - low) * (u if device is None else u.to(device))


# ---------------------------------------------------------------------------------------------- segments
def num_squares(grid: tuple[int, int], size: int) -> int:
    """K = ceil(h / M) * ceil(w / M) square segments on the grid (§3.2)."""
    h, w = _check_grid(grid)
    return math.ceil(h / size) * math.ceil(w / size)


def square_segments(grid: tuple[int, int], size: int, batch: int | None = None, device: Device = None
                    ) -> torch.Tensor:
    """M x M squares in raster order of squares (§3.2: K = hw / M^2). When ``size`` does not divide a side, the
    last row / column of squares is cut short (rectangles of the remaining tokens), so every token still belongs to
    exactly one segment. (N,) or (batch, N) long ids (a broadcast view over the batch: the same for every sample)."""
    h, w = _check_grid(grid)
    if size < 1:
        raise ObjectiveError(f"square segment size must be >= 1, got {size}")
    rows, cols = _rows_cols((h, w), device)
    return _batched((rows // size) * math.ceil(w / size) + cols // size, batch)


def _sample_gaussians(batch: int, k: int, generator: torch.Generator | None, device: Device,
                      dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, k, 2) means ~ U(-1.75, 1.75) and stds ~ U(0.5, 1) per axis (§3.2)."""
    mean = _uniform((batch, k, 2), *BLOB_MEAN_RANGE, generator, device, dtype)
    std = _uniform((batch, k, 2), *BLOB_STD_RANGE, generator, device, dtype)
    return mean, std


def _argmax_density(points: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Eq. 1: index of the axis-aligned Gaussian of highest density at each point. points (B, P, 2) or (P, 2), mean
    / std (B, K, 2) -> (B, P). Log-densities, the shared 2 pi constant dropped."""
    inv_std = std.reciprocal()
    log_density = inv_std.log().sum(-1).unsqueeze(1)  # (B, 1, K)
    for axis in range(2):  # per axis on (B, P, K): no (B, P, K, 2) intermediates
        z = (points[..., axis, None] - mean[:, None, :, axis]) * inv_std[:, None, :, axis]
        log_density = torch.addcmul(log_density, z, z, value=-0.5)
    return log_density.argmax(-1)


def compact_ids(ids: torch.Tensor, num_ids: int | None = None) -> torch.Tensor:
    """Relabel ids per sample to 0..K'-1 without gaps, keeping their relative order. (N,) or (B, N).

    ``num_ids``: an upper bound on the ids (K blobs), so the relabelling has a fixed shape and reads no device
    value; ``None`` reads it off ``ids`` (one host synchronisation)."""
    flat = ids.reshape(-1, ids.shape[-1])
    k = int(flat.max()) + 1 if num_ids is None else num_ids
    present = torch.zeros(flat.shape[0], k, dtype=torch.long, device=ids.device).scatter_(1, flat, 1)
    return torch.gather(present.cumsum(1) - 1, 1, flat).reshape(ids.shape)


def blob_segments(grid: tuple[int, int], num_blobs: int, generator: torch.Generator | None = None,
                  batch: int | None = None, device: Device = None, positions: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """K random Gaussian blobs (§3.2, Eq. 1): means ~ U(-1.75, 1.75)^2, stds ~ U(0.5, 1)^2 on the [-2, 2] grid;
    each token goes to the blob of highest density. A blob may win no token: ids are relabelled to 0..K'-1
    without gaps (K' <= K). (N,) or (batch, N) long ids on ``device`` (``positions``' device when given: the
    :func:`token_positions` of the grid, e.g. a model's buffer)."""
    if num_blobs < 1:
        raise ObjectiveError(f"num_blobs must be >= 1, got {num_blobs}")
    pos = token_positions(grid, device) if positions is None else positions
    mean, std = _sample_gaussians(batch or 1, num_blobs, generator, pos.device, pos.dtype)
    ids = compact_ids(_argmax_density(pos, mean, std), num_blobs)
    return ids if batch is not None else ids[0]


# ---------------------------------------------------------------------------------------------- orders
def raster_order(grid: tuple[int, int], batch: int | None = None, device: Device = None) -> torch.Tensor:
    """Ablation *patch-raster* (Table 1-2): one token per segment, in raster order."""
    h, w = _check_grid(grid)
    return _batched(torch.arange(h * w, device=device), batch)


def patch_random_order(grid: tuple[int, int], generator: torch.Generator | None = None,
                       batch: int | None = None, device: Device = None) -> torch.Tensor:
    """Ablation *patch-random* (Tables 2-3): one token per segment, in random order."""
    h, w = _check_grid(grid)
    return serialize(raster_order((h, w), batch, device), (h, w), (), generator, num_segments=h * w)


def _centroids(ids: torch.Tensor, pos: torch.Tensor, k: int) -> torch.Tensor:
    """(B, k, 2) mean position of the tokens with each id (0 for ids no token has)."""
    b = ids.shape[0]
    index = ids.unsqueeze(-1).expand(-1, -1, 2)
    sums = pos.new_zeros(b, k, 2).scatter_add_(1, index, pos.expand(b, -1, -1))
    counts = pos.new_zeros(b, k).scatter_add_(1, ids, pos.new_ones(()).expand(ids.shape))
    return sums / counts.clamp_min(1).unsqueeze(-1)


def _num_ids(ids: torch.Tensor, num_segments: int | None) -> int:
    return int(ids.max()) + 1 if num_segments is None else num_segments


def partition_segments(segment_ids: torch.Tensor, grid: tuple[int, int], hierarchy: tuple[int, ...],
                       generator: torch.Generator | None = None, *, num_segments: int | None = None,
                       positions: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Group segments into partitions, level by level (§3.3: "we then group these 7 segments into 3 larger
    partitions following the same logic for segment generation"): for a level with P partitions, sample P Gaussians
    as for blobs and put each group of the level below (a segment, or a partition of the previous level) into the
    partition of highest density at the group's centroid (the mean position of its tokens). Groups are never
    split, so the partitions nest. Returns one (B, N) tensor per level: each token's partition id (not compacted:
    a partition may be empty).

    ``num_segments``: an upper bound on the segment ids (static shapes, no host read; ``None`` reads it off the
    ids); the groups of each later level are the previous level's partitions."""
    if any(parts < 1 for parts in hierarchy):
        raise ObjectiveError(f"every hierarchy level needs >= 1 partition, got {tuple(hierarchy)}")
    pos = token_positions(grid, segment_ids.device) if positions is None else positions
    below, k = segment_ids, _num_ids(segment_ids, num_segments) if hierarchy else 0
    levels = []
    for parts in hierarchy:
        mean, std = _sample_gaussians(below.shape[0], parts, generator, pos.device, pos.dtype)
        group_of = _argmax_density(_centroids(below, pos, k), mean, std)  # (B, k): group below -> partition
        below = torch.gather(group_of, 1, below)
        levels.append(below)
        k = parts
    return levels


def _random_keys(batch: int, k: int, generator: torch.Generator | None, device: Device) -> torch.Tensor:
    """(B, k) sort keys ~ U(0, 1) on ``device``."""
    return torch.rand(batch, k, generator=generator, device=noise_device(device, generator)).to(device)


def serialize(segment_ids: torch.Tensor, grid: tuple[int, int], hierarchy: tuple[int, ...] = (),
              generator: torch.Generator | None = None, *, num_segments: int | None = None,
              positions: torch.Tensor | None = None, return_partitions: bool = False):
    """Random serialization of segments -> ``order_ids``: each token's rank of its segment (0 = first).

    ``hierarchy = ()``: flat, a uniformly random order of the segments (§3.1 stochastic serialization).
    ``hierarchy = (P1, P2, ...)`` with P1 > P2 > ...: segments are grouped into P1 partitions, those into P2, ...
    (:func:`partition_segments`; e.g. blobs "11 -> 7 -> 3" is ``num_blobs=11, hierarchy=(7, 3)``). The order is
    random at every level: a random order of the top partitions, inside each a random order of its sub-partitions,
    ..., inside the lowest partition a random order of its segments — so a partition's segments are contiguous.

    ``segment_ids``: (N,) or (B, N) ids 0..K-1 without gaps (as the generators return); ``num_segments``: K, or
    any bound above the ids (ids no token has sort last and take no rank); ``None`` reads it off the ids (a host
    synchronisation). Returns (N,) or (B, N) long ranks in 0..K'-1 on the ids' device, and with
    ``return_partitions`` also the per-level partition ids of every token."""
    single = segment_ids.dim() == 1
    ids = segment_ids.reshape(1, -1) if single else segment_ids
    h, w = _check_grid(grid)
    if ids.shape[1] != h * w:
        raise ObjectiveError(f"segment_ids cover {ids.shape[1]} tokens but the grid {(h, w)} has {h * w}")
    device = ids.device
    b, k = ids.shape[0], _num_ids(ids, num_segments)
    levels = partition_segments(ids, (h, w), tuple(hierarchy), generator, num_segments=k, positions=positions)
    # Sort keys per segment, lowest level first: a random key per segment, then per partition of each level.
    keys = [_random_keys(b, k, generator, device)]
    for level, parts in zip(levels, hierarchy, strict=True):
        group_of = torch.zeros(b, k, dtype=torch.long, device=device).scatter_(1, ids, level)  # one partition each
        keys.append(torch.gather(_random_keys(b, parts, generator, device), 1, group_of))
    # ids no token has (blobs that won no token) go last: +1 on the most significant key, which lies in [0, 1)
    unused = torch.ones(b, k, dtype=torch.bool, device=device).scatter_(1, ids, False)
    keys[-1] = keys[-1] + unused
    order = torch.arange(k, device=device).expand(b, k)
    for key in keys:  # stable sorts, least significant key first = lexicographic order (top level wins)
        order = torch.gather(order, 1, torch.gather(key, 1, order).sort(dim=1, stable=True).indices)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(k, device=device).expand(b, k))
    order_ids = torch.gather(rank, 1, ids)
    if single:
        order_ids, levels = order_ids[0], [level[0] for level in levels]
    return (order_ids, levels) if return_partitions else order_ids
