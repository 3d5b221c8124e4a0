"""Step order inside a tile and the tile grid, against the spec's loops."""

from __future__ import annotations

import torch

from exl3cli.codec.tiles import (
    matrix_to_tiles,
    position_to_step,
    step_to_position,
    steps_to_tile,
    tile_to_steps,
    tiles_to_matrix,
)

from .spec_reference import step_row_col


def test_step_positions_follow_fragment_layout() -> None:
    positions = step_to_position()
    for p in range(256):
        r, c = step_row_col(p)
        assert positions[p].item() == 16 * r + c
    assert sorted(positions.tolist()) == list(range(256))
    assert torch.equal(positions[position_to_step()], torch.arange(256))


def test_steps_to_tile_places_each_step() -> None:
    values = torch.arange(256, dtype=torch.float32).repeat(3, 1)
    tile = steps_to_tile(values)
    assert tile.shape == (3, 16, 16)
    for p in (0, 5, 7, 8, 100, 255):
        r, c = step_row_col(p)
        assert tile[1, r, c].item() == p
    assert torch.equal(tile_to_steps(tile), values)


def test_tile_grid_round_trip() -> None:
    matrix = torch.randn(48, 32)
    tiles = matrix_to_tiles(matrix)
    assert tiles.shape == (3, 2, 16, 16)
    assert torch.equal(tiles[2, 1], matrix[32:48, 16:32])
    assert torch.equal(tiles_to_matrix(tiles), matrix)
