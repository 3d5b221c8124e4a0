"""EXL3 trellis bitstream: packed int16 words <-> per-step 16-bit states.

A tile is a tail-biting ring of ``R`` bits (EXL3-FORMAT.md 3.1, 3.3). Step ``i``
consumes ``bits_per_step(K)[i]`` bits; with ``S(i)`` the running total after step
``i``, the state of step ``i`` is ring bits ``[S(i) - 16, S(i))`` (mod ``R``), first
bit most significant. On disk the ring is ``R / 16`` int16 words; each pair of int16
is one little-endian uint32 whose bits are read most significant first.

Public API:
- ``k_bits_from_words(words) -> float`` / ``words_per_tile(k_bits) -> int``
- ``bits_per_step(k_bits) -> list[int]`` (256 entries)
- ``unpack_states(trellis, k_bits) -> Tensor[int64, (..., 256)]``
- ``pack_states(states, k_bits) -> Tensor[int16, (..., words)]`` (exact inverse for
  consistent state sequences: ``pack_states(unpack_states(t)) == t`` for every ``t``)
"""

from __future__ import annotations

from functools import cache

import torch

from exl3cli.codec.device_tables import on_device

STEPS = 256
INTEGER_K = (1, 2, 3, 4, 5, 6, 7, 8)
HALF_K = (1.5, 2.5, 3.5)


def _check_k(k_bits: float) -> float:
    if k_bits not in INTEGER_K and k_bits not in HALF_K:
        raise ValueError(f"unsupported EXL3 bits per weight {k_bits!r}")
    return float(k_bits)


def words_per_tile(k_bits: float) -> int:
    """Number of int16 words a 16x16 tile takes at ``k_bits`` bits per weight."""
    return int(16 * _check_k(k_bits))


def k_bits_from_words(words: int) -> float:
    """Bits per weight from the last dimension of a ``.trellis`` tensor."""
    k_bits = words / 16
    if k_bits.is_integer():
        k_bits = int(k_bits)
    _check_k(k_bits)
    return float(k_bits)


@cache
def _steps_table(k_bits: float) -> tuple[tuple[int, ...], int]:
    k_bits = _check_k(k_bits)
    if float(k_bits).is_integer():
        per_step = (int(k_bits),) * STEPS
    else:
        whole = int(k_bits)
        # 0xAAAA has bit i set for odd i: odd steps take one extra bit.
        per_step = tuple(whole + ((0xAAAA >> (i & 15)) & 1) for i in range(STEPS))
    return per_step, sum(per_step)


def bits_per_step(k_bits: float) -> list[int]:
    """How many new bits each of the 256 steps consumes."""
    return list(_steps_table(k_bits)[0])


def ring_bits(k_bits: float) -> int:
    """Length ``R`` of the tail-biting ring of one tile, in bits."""
    return _steps_table(k_bits)[1]


@cache
def _unpack_index(k_bits: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each step: index of the uint32 word holding its first bit, the next word
    (ring order) and the right shift that brings the 16-bit window down."""
    per_step, ring = _steps_table(k_bits)
    ends = torch.tensor(per_step, dtype=torch.int64).cumsum(0)
    starts = (ends - 16) % ring
    n_words = ring // 32
    first = starts >> 5
    second = (first + 1) % n_words
    shift = 32 - (starts & 31)
    return first, second, shift


def _to_uint32_words(trellis: torch.Tensor) -> torch.Tensor:
    halves = trellis.to(torch.int64) & 0xFFFF
    return halves[..., 0::2] | (halves[..., 1::2] << 16)


def unpack_states(trellis: torch.Tensor, k_bits: float) -> torch.Tensor:
    """States (int64 in 0..65535) of the 256 steps of every tile in ``trellis``.

    ``trellis`` is int16 with the tile's words in the last dimension.
    """
    if trellis.shape[-1] != words_per_tile(k_bits):
        raise ValueError(
            f"trellis has {trellis.shape[-1]} words per tile, K={k_bits} needs "
            f"{words_per_tile(k_bits)}"
        )
    first, second, shift = (on_device(t, trellis.device) for t in _unpack_index(float(k_bits)))
    words = _to_uint32_words(trellis)
    # A 48-bit window: the whole first word then the top half of the next one; any
    # 16-bit run starting inside the first word lies within it.
    window = (words[..., first] << 16) | (words[..., second] >> 16)
    return (window >> shift) & 0xFFFF


_WORD_WEIGHTS = torch.arange(31, -1, -1, dtype=torch.int64)  # bit i of a word: 1 << (31-i)


@cache
def _pack_index(k_bits: float) -> tuple[torch.Tensor, torch.Tensor]:
    """For each ring bit: the step that introduced it and its bit position in that
    step's state (the new bits of a step are the low bits of its state)."""
    per_step, ring = _steps_table(k_bits)
    step_of_bit = torch.empty(ring, dtype=torch.int64)
    shift_of_bit = torch.empty(ring, dtype=torch.int64)
    position = 0
    for step, n in enumerate(per_step):
        for j in range(n):
            step_of_bit[position + j] = step
            shift_of_bit[position + j] = n - 1 - j
        position += n
    return step_of_bit, shift_of_bit


def pack_states(states: torch.Tensor, k_bits: float) -> torch.Tensor:
    """Pack per-step states (..., 256) into int16 trellis words (..., 16*K).

    Only the new bits of each step are stored; the overlapping high bits are
    implied by the previous steps (tail-biting: step 0 overlaps step 255).
    """
    if states.shape[-1] != STEPS:
        raise ValueError(f"expected {STEPS} states per tile, got {states.shape[-1]}")
    step_of_bit, shift_of_bit = (on_device(t, states.device) for t in _pack_index(float(k_bits)))
    bits = (states.to(torch.int64)[..., step_of_bit] >> shift_of_bit) & 1
    bits = bits.reshape(*bits.shape[:-1], -1, 32)
    weights = on_device(_WORD_WEIGHTS, states.device)
    words = (bits << weights).sum(-1)
    halves = torch.stack((words & 0xFFFF, words >> 16), dim=-1).flatten(-2)
    return (halves - ((halves >> 15) << 16)).to(torch.int16)


def states_are_consistent(states: torch.Tensor, k_bits: float) -> torch.Tensor:
    """Whether each tile's states overlap as the tail-biting ring requires:
    ``state_i >> k_i == state_{i-1} & (2^(16-k_i) - 1)``, with step 255 before step 0.
    Returns a bool tensor over the leading dimensions."""
    per_step = torch.tensor(bits_per_step(k_bits), dtype=torch.int64, device=states.device)
    previous = torch.roll(states, 1, dims=-1)
    ok = (states >> per_step) == (previous & ((1 << (16 - per_step)) - 1))
    return ok.all(dim=-1)
