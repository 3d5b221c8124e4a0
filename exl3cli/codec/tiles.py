"""Where trellis steps land: step order inside a 16x16 tile, tile grid <-> matrix.

Step ``p = 8*t + j`` of a tile goes to row ``r``, column ``c`` (EXL3-FORMAT.md 3.4;
the register layout of a 16x8x16 tensor-core fragment). Tile ``[kb, nb]`` covers rows
``16*kb ..`` (input dimension) and columns ``16*nb ..`` (output dimension).

Public API:
- ``step_to_position() -> Tensor[int64, (256,)]``: flat ``16*r + c`` of each step.
- ``steps_to_tile(values[..., 256]) -> [..., 16, 16]`` and ``tile_to_steps`` (inverse).
- ``tiles_to_matrix(tiles[kb, nb, 16, 16]) -> [16*kb, 16*nb]`` and
  ``matrix_to_tiles`` (inverse).
"""

from __future__ import annotations

from functools import cache

import torch

from exl3cli.codec.device_tables import on_device


@cache
def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    position = torch.empty(256, dtype=torch.int64)
    for t in range(32):
        r0, c0 = (t % 4) * 2, t // 4
        for j in range(8):
            row = r0 + (0, 1, 8, 9)[j % 4]
            col = c0 + (8 if j >= 4 else 0)
            position[8 * t + j] = 16 * row + col
    step_at = torch.empty_like(position)
    step_at[position] = torch.arange(256)
    return position, step_at


def step_to_position() -> torch.Tensor:
    """Flat tile position ``16*row + col`` of each of the 256 steps."""
    return _tables()[0]


def position_to_step() -> torch.Tensor:
    """Step index that lands at each flat tile position (inverse permutation)."""
    return _tables()[1]


def steps_to_tile(values: torch.Tensor) -> torch.Tensor:
    """Values in step order (..., 256) -> tiles (..., 16, 16)."""
    flat = values[..., on_device(position_to_step(), values.device)]
    return flat.reshape(*values.shape[:-1], 16, 16)


def tile_to_steps(tiles: torch.Tensor) -> torch.Tensor:
    """Tiles (..., 16, 16) -> values in step order (..., 256)."""
    flat = tiles.reshape(*tiles.shape[:-2], 256)
    return flat[..., on_device(step_to_position(), tiles.device)]


def tiles_to_matrix(tiles: torch.Tensor) -> torch.Tensor:
    """Tile grid (kb, nb, 16, 16) -> matrix (16*kb, 16*nb)."""
    kb, nb = tiles.shape[:2]
    return tiles.permute(0, 2, 1, 3).reshape(16 * kb, 16 * nb)


def matrix_to_tiles(matrix: torch.Tensor) -> torch.Tensor:
    """Matrix (16*kb, 16*nb) -> tile grid (kb, nb, 16, 16)."""
    rows, cols = matrix.shape
    if rows % 16 or cols % 16:
        raise ValueError(f"matrix shape {tuple(matrix.shape)} is not a multiple of 16")
    return matrix.reshape(rows // 16, 16, cols // 16, 16).permute(0, 2, 1, 3)
