"""M-RoPE positions of prompts with images (Qwen2.5-VL), as transformers' get_rope_index
lays them out.

Every token has three rotary positions (temporal, height, width). Text tokens have the
same position on all three, one more than the highest position before them. An image
whose tokens form a `rows` x `columns` grid (row-major) and start at position p puts its
token (r, c) at (p, p + r, p + c); the text after it continues from p + max(rows,
columns). So a token's positions are its cache index plus the shifts of the images
before it, (max(rows, columns) - rows * columns) each: a function of the token ids
before it alone (their image ids name the images and, through ImageTokens, their
grids), which keeps cached pages and prefix reuse valid. Decode steps after the prompt
are plain 1-D positions continuing from there.

Attention over image tokens stays causal (Qwen2.5-VL is trained so), and the paged
steps carry these positions (`paged_rope_positions`) while the cache keeps its own
order. The fixed-shape decode steps (generation/decode_step.py, CUDA graphs) feed text
tokens only: each row's positions are its cache length plus `decode_offset`, the sum of
the shifts of the images before it, which the step carries on the device.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from exl3cli.engine.models.vision.image_tokens import ImageTokens
from exl3cli.errors import InvalidOption


class MRopeImageTokens(ImageTokens):
    """ImageTokens of a model with M-RoPE: causal attention, three positions a token."""

    cache_positions = False

    def block_ids(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        return None  # image tokens attend causally

    def wrap_step(self, batch: Any, input_ids: torch.Tensor) -> Any:
        return batch

    def rope_positions(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """[3, B, T] for whole sequences from position 0; None when none holds an image."""
        if not bool((input_ids >= self.vocab_size).any()):
            return None
        rows = [self.positions([], row.tolist()) for row in input_ids]
        steps = input_ids.shape[1]
        plain = torch.arange(steps).expand(3, steps)
        return torch.stack([plain if row is None else row for row in rows], dim=1
                           ).to(input_ids.device)

    def paged_rope_positions(self, batch: Any) -> torch.Tensor | None:
        """[3, 1, N] for a paged step (PagedBatch: each row's page table holds the tokens
        before its new ones); None when no row's sequence holds an image, or for a
        fixed-shape decode step (its own positions carry the rows' `rope_offsets`)."""
        tables = getattr(batch, "tables", None)
        if tables is None and getattr(batch, "rope_offsets", None) is not None:
            return None
        if tables is None:
            raise ValueError("M-RoPE positions need the step's page tables (a PagedBatch)")
        parts: list[torch.Tensor | None] = []
        for table, start, tokens in zip(tables, batch.starts, batch.new_tokens, strict=True):
            parts.append(self.positions(table.tokens[:start], tokens))
        if all(part is None for part in parts):
            return None
        filled = [torch.arange(start, start + len(tokens)).expand(3, -1) if part is None
                  else part for part, start, tokens in zip(parts, batch.starts,
                                                          batch.new_tokens, strict=True)]
        return torch.cat(filled, dim=1)[:, None].to(batch.positions.device)

    def decode_offset(self, history: Sequence[int]) -> int:
        """Rotary position minus cache position of a text token after `history`: the
        shifts max(rows, columns) - rows * columns of the images in it (never above 0)."""
        sequence = np.fromiter(history, dtype=np.int64, count=len(history))
        return sum(max(rows, cols) - rows * cols for _, _, rows, cols in self._images(sequence))

    def positions(self, history: Sequence[int], new: Sequence[int]) -> torch.Tensor | None:
        """[3, len(new)] positions of `new` following the tokens `history`; None when
        neither holds an image (then they are the cache positions)."""
        start = len(history)
        sequence = np.fromiter(itertools.chain(history, new), dtype=np.int64,
                               count=start + len(new))
        images = self._images(sequence)
        if not images:
            return None
        index = torch.arange(start, start + len(new))
        base, down, right = index.clone(), torch.zeros_like(index), torch.zeros_like(index)
        for begin, end, _, cols in images:
            low, high = max(begin, start), min(end, start + len(new))
            if low >= high:
                continue
            cell = torch.arange(low, high) - begin  # the tokens' places in the grid
            base[low - start : high - start] = begin
            down[low - start : high - start] = cell // cols
            right[low - start : high - start] = cell % cols
        ends = torch.tensor([end for _, end, _, _ in images])
        shifts = torch.tensor([max(r, c) - r * c for _, _, r, c in images]).cumsum(0)
        before = torch.searchsorted(ends, base, right=True)  # images ending at or before
        shift = torch.where(before > 0, shifts[(before - 1).clamp(min=0)], 0)
        first = base + shift
        return torch.stack([first, first + down, first + right])

    def _images(self, sequence: np.ndarray) -> list[tuple[int, int, int, int]]:
        """(begin, end, rows, columns) of each image in a token sequence, in order
        (an image cut short at either end keeps the begin and end it has in full)."""
        at = np.flatnonzero(sequence >= self.vocab_size)
        if not len(at):
            return []
        values = sequence[at]
        # Runs of consecutive positions holding consecutive ids; a run may still hold
        # two images whose ids follow on, split below where an image ends.
        breaks = np.flatnonzero((np.diff(at) != 1) | (np.diff(values) != 1)) + 1
        images = []
        for run_at, run_values in zip(np.split(at, breaks), np.split(values, breaks),
                                      strict=True):
            offset = 0
            while offset < len(run_at):
                found = self.image_at(int(run_values[offset]))
                if found is None:
                    raise InvalidOption(f"token {int(run_values[offset])} is no image id")
                _, row, count, grid = found
                if grid is None:
                    raise ValueError("an image without a token grid has no M-RoPE positions")
                begin = int(run_at[offset]) - row
                images.append((begin, begin + count, grid[0], grid[1]))
                offset += count - row
        return images
