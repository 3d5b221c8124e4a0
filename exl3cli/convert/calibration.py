"""Calibration text -> a fixed grid of token rows for Hessian capture.

The default text ships in ``exl3cli/data/calibration.txt`` (sources and licences in
``exl3cli/data/CALIBRATION-SOURCES.md``): prose, code, numbers and chat-formatted
dialogue. ``--calib FILE`` replaces it.

Public API:
- ``DEFAULT_ROWS``, ``DEFAULT_COLS``.
- ``default_calibration_text() -> str``; ``read_calibration_text(path | None) -> str``.
- ``calibration_rows(token_ids, rows, cols) -> LongTensor[rows, cols]``: rows cut at
  evenly spaced offsets of the token stream (wrapping around when it is short).
- ``calibration_tokens(tokenizer, text, rows, cols) -> LongTensor[rows, cols]``.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch

from exl3cli.errors import ConversionError

DEFAULT_ROWS = 128
DEFAULT_COLS = 2048


def default_calibration_text() -> str:
    return resources.files("exl3cli").joinpath("data/calibration.txt").read_text(encoding="utf-8")


def read_calibration_text(path: str | Path | None) -> str:
    """The text of ``path``, or the bundled default when ``path`` is None."""
    if path is None:
        return default_calibration_text()
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ConversionError(f"cannot read calibration file {path}: {exc}") from exc


def calibration_rows(token_ids: list[int], rows: int, cols: int) -> torch.Tensor:
    """``rows`` windows of ``cols`` tokens, starting at evenly spaced offsets."""
    if not token_ids:
        raise ConversionError("the calibration text produced no tokens")
    stream = torch.tensor(token_ids, dtype=torch.long)
    needed = rows * cols
    if stream.numel() < needed + cols:  # short text: repeat it rather than fail
        stream = stream.repeat(-(-(needed + cols) // stream.numel()))
    last_start = stream.numel() - cols
    starts = torch.linspace(0, last_start, rows).long() if rows > 1 else torch.zeros(1).long()
    return torch.stack([stream[s : s + cols] for s in starts.tolist()])


def calibration_tokens(tokenizer, text: str, rows: int, cols: int) -> torch.Tensor:
    """Tokenize ``text`` (no BOS inside the stream) and cut it into the row grid."""
    return calibration_rows(tokenizer.encode(text, add_bos=False), rows, cols)
