"""Contiguous key/value cache: one preallocated [batch, kv_heads, max_seq_len, head_dim]
buffer per layer for keys and for values.

Rows advance independently: `lengths[b]` is how many positions row b holds. A forward
step writes row b's new tokens at `lengths[b] ..` and then advances each row by its
number of valid tokens (all of T unless the caller right-pads, see CausalLM.forward).
The lengths are mirrored on the host so the model never has to read them back from
the device (no `.item()` sync per step). A paged cache can replace this class behind
the same methods.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from exl3cli.errors import ContextOverflow


class KVCache:
    """Preallocated per-row key/value storage for every layer."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self._host_lengths = [0] * batch_size

    def row_lengths(self) -> list[int]:
        """Positions held by each row (host copy, always equal to `lengths`)."""
        return list(self._host_lengths)

    def uniform_length(self) -> int | None:
        """The common length when every row holds the same number of positions."""
        first = self._host_lengths[0]
        return first if all(n == first for n in self._host_lengths) else None

    def check_room(self, num_tokens: int) -> None:
        """ContextOverflow unless every row can take `num_tokens` more positions."""
        needed = max(self._host_lengths) + num_tokens
        if needed > self.max_seq_len:
            raise ContextOverflow(
                f"sequence of {needed} tokens exceeds the cache size of {self.max_seq_len}"
            )

    def write(
        self,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        span: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys/values [B, kv_heads, T, D] at `positions` [B, T]; return the first
        `span` positions of this layer's cache (views, no copy)."""
        cache_k, cache_v = self.keys[layer], self.values[layer]
        start = self.uniform_length()
        if start is not None:  # all rows aligned: a plain slice copy
            steps = keys.shape[2]
            cache_k[:, :, start : start + steps] = keys
            cache_v[:, :, start : start + steps] = values
        else:
            index = positions[:, None, :, None].expand_as(keys)
            cache_k.scatter_(2, index, keys)
            cache_v.scatter_(2, index, values)
        return cache_k[:, :, :span], cache_v[:, :, :span]

    def advance(self, counts: Sequence[int]) -> None:
        """Row b now holds `counts[b]` more positions."""
        self._host_lengths = [n + int(c) for n, c in zip(self._host_lengths, counts, strict=True)]
        self.lengths.copy_(torch.tensor(self._host_lengths, dtype=torch.long), non_blocking=True)

    def mark_advanced(self, counts: Sequence[int]) -> None:
        """Host mirror only: `lengths` on the device was already advanced by `counts`
        (a captured decode step does that itself, see `DeviceIndexedWrites`)."""
        self._host_lengths = [n + int(c) for n, c in zip(self._host_lengths, counts, strict=True)]

    def truncate(self, row: int, length: int) -> None:
        """Forget row `row`'s positions from `length` on (keeps the first `length`)."""
        if not 0 <= length <= self._host_lengths[row]:
            raise ValueError(f"cannot truncate row {row} of length "
                             f"{self._host_lengths[row]} to {length}")
        self._host_lengths[row] = length
        self.lengths[row] = length

    def reset(self, rows: Iterable[int] | None = None) -> None:
        """Empty the given rows (all rows by default) so they can start a new sequence."""
        for row in range(self.batch_size) if rows is None else rows:
            self.truncate(row, 0)


class DeviceIndexedWrites:
    """A KVCache as a fixed-shape decode step sees it (CUDA graph capture): keys and
    values are scattered at positions held on the device, never at a slice derived
    from the host lengths, so the same captured step is right at every length."""

    paged = False

    def __init__(self, cache: KVCache):
        self.cache = cache

    def write(
        self,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        span: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Like KVCache.write, always through a scatter at `positions` [B, T]."""
        cache_k, cache_v = self.cache.keys[layer], self.cache.values[layer]
        index = positions[:, None, :, None].expand_as(keys)
        cache_k.scatter_(2, index, keys)
        cache_v.scatter_(2, index, values)
        return cache_k[:, :, :span], cache_v[:, :, :span]
