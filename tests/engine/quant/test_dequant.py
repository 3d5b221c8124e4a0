"""Tile decoding and full-weight reconstruction.

Checked three ways: ExLlamaV3's own kernel output (shipped vectors), the loop-based
spec twin in ``spec_reference``, and the section-4 formula with explicit matrices.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from exl3cli.codec.codebooks import MARKER_VALUES
from exl3cli.codec.dequant import (
    codebook_from_tensors,
    decode_tiles,
    dequantize_linear,
    unpack_sign_bits,
)
from exl3cli.codec.hadamard import hadamard_matrix
from exl3cli.errors import ModelLoadError

from .spec_reference import decode_tile

VECTORS = Path(__file__).parents[2] / "data" / "exl3-vectors" / "decode-vectors.safetensors"
CASES = [(cb, k) for cb in ("3inst", "mcg") for k in "12345678"] + [
    ("mul1", k) for k in ("1", "1.5", "2", "2.5", "3", "3.5", "4", "5", "6", "7", "8")
]


@pytest.fixture(scope="module")
def vectors() -> dict[str, torch.Tensor]:
    return load_file(VECTORS)


def test_vector_file_has_every_case(vectors: dict[str, torch.Tensor]) -> None:
    assert len(vectors) == 2 * len(CASES) == 54


@pytest.mark.parametrize(("codebook", "k"), CASES)
def test_decode_matches_exllamav3_kernel(vectors, codebook: str, k: str) -> None:
    trellis = vectors[f"{codebook}.K{k}.trellis"]
    expected = vectors[f"{codebook}.K{k}.decoded"]
    decoded = decode_tiles(trellis, float(k), codebook)
    assert decoded.dtype == torch.float16 and decoded.shape == (256, 256)
    assert torch.equal(decoded.view(torch.int16), expected.view(torch.int16))
    # K inferred from the word count gives the same answer.
    assert torch.equal(decode_tiles(trellis, None, codebook), decoded)


@pytest.mark.parametrize(
    ("codebook", "k_bits"), [("3inst", 2), ("mcg", 5), ("mul1", 3.5), ("mul1", 1), ("mul1", 8)]
)
def test_decode_matches_loop_reference(codebook: str, k_bits: float) -> None:
    g = torch.Generator().manual_seed(int(k_bits * 7))
    trellis = torch.randint(-32768, 32768, (2, 3, int(16 * k_bits)), generator=g).to(torch.int16)
    decoded = decode_tiles(trellis, k_bits, codebook).numpy()
    for kb in range(2):
        for nb in range(3):
            expected = decode_tile(trellis[kb, nb].tolist(), k_bits, codebook)
            got = decoded[16 * kb : 16 * kb + 16, 16 * nb : 16 * nb + 16]
            assert np.array_equal(got.view(np.uint16), expected.view(np.uint16))


def test_decode_chunks_join_seamlessly() -> None:
    # 530 x 16 tiles is more than one decode chunk; every tile row must equal its
    # own stand-alone decode.
    g = torch.Generator().manual_seed(3)
    trellis = torch.randint(-32768, 32768, (530, 16, 32), generator=g).to(torch.int16)
    full = decode_tiles(trellis, 2, "mul1")
    assert full.shape == (8480, 256)
    for kb in (0, 511, 512, 529):
        alone = decode_tiles(trellis[kb : kb + 1], 2, "mul1")
        assert torch.equal(full[16 * kb : 16 * kb + 16], alone)


def _linear_tensors(in_pad: int, out_pad: int, k_bits: int, codebook: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "trellis": torch.randint(
            -32768, 32768, (in_pad // 16, out_pad // 16, 16 * k_bits), generator=g
        ).to(torch.int16),
        "suh": (torch.randn(in_pad, generator=g) * 0.1).to(torch.float16),
        "svh": (torch.randn(out_pad, generator=g) * 0.1).to(torch.float16),
    }
    if codebook != "3inst":
        tensors[codebook] = torch.tensor(MARKER_VALUES[codebook], dtype=torch.int32)
    return tensors


def _formula(tensors, codebook: str, in_features: int, out_features: int) -> torch.Tensor:
    """W = diag(suh) Hblk W^ Hblk diag(svh), with explicit float64 matrices."""
    rotated = decode_tiles(tensors["trellis"], None, codebook).to(torch.float64)
    h = hadamard_matrix(128, torch.float64)
    left = torch.block_diag(*[h] * (rotated.shape[0] // 128))
    right = torch.block_diag(*[h] * (rotated.shape[1] // 128))
    suh = tensors["suh"].to(torch.float64)
    svh = tensors["svh"].to(torch.float64)
    full = torch.diag(suh) @ left @ rotated @ right @ torch.diag(svh)
    return full[:in_features, :out_features]


@pytest.mark.parametrize("codebook", ["mul1", "mcg", "3inst"])
def test_dequantize_linear_follows_formula_and_trims(codebook: str) -> None:
    tensors = _linear_tensors(256, 384, 3, codebook, seed=11)
    weight = dequantize_linear(tensors, 200, 300)
    assert weight.dtype == torch.float32 and weight.shape == (200, 300)
    expected = _formula(tensors, codebook, 200, 300)
    assert torch.allclose(weight.double(), expected, rtol=1e-5, atol=1e-6)


def test_dequantize_linear_from_real_safetensors_file(tmp_path: Path) -> None:
    prefix = "model.layers.0.mlp.down_proj"
    tensors = _linear_tensors(128, 256, 4, "mul1", seed=5)
    path = tmp_path / "model.safetensors"
    save_file({f"{prefix}.{name}": t for name, t in tensors.items()}, str(path))
    loaded = load_file(str(path))
    assert codebook_from_tensors(loaded) == "mul1"
    weight = dequantize_linear(loaded, 128, 250)
    assert torch.allclose(
        weight.double(), _formula(tensors, "mul1", 128, 250), rtol=1e-5, atol=1e-6
    )
    # Used as y = x @ W: a float32 reference with the rotations applied to x.
    x = torch.randn(4, 128)
    y = x @ weight
    xh = (x * tensors["suh"].float()) @ hadamard_matrix(128)
    yh = xh @ decode_tiles(tensors["trellis"], 4, "mul1").float()
    yh = (yh.reshape(4, 2, 128) @ hadamard_matrix(128)).reshape(4, 256) * tensors["svh"].float()
    assert torch.allclose(y, yh[:, :250], rtol=1e-4, atol=1e-5)


def _pack_signs(signs: torch.Tensor) -> torch.Tensor:
    bits = (signs < 0).to(torch.int64).reshape(-1, 16)
    words = (bits << torch.arange(16)).sum(1)
    return (words - ((words >> 15) << 16)).to(torch.int16)


def test_legacy_sign_bits() -> None:
    signs = torch.tensor([1.0, -1.0, -1.0] + [1.0] * 12 + [-1.0] + [-1.0] * 16)
    packed = _pack_signs(signs)
    assert packed[0].item() == -32762  # bits 1, 2 and 15 set: 0x8006
    assert torch.equal(unpack_sign_bits(packed, 32), signs)

    tensors = _linear_tensors(128, 128, 2, "mcg", seed=9)
    su = torch.where(torch.rand(128) < 0.5, -1.0, 1.0)
    sv = torch.where(torch.rand(128) < 0.5, -1.0, 1.0)
    legacy = {
        "trellis": tensors["trellis"],
        "mcg": tensors["mcg"],
        "su": _pack_signs(su),
        "sv": _pack_signs(sv),
    }
    modern = dict(legacy, suh=su.half(), svh=sv.half())
    del modern["su"], modern["sv"]
    assert torch.equal(dequantize_linear(legacy, 128, 128), dequantize_linear(modern, 128, 128))


def test_codebook_detection() -> None:
    assert codebook_from_tensors({"x.trellis": torch.zeros(1)}) == "3inst"
    assert codebook_from_tensors({"x.mcg": torch.tensor(-877912083, dtype=torch.int32)}) == "mcg"
    assert codebook_from_tensors({".mul1": torch.tensor(-2082680531, dtype=torch.int32)}) == "mul1"
    with pytest.raises(ModelLoadError, match="marker"):
        codebook_from_tensors({"mul1": torch.tensor(12345, dtype=torch.int32)})


def test_malformed_linears_raise_model_load_error() -> None:
    tensors = _linear_tensors(128, 128, 2, "mul1", seed=1)
    with pytest.raises(ModelLoadError, match="exceeds"):
        dequantize_linear(tensors, 129, 128)
    with pytest.raises(ModelLoadError, match="no .trellis"):
        dequantize_linear({"suh": tensors["suh"]}, 128, 128)
    with pytest.raises(ModelLoadError, match="svh"):
        dequantize_linear({"trellis": tensors["trellis"], "suh": tensors["suh"]}, 128, 128)
    bad_k = dict(tensors, trellis=torch.zeros(8, 8, 72, dtype=torch.int16))
    with pytest.raises(ModelLoadError, match="72 words"):
        dequantize_linear(bad_k, 128, 128)
    half_k = dict(tensors, trellis=torch.zeros(8, 8, 40, dtype=torch.int16))
    del half_k["mul1"]
    with pytest.raises(ModelLoadError, match="mul1"):
        dequantize_linear(half_k, 128, 128)
