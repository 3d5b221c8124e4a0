"""Linear layers: dense, EXL3 (dequantized and on-the-fly trellis), fused, loading."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from exl3cli.codec import decode_tiles
from exl3cli.codec.format import Exl3FolderWriter
from exl3cli.convert.synthetic import random_exl3_linear
from exl3cli.engine.layers.linear import (
    DenseLinear,
    Exl3Linear,
    FusedLinear,
    fuse_linears,
    load_linear,
)
from exl3cli.engine.models.weights import WeightReader
from exl3cli.errors import ModelLoadError


def _sylvester_128() -> torch.Tensor:
    h = torch.tensor([[1.0]], dtype=torch.float64)
    for _ in range(7):
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    return h / 128**0.5


def _reference_weight(tensors, in_features, out_features, codebook="mul1") -> torch.Tensor:
    """W (out, in) built straight from the spec formula with explicit matrices."""
    rotated = decode_tiles(tensors["trellis"], codebook=codebook).double()
    pin, pout = rotated.shape
    h_in = torch.block_diag(*[_sylvester_128()] * (pin // 128))
    h_out = torch.block_diag(*[_sylvester_128()] * (pout // 128))
    w = torch.diag(tensors["suh"].double()) @ h_in @ rotated @ h_out @ torch.diag(
        tensors["svh"].double())
    return w[:in_features, :out_features].t().float()


@pytest.fixture(scope="module")
def layer():
    gen = torch.Generator().manual_seed(7)
    tensors = random_exl3_linear(200, 150, 3, "mul1", gen)
    tensors["bias"] = torch.randn(150, generator=gen).half()
    return tensors


def test_dense_linear_is_hf_orientation():
    weight, bias = torch.randn(5, 3), torch.randn(5)
    layer = DenseLinear(weight, bias)
    x = torch.randn(2, 4, 3)
    assert (layer.in_features, layer.out_features) == (3, 5)
    torch.testing.assert_close(layer(x), x @ weight.t() + bias)


@pytest.mark.parametrize("mode", ["dense", "trellis"])
def test_exl3_linear_matches_spec_formula(layer, mode):
    lin = Exl3Linear(layer, 200, 150, mode=mode)
    assert (lin.in_features, lin.out_features) == (200, 150)
    x = torch.randn(3, 7, 200)
    expected = x @ _reference_weight(layer, 200, 150).t() + layer["bias"].float()
    out = lin(x)
    assert out.shape == (3, 7, 150)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_exl3_linear_default_mode_on_cpu_dequantizes_once(layer):
    lin = Exl3Linear(layer, 200, 150, device="cpu", dtype=torch.bfloat16)
    assert lin.mode == "dense"
    assert lin.weight.dtype == torch.bfloat16 and lin.weight.shape == (150, 200)
    assert not hasattr(lin, "trellis")


def test_exl3_linear_legacy_sign_bits():
    gen = torch.Generator().manual_seed(1)
    tensors = random_exl3_linear(128, 256, 2, "3inst", gen)
    su = torch.randint(0, 2, (128,), generator=gen)
    sv = torch.randint(0, 2, (256,), generator=gen)

    def pack(bits):  # bit i of word j = sign of element 16 j + i, 1 = negative
        words = (bits.view(-1, 16) << torch.arange(16)).sum(1)
        return torch.where(words >= 2**15, words - 2**16, words).to(torch.int16)

    legacy = {"trellis": tensors["trellis"], "su": pack(su), "sv": pack(sv)}
    signs = {"trellis": tensors["trellis"], "suh": 1.0 - 2.0 * su, "svh": 1.0 - 2.0 * sv}
    x = torch.randn(4, 100)
    for mode in ("dense", "trellis"):
        out = Exl3Linear(legacy, 100, 250, mode=mode)(x)
        expected = x @ _reference_weight(signs, 100, 250, "3inst").t()
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_exl3_linear_rejects_oversized_logical_shape(layer):
    with pytest.raises(ModelLoadError, match="exceeds"):
        Exl3Linear(layer, 300, 150, mode="trellis")
    with pytest.raises(ModelLoadError):
        Exl3Linear(layer, 200, 300, mode="dense")


def test_fuse_dense_parts_into_one_matrix():
    a = DenseLinear(torch.randn(4, 6), torch.randn(4))
    b = DenseLinear(torch.randn(3, 6))
    fused = fuse_linears([a, b])
    assert isinstance(fused, DenseLinear) and fused.out_features == 7
    x = torch.randn(2, 6)
    torch.testing.assert_close(fused(x), torch.cat([a(x), b(x)], -1))
    assert torch.equal(fused.bias[4:], torch.zeros(3))


def test_fuse_trellis_parts_concatenates_outputs(layer):
    q = Exl3Linear(layer, 200, 150, mode="trellis")
    k = DenseLinear(torch.randn(20, 200))
    fused = fuse_linears([q, k])
    assert isinstance(fused, FusedLinear)
    assert (fused.in_features, fused.out_features) == (200, 170)
    x = torch.randn(5, 200)
    torch.testing.assert_close(fused(x), torch.cat([q(x), k(x)], -1))
    with pytest.raises(ModelLoadError, match="in_features"):
        FusedLinear([q, DenseLinear(torch.randn(2, 3))])


def test_load_linear_by_storage(tmp_path, layer):
    writer = Exl3FolderWriter(tmp_path, {})
    writer.add_linear_tensors("quant", layer)
    padded = torch.randn(256, 128)  # a writer may pad dense layers too
    writer.add_dense_linear("dense", padded, bias=torch.randn(256))
    writer.add_dense_linear("nobias", torch.randn(10, 20))
    writer.close({})
    reader = WeightReader(tmp_path)

    quant = load_linear(reader, "quant", 200, 150, "cpu", torch.float32, require_bias=True)
    assert isinstance(quant, Exl3Linear)
    x = torch.randn(2, 200)
    expected = x @ _reference_weight(layer, 200, 150).t() + layer["bias"].float()
    torch.testing.assert_close(quant(x), expected, rtol=1e-3, atol=1e-3)

    dense = load_linear(reader, "dense", 100, 250, "cpu", torch.float32)
    assert isinstance(dense, DenseLinear) and dense.weight.shape == (250, 100)
    torch.testing.assert_close(dense.weight, padded[:250, :100].half().float())
    assert dense.bias.shape == (250,)

    assert load_linear(reader, "nobias", 20, 10, "cpu", torch.float32).bias is None
    with pytest.raises(ModelLoadError, match="bias"):
        load_linear(reader, "nobias", 20, 10, "cpu", torch.float32, require_bias=True)
    with pytest.raises(ModelLoadError, match="expected"):
        load_linear(reader, "nobias", 30, 10, "cpu", torch.float32)


def test_trellis_mode_in_half_precision_tracks_float32(layer):
    x = torch.randn(2, 200)
    ref = Exl3Linear(layer, 200, 150, mode="trellis")(x)
    low = Exl3Linear(layer, 200, 150, dtype=torch.bfloat16, mode="trellis")(x.bfloat16())
    assert low.dtype == torch.bfloat16
    rel = ((low.float() - ref).norm() / ref.norm()).item()
    assert rel < 2e-2
    assert F.cosine_similarity(low.float().flatten(), ref.flatten(), dim=0) > 0.999


def test_trellis_path_in_float16_survives_large_activations(layer):
    # Ŵ has unit RMS, so H(x*suh) @ Ŵ is ~1/svh times larger than y: with inputs of a
    # few thousand (real models' outlier channels) it overflows float16 unless the
    # product is formed in float32 (a SmolLM2 perplexity run hit exactly this).
    small = dict(layer, svh=(layer["svh"].float() * 1e-3).half())
    lin = Exl3Linear(small, 200, 150, mode="trellis", dtype=torch.float16)
    x = torch.randn(4, 200, generator=torch.Generator().manual_seed(1)) * 3000
    y = lin(x.half())
    expected = x.double() @ _reference_weight(small, 200, 150).double().t()
    expected = expected + small["bias"].double()
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


def test_permute_and_scale_outputs_fold_into_dense_or_wrap_the_rest():
    from exl3cli.engine.layers.linear import (
        DenseLinear,
        PermutedLinear,
        ScaledLinear,
        permute_outputs,
        scale_outputs,
    )

    gen = torch.Generator().manual_seed(0)
    dense = DenseLinear(torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen))
    x = torch.randn(3, 4, generator=gen)
    order = torch.tensor([5, 0, 3, 1, 4, 2])
    folded = permute_outputs(dense, order)
    assert isinstance(folded, DenseLinear)
    assert torch.allclose(folded(x), dense(x)[:, order])
    assert torch.allclose(scale_outputs(dense, 0.5)(x), dense(x) * 0.5)

    class Opaque(DenseLinear):  # a layer without a dense weight (like EXL3 trellis)
        def dense_weight(self):
            return None

    opaque = Opaque(dense.weight, dense.bias)
    gathered = permute_outputs(opaque, order)
    scaled = scale_outputs(opaque, 2.0)
    assert isinstance(gathered, PermutedLinear) and isinstance(scaled, ScaledLinear)
    assert torch.allclose(gathered(x), dense(x)[:, order])
    assert torch.allclose(scaled(x), dense(x) * 2.0)
    with pytest.raises(ValueError, match="permutation"):
        PermutedLinear(dense, torch.tensor([0, 0, 1, 2, 3, 4]))
