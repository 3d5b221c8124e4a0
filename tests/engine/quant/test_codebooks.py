"""Codebook tables against a plain-Python evaluation of EXL3-FORMAT.md 3.2."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from exl3cli.codec.codebooks import CODEBOOKS, MARKER_VALUES, codebook_lut, codebook_lut_float32

from .spec_reference import codebook_value


@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_lut_matches_spec_formula(codebook: str) -> None:
    lut = codebook_lut(codebook)
    assert lut.dtype == torch.float16 and lut.shape == (65536,)
    rng = np.random.default_rng(1)
    states = list(rng.integers(0, 65536, 3000)) + [0, 1, 0x7FFF, 0x8000, 0xFFFF]
    expected = np.array([codebook_value(codebook, int(s)) for s in states], dtype=np.float16)
    got = lut[torch.tensor(states)].numpy()
    assert np.array_equal(got.view(np.uint16), expected.view(np.uint16))


def test_codebook_statistics_match_spec() -> None:
    rms_3inst = codebook_lut_float32("3inst").pow(2).mean().sqrt().item()
    assert rms_3inst == pytest.approx(1.24371, abs=2e-4)
    mul1 = codebook_lut_float32("mul1")
    assert mul1.pow(2).mean().sqrt().item() == pytest.approx(1.0, abs=0.02)
    assert 3.3 < mul1.abs().max().item() < 3.5
    assert codebook_lut_float32("mcg").isfinite().all()


def test_marker_values_are_signed_multipliers() -> None:
    assert MARKER_VALUES == {"mul1": -2082680531, "mcg": -877912083}
    assert MARKER_VALUES["mul1"] & 0xFFFFFFFF == 0x83DCD12D


def test_unknown_codebook_rejected() -> None:
    with pytest.raises(ValueError, match="unknown EXL3 codebook"):
        codebook_lut("4inst")
