"""Trellis bitstream against a bit-by-bit reading of EXL3-FORMAT.md 3.1 and 3.3."""

from __future__ import annotations

import pytest
import torch

from exl3cli.codec.bitstream import (
    k_bits_from_words,
    pack_states,
    ring_bits,
    states_are_consistent,
    unpack_states,
    words_per_tile,
)

from .spec_reference import step_bits, stream_bits, tile_states

ALL_K = [1, 2, 3, 4, 5, 6, 7, 8, 1.5, 2.5, 3.5]


def _random_trellis(k_bits: float, tiles: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-32768, 32768, (tiles, words_per_tile(k_bits)), generator=g).to(
        torch.int16
    )


@pytest.mark.parametrize("k_bits", ALL_K)
def test_unpack_matches_bit_by_bit_reading(k_bits: float) -> None:
    trellis = _random_trellis(k_bits, 3, seed=int(k_bits * 10))
    states = unpack_states(trellis, k_bits)
    assert states.shape == (3, 256)
    for tile in range(3):
        expected = tile_states(trellis[tile].tolist(), k_bits)
        assert states[tile].tolist() == expected


@pytest.mark.parametrize("k_bits", ALL_K)
def test_pack_is_exact_inverse(k_bits: float) -> None:
    trellis = _random_trellis(k_bits, 40, seed=100 + int(k_bits * 10)).reshape(5, 8, -1)
    states = unpack_states(trellis, k_bits)
    assert states.shape == (5, 8, 256)
    assert torch.equal(pack_states(states, k_bits), trellis)


@pytest.mark.parametrize("k_bits", ALL_K)
def test_consecutive_states_overlap_around_the_ring(k_bits: float) -> None:
    trellis = _random_trellis(k_bits, 4, seed=7)
    states = unpack_states(trellis, k_bits)
    assert states_are_consistent(states, k_bits).all()
    per_step = step_bits(k_bits)
    for tile in range(4):
        s = states[tile].tolist()
        bits = stream_bits(trellis[tile].tolist())
        total = 0
        for i, n in enumerate(per_step):
            new = 0
            for p in range(total, total + n):
                new = (new << 1) | bits[p]
            total += n
            # state_i = ((state_{i-1} << k) | next k bits) & 0xFFFF, step 255 before 0.
            assert s[i] == ((s[i - 1] << n) | new) & 0xFFFF
        assert total == ring_bits(k_bits) == 16 * words_per_tile(k_bits)
    broken = states.clone()
    broken[1, 17] ^= 0x8000  # a high bit that step 16's state fixes
    assert states_are_consistent(broken, k_bits).tolist() == [True, False, True, True]


def test_word_counts_and_k() -> None:
    assert [k_bits_from_words(w) for w in (16, 24, 40, 56, 128)] == [1, 1.5, 2.5, 3.5, 8]
    assert words_per_tile(2.5) == 40
    with pytest.raises(ValueError):
        k_bits_from_words(72)
    with pytest.raises(ValueError):
        unpack_states(torch.zeros(1, 32, dtype=torch.int16), 3)
