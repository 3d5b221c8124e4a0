"""EXL3 codebooks: 16-bit trellis state -> float16 weight value.

Three codebooks exist (EXL3-FORMAT.md section 3.2): ``3inst``, ``mcg`` and ``mul1``.
Each is a pure function of the 16-bit state, so we evaluate it once for all 65536
states and cache the table; decoding is then a table lookup.

Public API:
- ``CODEBOOKS``: the codebook names.
- ``codebook_lut(name) -> Tensor[float16, (65536,)]`` (cached, do not modify).
- ``codebook_lut_float32(name) -> Tensor[float32, (65536,)]`` (cached; same values).
- ``MARKER_VALUES``: signed int32 value of the ``.mul1`` / ``.mcg`` marker tensor.
"""

from __future__ import annotations

from functools import cache

import torch

CODEBOOKS = ("3inst", "mcg", "mul1")

_U32 = 0xFFFFFFFF
_MCG_MULT = 0xCBAC1FED
_MUL1_MULT = 0x83DCD12D


def _signed32(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value


# Marker tensors store the multiplier as a signed int32 scalar.
MARKER_VALUES = {"mcg": _signed32(_MCG_MULT), "mul1": _signed32(_MUL1_MULT)}


def _half_bits_to_float64(bits: torch.Tensor) -> torch.Tensor:
    """Reinterpret the low 16 bits of an int64 tensor as float16, widened to float64."""
    as_int16 = (bits & 0xFFFF).to(torch.int32)
    as_int16 = torch.where(as_int16 >= 0x8000, as_int16 - 0x10000, as_int16).to(torch.int16)
    return as_int16.view(torch.float16).to(torch.float64)


def _two_halves_sum(x: torch.Tensor) -> torch.Tensor:
    """Shared tail of 3INST and MCG: mask, xor, add the two float16 halves."""
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    lo = _half_bits_to_float64(x)
    hi = _half_bits_to_float64(x >> 16)
    # float64 holds the sum of two float16 numbers exactly, so the cast below is the
    # single round-to-nearest-even that a float16 add performs.
    return (lo + hi).to(torch.float16)


def _mul1(x: torch.Tensor) -> torch.Tensor:
    x = (x * _MUL1_MULT) & _U32
    byte_sum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
    a = torch.tensor([0x1EEE], dtype=torch.int16).view(torch.float16).to(torch.float64)
    b = torch.tensor([0xC931 - 0x10000], dtype=torch.int16).view(torch.float16)
    # Exact product and sum in float64, one rounding to float16: a fused half FMA.
    return ((1024 + byte_sum).to(torch.float64) * a + b.to(torch.float64)).to(torch.float16)


@cache
def codebook_lut(name: str) -> torch.Tensor:
    """Float16 value of every 16-bit state under codebook ``name``."""
    states = torch.arange(65536, dtype=torch.int64)
    if name == "3inst":
        values = _two_halves_sum((states * 89226354 + 64248484) & _U32)
    elif name == "mcg":
        values = _two_halves_sum((states * _MCG_MULT) & _U32)
    elif name == "mul1":
        values = _mul1(states)
    else:
        raise ValueError(f"unknown EXL3 codebook {name!r} (expected one of {CODEBOOKS})")
    return values


@cache
def codebook_lut_float32(name: str) -> torch.Tensor:
    """``codebook_lut`` widened to float32 (what the encoder measures errors against)."""
    return codebook_lut(name).to(torch.float32)
