import pytest

from exl3cli.convert.calibration import (
    calibration_rows,
    default_calibration_text,
    read_calibration_text,
)
from exl3cli.errors import ConversionError


def test_rows_are_windows_of_the_stream_at_spread_offsets():
    ids = list(range(1000))
    grid = calibration_rows(ids, rows=4, cols=100)
    assert grid.shape == (4, 100)
    assert grid[0, 0] == 0 and grid[-1, -1] == 999
    for row in grid:
        assert (row[1:] - row[:-1] == 1).all()  # contiguous text


def test_short_text_wraps_around():
    grid = calibration_rows([5, 6, 7], rows=2, cols=8)
    assert grid.shape == (2, 8)
    assert set(grid.flatten().tolist()) == {5, 6, 7}


def test_empty_text_is_an_error(tmp_path):
    with pytest.raises(ConversionError):
        calibration_rows([], 2, 8)
    with pytest.raises(ConversionError):
        read_calibration_text(tmp_path / "missing.txt")


def test_default_text_has_variety():
    text = default_calibration_text()
    assert 50_000 < len(text.encode()) <= 1_000_000
    assert "<|im_start|>user" in text and "def " in text and " = " in text
