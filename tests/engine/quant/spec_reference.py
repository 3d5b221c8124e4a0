"""Plain-Python EXL3 tile decoding written from EXL3-FORMAT.md 3.1-3.4 alone.

Deliberately slow and loop-based (Python ints, numpy halves): the independent twin
that the vectorised codec in ``exl3cli.codec`` is checked against.
"""

from __future__ import annotations

import numpy as np


def half_from_bits(bits: int) -> float:
    return float(np.array([bits & 0xFFFF], dtype=np.uint16).view(np.float16)[0])


def codebook_value(codebook: str, state: int) -> np.float16:
    """Section 3.2 for one state."""
    if codebook == "mul1":
        x = (state * 0x83DCD12D) & 0xFFFFFFFF
        s = sum((x >> shift) & 0xFF for shift in (0, 8, 16, 24))
        # Python floats are doubles: product and sum are exact, one rounding to half.
        return np.float16((1024 + s) * half_from_bits(0x1EEE) + half_from_bits(0xC931))
    if codebook == "3inst":
        x = (state * 89226354 + 64248484) & 0xFFFFFFFF
    elif codebook == "mcg":
        x = (state * 0xCBAC1FED) & 0xFFFFFFFF
    else:
        raise ValueError(codebook)
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    return np.float16(half_from_bits(x) + half_from_bits(x >> 16))


def step_bits(k_bits: float) -> list[int]:
    """Sections 3.1 and 3.3: bits consumed by each of the 256 steps."""
    if float(k_bits).is_integer():
        return [int(k_bits)] * 256
    return [int(k_bits) + ((0xAAAA >> (i & 15)) & 1) for i in range(256)]


def stream_bits(words: list[int]) -> list[int]:
    """The tile's bits in stream order: int16 pairs as little-endian uint32, MSB first."""
    u32 = [
        (words[2 * m] & 0xFFFF) | ((words[2 * m + 1] & 0xFFFF) << 16)
        for m in range(len(words) // 2)
    ]
    return [(u32[p >> 5] >> (31 - (p & 31))) & 1 for p in range(32 * len(u32))]


def tile_states(words: list[int], k_bits: float) -> list[int]:
    """State of each step: ring bits [S(i) - 16, S(i)) mod R, first bit most significant."""
    bits = stream_bits(words)
    ring = len(bits)
    states, total = [], 0
    for n in step_bits(k_bits):
        total += n
        state = 0
        for p in range(total - 16, total):
            state = (state << 1) | bits[p % ring]
        states.append(state)
    return states


def step_row_col(p: int) -> tuple[int, int]:
    """Section 3.4: where step p lands inside the 16x16 tile."""
    t, j = divmod(p, 8)
    r0, c0 = (t % 4) * 2, t // 4
    return [r0, r0 + 1, r0 + 8, r0 + 9][j % 4], c0 + (8 if j >= 4 else 0)


def decode_tile(words: list[int], k_bits: float, codebook: str) -> np.ndarray:
    """One tile, (16, 16) float16, rows = input dimension."""
    tile = np.zeros((16, 16), dtype=np.float16)
    for p, state in enumerate(tile_states(words, k_bits)):
        r, c = step_row_col(p)
        tile[r, c] = codebook_value(codebook, state)
    return tile
