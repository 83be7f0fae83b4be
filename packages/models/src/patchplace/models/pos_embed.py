"""Position-embedding builders shared by every backbone and objective (written once, reused).

* ``sincos_2d``: MAE's fixed 2-D sin-cos table (He et al. 2022, ``get_2d_sincos_pos_embed``): the first half of
  the channels encodes the column (MAE meshgrids with w first), the second half the row; each half is
  ``[sin(p * omega), cos(p * omega)]`` with ``omega_i = 1 / 10000^(i / (D/4))``.
* ``sincos_1d``: Vaswani et al. (2017) interleaved sinusoids, used by the speech Transformer (MP3 §3.1).
* ``RelativePositionBias2d``: BEiT's per-layer learned relative position bias (Bao et al. 2022), zero-initialised,
  so a freshly added bias leaves attention unchanged.
"""

from __future__ import annotations

import torch
from timm.models.beit import gen_relative_position_index
from torch import nn


def _sincos_from_grid(dim: int, positions: torch.Tensor) -> torch.Tensor:
    """MAE's ``get_1d_sincos_pos_embed_from_grid``: (M,) positions -> (M, dim) as [sin | cos]."""
    omega = torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0)
    omega = 1.0 / 10000**omega
    out = positions.double().reshape(-1)[:, None] * omega[None, :]
    return torch.cat([torch.sin(out), torch.cos(out)], dim=1)


def sincos_2d(grid: tuple[int, int], dim: int) -> torch.Tensor:
    """(h * w, dim) fixed 2-D table in raster order (row-major), MAE formula; ``dim`` divisible by 4."""
    if dim % 4:
        raise ValueError(f"sincos2d needs embed_dim divisible by 4, got {dim}")
    h, w = grid
    # MAE: grid = np.meshgrid(grid_w, grid_h) -> grid[0] holds column indices, grid[1] row indices.
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    table = torch.cat([_sincos_from_grid(dim // 2, cols), _sincos_from_grid(dim // 2, rows)], dim=1)
    return table.float()


def sincos_1d(length: int, dim: int) -> torch.Tensor:
    """(length, dim) Transformer sinusoids: PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(...)."""
    if dim % 2:
        raise ValueError(f"sincos1d needs an even embed_dim, got {dim}")
    position = torch.arange(length, dtype=torch.float64)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * (-torch.log(torch.tensor(10000.0)) / dim))
    table = torch.zeros(length, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * freq)
    table[:, 1::2] = torch.cos(position * freq)
    return table.float()


class RelativePositionBias2d(nn.Module):
    """BEiT relative position bias for one layer: returns an additive (heads, T, T) attention bias.

    ``T = h * w + 1`` with a class token (the three extra table rows hold cls->token, token->cls, cls->cls),
    else ``h * w``. Zero-initialised: at init it equals attention without position information.
    """

    def __init__(self, grid: tuple[int, int], num_heads: int, class_token: bool = True) -> None:
        super().__init__()
        self.grid, self.class_token = tuple(grid), class_token
        h, w = grid
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * h - 1) * (2 * w - 1) + 3, num_heads))
        index = gen_relative_position_index((h, w))
        self.register_buffer("relative_position_index", index if class_token else index[1:, 1:].contiguous(),
                             persistent=False)

    @property
    def num_tokens(self) -> int:
        return self.relative_position_index.shape[0]

    def forward(self) -> torch.Tensor:
        t = self.num_tokens
        bias = self.relative_position_bias_table[self.relative_position_index.reshape(-1)]
        return bias.reshape(t, t, -1).permute(2, 0, 1).contiguous()
