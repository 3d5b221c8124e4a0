"""The prompt GEMM of the EXL3 linears (cuda_kernels.dense_sums: decode + cuBLAS with
float32 sums) and its switch EXL3_PREFILL: against the PyTorch twin
(reference.dense_sums) and the float64 dequantized weight, on several shapes,
codebooks and K, with the decode workspace poisoned first."""

from __future__ import annotations

import pytest
import torch

from exl3cli.codec import decode_tiles
from exl3cli.ops import cuda_kernels as kernels
from exl3cli.ops import reference
from tests.kernels.test_kernels import random_linear, random_trellis, reference_linear, rel_error

CASES = [((512, 384), (4, "mul1")), ((1000, 700), (3, "mcg")), ((256, 1024), (2.5, "mul1")),
         ((384, 256), (6, "3inst"))]


def test_prefill_mode_default_and_bad_value(monkeypatch):
    monkeypatch.delenv("EXL3_PREFILL", raising=False)
    assert kernels.prefill_mode() == "fused"
    for mode in kernels.PREFILL_MODES:
        monkeypatch.setenv("EXL3_PREFILL", mode)
        assert kernels.prefill_mode() == mode
    monkeypatch.setenv("EXL3_PREFILL", "fast")
    with pytest.raises(ValueError, match="EXL3_PREFILL must be one of old, fp32, fused"):
        kernels.prefill_mode()


def test_dense_sums_twin_and_cpu_refusal():
    gen = torch.Generator().manual_seed(3)
    trellis = random_trellis(8, 4, 4, gen)
    xh = torch.randn(70, 128, generator=gen).half()
    want = xh.double() @ decode_tiles(trellis, 4, "mul1").double()
    got = reference.dense_sums(xh, trellis, 4, "mul1")
    assert got.dtype == torch.float32 and got.shape == (70, 64)
    assert float((got.double() - want).norm() / want.norm()) < 1e-6
    assert kernels.dense_sums(xh, trellis, 8, 2) is None  # CPU tensors: no kernel
    assert not kernels.dense_sums_available(torch.device("cpu"))


def _gpu():
    assert torch.cuda.is_available(), "cuda tests need a GPU"
    assert kernels.available(), f"extension did not load: {kernels.unavailable_reason()}"
    assert kernels.dense_sums_available(torch.device("cuda")), "torch.mm lacks out_dtype"


@pytest.mark.cuda
@pytest.mark.parametrize(("k", "codebook"), [(2, "mul1"), (4, "mul1"), (3.5, "mul1"),
                                             (3, "mcg"), (5, "3inst"), (8, "mcg")])
@pytest.mark.parametrize("rows", [65, 130, 2048])
def test_dense_sums_match_the_twin(k: float, codebook: str, rows: int) -> None:
    _gpu()
    gen = torch.Generator().manual_seed(rows + int(10 * k))
    k2 = int(2 * k)
    cb = kernels._codebook_id(codebook, k2)
    for kb, nb in ((24, 12), (16, 72), (8, 8)):
        trellis = random_trellis(kb, nb, k, gen)
        xh = torch.randn(rows, 16 * kb, generator=gen).half()
        kernels._WORKSPACE.clear()  # a fresh workspace each shape, every entry poisoned
        device = torch.device("cuda", torch.cuda.current_device())
        key = (device, torch.cuda.current_stream(device).cuda_stream)
        kernels._WORKSPACE[key] = torch.full(
            (256 * kb * nb + 4096,), float("nan"), dtype=torch.float16, device="cuda")
        got = kernels.dense_sums(xh.cuda(), trellis.cuda(), k2, cb)
        assert got is not None and got.dtype == torch.float32 and got.shape == (rows, 16 * nb)
        want = reference.dense_sums(xh, trellis, k, codebook).double()
        assert rel_error(got, want) < 1e-5, (kb, nb)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["old", "fp32"])
@pytest.mark.parametrize("rows", [65, 100, 513])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gemm_past_the_fused_rows_in_each_mode(monkeypatch, mode, rows, dtype) -> None:
    _gpu()
    monkeypatch.setenv("EXL3_PREFILL", mode)
    gen = torch.Generator().manual_seed(rows)
    for (in_f, out_f), (k, codebook) in CASES:
        tensors = random_linear(in_f, out_f, k, codebook, gen)
        x = torch.randn(rows, in_f, generator=gen)
        ref = reference_linear(x.to(dtype).float(), tensors, in_f, out_f)
        out = torch.full((rows, out_f), float("nan"), dtype=dtype, device="cuda")
        cuda = {name: t.cuda() for name, t in tensors.items()}
        kernels.exl3_gemm(x.to(dtype).cuda(), cuda["trellis"], cuda["suh"][:in_f],
                          cuda["svh"][:out_f], k, codebook, bias=cuda["bias"], out=out,
                          out_features=out_f)
        assert rel_error(out, ref) < 1e-2, (in_f, out_f, k, codebook)


@pytest.mark.cuda
def test_fp32_sums_take_activations_that_overflow_float16(monkeypatch) -> None:
    """Sums of ~1e5 (large activations, small svh): float32 sums need no svh fold."""
    _gpu()
    monkeypatch.setenv("EXL3_PREFILL", "fp32")
    gen = torch.Generator().manual_seed(11)
    tensors = random_linear(512, 256, 4, "mul1", gen, bias=False)
    tensors["svh"] = (tensors["svh"].float() * 1e-3).half()
    x = torch.randn(96, 512, generator=gen) * 3e3
    ref = reference_linear(x.to(torch.bfloat16).float(), tensors, 512, 256)
    cuda = {name: t.cuda() for name, t in tensors.items()}
    y = kernels.exl3_gemm(x.to(torch.bfloat16).cuda(), cuda["trellis"], cuda["suh"],
                          cuda["svh"], 4, "mul1")
    assert rel_error(y, ref) < 1e-2


def test_scaled_twin_rounds_the_scaled_weight_once():
    gen = torch.Generator().manual_seed(4)
    trellis = random_trellis(8, 8, 3, gen)
    xh = torch.randn(66, 128, generator=gen).half()
    scale = torch.tensor([0.0371]).half()
    got = reference.dense_sums(xh, trellis, 3, "mcg", scale)
    weight = (decode_tiles(trellis, 3, "mcg").float() * scale.float()).half()
    assert got.dtype == torch.float16
    assert torch.equal(got, (xh.float() @ weight.float()).half())


@pytest.mark.cuda
@pytest.mark.parametrize(("k", "codebook"), [(2, "mul1"), (4, "mul1"), (3.5, "mul1"),
                                             (3, "mcg"), (5, "3inst")])
def test_scaled_decode_and_float16_sums(k: float, codebook: str) -> None:
    _gpu()
    ext = kernels._extension()
    gen = torch.Generator().manual_seed(int(10 * k) + 7)
    k2, cb = int(2 * k), kernels._codebook_id(codebook, int(2 * k))
    for kb, nb in ((24, 12), (16, 72)):
        trellis = random_trellis(kb, nb, k, gen)
        scale = torch.tensor([0.0123 + 0.01 * kb]).half()
        out = torch.full((16 * kb, 16 * nb), float("nan"), dtype=torch.float16, device="cuda")
        ext.decode_scaled(trellis.cuda(), k2, cb, out, scale.cuda())
        want = (decode_tiles(trellis, k, codebook).float() * scale.float()).half()
        assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16)), (kb, nb)
        xh = torch.randn(300, 16 * kb, generator=gen).half()
        got = kernels.dense_sums(xh.cuda(), trellis.cuda(), k2, cb, scale.cuda())
        assert got is not None and got.dtype == torch.float16
        assert rel_error(got, reference.dense_sums(xh, trellis, k, codebook, scale).double()) < 2e-3


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_output_kernels_read_float16_sums(dtype) -> None:
    """hadamard_out and glu_hadamard on float16 (1, rows, width) sums: exactly what they
    give for the same values in float32, and the twin's result."""
    from exl3cli.ops import layer_kernels

    _gpu()
    gen = torch.Generator().manual_seed(8)
    rows, width, cols = 130, 384, 300
    sums = [(torch.randn(1, rows, width, generator=gen) * 4).half() for _ in range(2)]
    post = [0.5 + torch.rand(width, generator=gen) for _ in range(2)]
    bias = [torch.randn(width, generator=gen) for _ in range(2)]
    pre = torch.randn(width, generator=gen).sign()
    residual = torch.randn(rows, cols, generator=gen).to(dtype)

    def out(partials, device):
        o = torch.full((rows, cols), float("nan"), dtype=dtype, device=device)
        layer_kernels.hadamard_out(partials, [post[0].to(device)], [bias[0].to(device)], [o],
                                   [0], residual=residual.to(device))
        return o

    half = out([sums[0].cuda()], "cuda")
    assert torch.equal(half, out([sums[0].float().cuda()], "cuda"))
    twin = out([sums[0]], "cpu")
    assert rel_error(half, twin.double()) < 1e-2

    def glu(gate, up, device):
        return layer_kernels.glu_hadamard(gate, up, post[0].to(device), post[1].to(device),
                                          bias[0].to(device), bias[1].to(device), cols,
                                          "silu", pre.to(device), dtype)

    half = glu(sums[0].cuda(), sums[1].cuda(), "cuda")
    assert half.dtype == torch.float16 and torch.isfinite(half).all()
    assert torch.equal(half, glu(sums[0].float().cuda(), sums[1].float().cuda(), "cuda"))
    assert rel_error(half, glu(sums[0], sums[1], "cpu").double()) < 1e-2
