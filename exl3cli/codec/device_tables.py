"""Per-device copies of the codec's constant tables (Hadamard matrix, LUTs, index maps).

Copying a small CPU tensor to a GPU with ``.to(device)`` synchronises the stream (a
pageable host buffer): called inside a loop, e.g. once per 16-row LDLQ block, it makes
the host wait for every queued kernel and the GPU wait for the host in turn. The
tables are constant (cached on the CPU side), so each is copied once per device and
dtype and kept; the values are the same, so every result is bit-identical.

Public API:
- ``on_device(table, device, dtype=None) -> Tensor``: ``table`` (a cached, never
  modified CPU tensor) on ``device`` (and in ``dtype``); the CPU table itself when
  nothing changes. Treat the result as read-only.
"""

from __future__ import annotations

import torch

_copies: dict[tuple[int, torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}


def on_device(table: torch.Tensor, device: torch.device | str,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """``table.to(device, dtype)``, copied once per (table, device, dtype)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0": one copy
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = dtype or table.dtype
    if device == table.device and dtype == table.dtype:
        return table
    key = (id(table), device, dtype)
    hit = _copies.get(key)
    if hit is None or hit[0] is not table:  # the cache holds the source: its id stays its own
        hit = (table, table.to(device, dtype))
        _copies[key] = hit
    return hit[1]
