"""Bits per group: meet a target average bpw by promoting whole groups by one bit.

Every layer has four groups (qkv, o, gate+up, down). All get ``floor(bpw)`` bits;
then groups are promoted by one bit in a fixed order while the budget lasts:
attention groups first (qkv, then o), then the MLP groups (down, then gate+up), each
kind visited from the layers nearest the ends of the stack inwards (0, n-1, 1, n-2,
...). A group that no longer fits is skipped and smaller ones later in the order may
still be promoted, so the average lands just under the target.

The average counts stored trellis weights (padded to multiples of 128), the cost
that determines file size; the head is separate (``head_bits``).

Public API:
- ``GROUPS = ("qkv", "o", "gate_up", "down")``
- ``GroupShape(layer, group, weights)``
- ``promotion_order(num_layers) -> list[(layer, group)]``
- ``allocate_bits(shapes: list[GroupShape], bpw) -> dict[(layer, group), int]``
- ``average_bits(shapes, bits) -> float``
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from exl3cli.errors import ConversionError

GROUPS = ("qkv", "o", "gate_up", "down")
MIN_BITS, MAX_BITS = 1, 8
# Promotion order of the group kinds: attention first, as the format's encoder does.
_KIND_ORDER = ("qkv", "o", "down", "gate_up")


@dataclass(frozen=True)
class GroupShape:
    layer: int
    group: str
    weights: int  # stored (padded) weights of every tensor in the group


def ends_first(num_layers: int) -> list[int]:
    """Layer indices from the ends of the stack inwards: 0, n-1, 1, n-2, ..."""
    order, low, high = [], 0, num_layers - 1
    while low <= high:
        order.append(low)
        if high != low:
            order.append(high)
        low, high = low + 1, high - 1
    return order


def promotion_order(num_layers: int) -> list[tuple[int, str]]:
    return [(layer, kind) for kind in _KIND_ORDER for layer in ends_first(num_layers)]


def average_bits(shapes: list[GroupShape], bits: dict[tuple[int, str], int]) -> float:
    total = sum(s.weights for s in shapes)
    return sum(s.weights * bits[(s.layer, s.group)] for s in shapes) / total


def allocate_bits(shapes: list[GroupShape], bpw: float) -> dict[tuple[int, str], int]:
    """Integer bits per (layer, group) whose weighted average is at most ``bpw``."""
    if not MIN_BITS <= bpw <= MAX_BITS:
        raise ConversionError(f"bits per weight must be within {MIN_BITS}..{MAX_BITS}, got {bpw}")
    base = max(MIN_BITS, math.floor(bpw + 1e-9))
    bits = {(s.layer, s.group): base for s in shapes}
    if base >= MAX_BITS:
        return bits
    weights = {(s.layer, s.group): s.weights for s in shapes}
    total = sum(weights.values())
    budget = bpw * total - base * total  # extra weight-bits we may still spend
    num_layers = 1 + max(s.layer for s in shapes)
    for key in promotion_order(num_layers):
        if key in weights and weights[key] <= budget + 1e-6:
            bits[key] += 1
            budget -= weights[key]
    return bits
