import math

import pytest
import torch

from exl3cli.engine.kvcache.kv_quant import (
    GROUP_SIZE,
    KVCacheType,
    dequantize_rows,
    hadamard_matrix,
    pack_codes,
    packed_width,
    parse_kv_cache_type,
    quantize_rows,
    resolve_kv_cache_type,
    unpack_codes,
)
from exl3cli.errors import InvalidOption


@pytest.mark.parametrize("text, bits", [
    ("q8", (8, 8)), ("q6", (6, 6)), ("q4", (4, 4)), ("q2", (2, 2)), ("k8v4", (8, 4)),
    ("K6V3", (6, 3)), ("q8_0", (8, 8)), ("q4_0", (4, 4)),
])
def test_parse_quantized_types(text, bits):
    kind = parse_kv_cache_type(text)
    assert (kind.key_bits, kind.value_bits) == bits and kind.quantized


@pytest.mark.parametrize("text", ["fp16", "f16", "", None, "FP16"])
def test_parse_unquantized_types(text):
    assert not parse_kv_cache_type(text).quantized


@pytest.mark.parametrize("text", ["q9", "q1", "k8v1", "int8", "q", "k8"])
def test_parse_rejects_bad_types(text):
    with pytest.raises(InvalidOption):
        parse_kv_cache_type(text)


def test_names_round_trip():
    for text in ("q8", "q4", "k8v4", "fp16"):
        assert parse_kv_cache_type(text).name == text


def test_environment_variable_is_the_default(monkeypatch):
    monkeypatch.setenv("EXL3_KV_CACHE_TYPE", "k6v4")
    assert resolve_kv_cache_type(None) == KVCacheType(6, 4)
    assert resolve_kv_cache_type("q8") == KVCacheType(8, 8)  # explicit wins


def test_hadamard_is_orthogonal_and_its_own_inverse():
    h = hadamard_matrix()
    assert h.shape == (GROUP_SIZE, GROUP_SIZE)
    assert torch.allclose(h @ h, torch.eye(GROUP_SIZE), atol=1e-6)
    assert torch.allclose(h.abs(), torch.full_like(h, GROUP_SIZE**-0.5))


@pytest.mark.parametrize("bits", range(2, 9))
def test_round_trip_error_is_within_half_a_step(bits):
    """Each rotated value is off by at most half a quantization step, s / 2^b; the
    rotation is orthogonal, so a group's L2 error is at most sqrt(32) * s / 2^b."""
    torch.manual_seed(bits)
    rows = torch.randn(64, 128) * torch.rand(64, 1) * 5
    rows[3, :40] *= 30  # an outlier: the Hadamard rotation spreads it over its group
    codes, scales = quantize_rows(rows, bits)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 2**bits - 1
    assert scales.dtype == torch.float16 and scales.shape == (64, 128 // GROUP_SIZE)
    restored = dequantize_rows(codes, scales, bits)
    error = (restored - rows).reshape(64, -1, GROUP_SIZE).norm(dim=-1)
    bound = math.sqrt(GROUP_SIZE) * scales.float() / 2**bits
    assert torch.all(error <= bound * 1.0001 + 1e-6)


def test_error_shrinks_with_more_bits():
    torch.manual_seed(0)
    rows = torch.randn(256, 64)
    errors = [float((dequantize_rows(*quantize_rows(rows, b), b) - rows).pow(2).mean())
              for b in range(2, 9)]
    assert all(a > 3 * b for a, b in zip(errors, errors[1:], strict=False))
    assert errors[-1] < 1e-4 and errors[2] < 0.01  # q8 and q4 on unit-variance data


def test_extremes_follow_the_spec_formula():
    """A group whose rotation is (s, 0, ..., 0): s takes the top code, which dequantizes
    to (2^b - 1 - 2^(b-1) + 0.5) * s / 2^(b-1) = s * (1 - 2^-b)."""
    scale = 3.0
    row = scale * hadamard_matrix()[0:1]  # H @ e0, since H is symmetric
    for bits in (2, 4, 8):
        codes, scales = quantize_rows(row, bits)
        assert float(scales[0, 0]) == scale
        rotated_back = dequantize_rows(codes, scales, bits) @ hadamard_matrix()
        assert rotated_back[0, 0].item() == pytest.approx(scale * (1 - 2.0**-bits), rel=1e-5)


def test_zero_rows_stay_zero():
    codes, scales = quantize_rows(torch.zeros(2, 32), 4)
    assert torch.equal(dequantize_rows(codes, scales, 4), torch.zeros(2, 32))


def test_rows_not_made_of_whole_groups_are_rejected():
    with pytest.raises(InvalidOption):
        quantize_rows(torch.zeros(1, 48), 8)


def _pack_by_bits(codes: list[int], bits: int) -> list[int]:
    """The documented layout, one bit at a time: per 8 codes, byte j = bit j of each."""
    out = []
    for start in range(0, len(codes), 8):
        for j in range(bits):
            byte = 0
            for lane in range(8):
                byte |= ((codes[start + lane] >> j) & 1) << lane
            out.append(byte)
    return out


@pytest.mark.parametrize("bits", range(2, 9))
def test_packed_codes_follow_the_bit_plane_layout_and_round_trip(bits):
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (3, 64), generator=gen).to(torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, packed_width(64, bits))
    assert packed.shape[-1] == 64 * bits // 8
    if bits < 8:
        for row in range(3):
            assert packed[row].tolist() == _pack_by_bits(codes[row].tolist(), bits)
    assert torch.equal(unpack_codes(packed, bits), codes)


def test_bytes_per_token_counts_packed_codes_and_scales():
    # 128 channels: codes 128*b/8 bytes for K and V, plus 4 float16 scales each.
    assert KVCacheType(4, 4).bytes_per_token(128, 2) == 64 + 64 + 16
    assert KVCacheType(8, 4).bytes_per_token(128, 2) == 128 + 64 + 16
    assert KVCacheType(6, 6).bytes_per_token(128, 2) == 96 + 96 + 16
    assert KVCacheType().bytes_per_token(128, 2) == 512
