"""Bits per tensor from measured costs: the cheapest total expected error for a budget.

Each tensor ``t`` has a cost ``c_t`` (its expected contribution to the model's error
per unit of codec distortion, measured by ``sensitivity.py``) and a stored size
``w_t`` (padded weights). At ``K`` bits its expected error is ``c_t · D(K)``, with
``D(K)`` the trellis codec's mean squared error on unit Gaussian data (``CODEC_MSE``,
measured: about ``1.1 · 4^-K``). The allocation minimises ``Σ c_t D(K_t)`` subject to
``Σ w_t K_t <= bpw · Σ w_t`` (the tensors a recipe fixes count at their fixed bits).

``D`` is convex and decreasing, so a greedy knapsack is (up to the last, partly
fitting step) optimal: start every free tensor at the lowest bits allowed, then
repeatedly give one more bit to the tensor whose error falls most per stored bit,
while the budget lasts. Ties break by name, so the result is deterministic. Bits stay
within ``floor(bpw) - spread_down .. ceil(bpw) + spread_up`` (inside 1..8): the
estimate is second-order in the error, least reliable where errors are large.

Public API:
- ``CODEC_MSE: dict[int, float]``.
- ``TensorCost(name, weights, cost)``.
- ``allocate_measured(items, bpw, fixed=None, spread_down=1, spread_up=2) -> dict[name, bits]``.
- ``expected_error(items, bits) -> float``.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from exl3cli.errors import ConversionError

# MUL1 codebook, L = 16 trellis, tail-biting 256-step tiles, best global scale (MSE per
# unit-variance Gaussian sample). K = 2..4 from BENCHMARKS.md's codec table; K = 1 and
# 5..8 measured the same way here (48 tiles, exl3cli/codec/NOTES.md).
CODEC_MSE = {1: 0.2656, 2: 0.0677, 3: 0.0173, 4: 0.00437, 5: 0.00111, 6: 0.000283,
             7: 0.0000759, 8: 0.0000202}
MIN_BITS, MAX_BITS = 1, 8


@dataclass(frozen=True)
class TensorCost:
    name: str
    weights: int  # stored (padded) weights
    cost: float  # expected error per unit of codec MSE


def expected_error(items: list[TensorCost], bits: dict[str, int]) -> float:
    return sum(t.cost * CODEC_MSE[bits[t.name]] for t in items if bits[t.name] in CODEC_MSE)


def allocate_measured(items: list[TensorCost], bpw: float, fixed: dict[str, int] | None = None,
                      spread_down: int = 1, spread_up: int = 2) -> dict[str, int]:
    """Bits per tensor (``fixed`` ones as given; 16 = unquantized, outside the budget)."""
    if not MIN_BITS <= bpw <= MAX_BITS:
        raise ConversionError(f"bits per weight must be within {MIN_BITS}..{MAX_BITS}, got {bpw}")
    fixed = dict(fixed or {})
    quantized = [t for t in items if fixed.get(t.name, 0) <= MAX_BITS]
    free = [t for t in quantized if t.name not in fixed]
    budget = bpw * sum(t.weights for t in quantized) + 1e-6
    budget -= sum(t.weights * fixed[t.name] for t in quantized if t.name in fixed)
    bits = {t.name: b for t in items if (b := fixed.get(t.name)) is not None}
    if not free:
        return bits
    low = max(MIN_BITS, math.floor(bpw + 1e-9) - spread_down)
    high = min(MAX_BITS, math.ceil(bpw - 1e-9) + spread_up)
    free_weights = sum(t.weights for t in free)
    while low > MIN_BITS and low * free_weights > budget:
        low -= 1
    if low * free_weights > budget:
        raise ConversionError(
            f"the recipe's fixed tensors leave {budget / free_weights:.2f} bits per weight "
            f"for the others, under the minimum of {MIN_BITS}: raise -b or lower the recipe")
    for t in free:
        bits[t.name] = low
    budget -= low * free_weights
    heap = [(-_gain(t, low), t.name, t) for t in free if low < high]
    heapq.heapify(heap)
    while heap:
        _, _, t = heapq.heappop(heap)
        if t.weights > budget:
            continue  # its later steps cost as much and gain less: done with it
        bits[t.name] += 1
        budget -= t.weights
        if bits[t.name] < high:
            heapq.heappush(heap, (-_gain(t, bits[t.name]), t.name, t))
    return bits


def _gain(t: TensorCost, k: int) -> float:
    """Error removed per stored bit by raising ``t`` from ``k`` to ``k + 1`` bits."""
    return t.cost * (CODEC_MSE[k] - CODEC_MSE[k + 1]) / t.weights
