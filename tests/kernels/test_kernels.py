"""exl3cli.ops.cuda_kernels: CUDA kernels against the reference codec, and the CPU fallback.

CUDA tests (``-m cuda``, on the GPU machine): fresh random inputs per case, outputs
poisoned with NaN before each run; decode must be bit-exact, GEMM relative error
< 1e-2 against a float64 reference built from ``dequantize_linear``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from exl3cli.codec import MARKER_VALUES, block_hadamard, decode_tiles, dequantize_linear
from exl3cli.ops import cuda_kernels as kernels

VECTORS = Path(__file__).parents[1] / "data" / "exl3-vectors" / "decode-vectors.safetensors"
INTEGER_CASES = [(k, cb) for cb in ("mul1", "mcg", "3inst") for k in range(1, 9)]
ALL_CASES = INTEGER_CASES + [(k, "mul1") for k in (1.5, 2.5, 3.5)]


def random_trellis(kb: int, nb: int, k: float, gen: torch.Generator) -> torch.Tensor:
    words = int(16 * k)
    return torch.randint(-32768, 32768, (kb, nb, words), dtype=torch.int16, generator=gen)


def random_linear(in_f: int, out_f: int, k: float, codebook: str, gen: torch.Generator,
                  bias: bool = True) -> dict[str, torch.Tensor]:
    pad_in, pad_out = -(-in_f // 128) * 128, -(-out_f // 128) * 128
    signs_in = torch.randint(0, 2, (pad_in,), generator=gen) * 2 - 1
    signs_out = torch.randint(0, 2, (pad_out,), generator=gen) * 2 - 1
    tensors = {
        "trellis": random_trellis(pad_in // 16, pad_out // 16, k, gen),
        "suh": (signs_in * (0.5 + torch.rand(pad_in, generator=gen))).half(),
        "svh": (signs_out * (0.5 + torch.rand(pad_out, generator=gen)) * 0.05).half(),
    }
    if codebook != "3inst":
        tensors[codebook] = torch.tensor(MARKER_VALUES[codebook], dtype=torch.int32)
    if bias:
        tensors["bias"] = torch.randn(out_f, generator=gen).half()
    return tensors


def reference_linear(x: torch.Tensor, tensors: dict[str, torch.Tensor], in_f: int,
                     out_f: int) -> torch.Tensor:
    w = dequantize_linear(tensors, in_f, out_f).double()
    y = x.double().cpu() @ w
    if "bias" in tensors:
        y = y + tensors["bias"].double()
    return y


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    y = y.double().cpu()
    assert torch.isfinite(y).all(), "output has NaN/inf (unwritten or overflowed entries)"
    return float((y - ref).norm() / ref.norm())


# ---------------------------------------------------------------- CPU / fallback tests


def test_fallback_gemm_matches_dequantized_weight_on_cpu() -> None:
    gen = torch.Generator().manual_seed(11)
    tensors = random_linear(200, 250, 4, "mul1", gen)
    x = torch.randn(3, 200, generator=gen)
    y = kernels.exl3_gemm(x, tensors["trellis"], tensors["suh"][:200], tensors["svh"][:250], 4,
                          "mul1", bias=tensors["bias"])
    assert y.shape == (3, 250) and y.dtype == torch.float32
    assert rel_error(y, reference_linear(x, tensors, 200, 250)) < 1e-5


def test_fallback_decode_and_out_argument_on_cpu() -> None:
    gen = torch.Generator().manual_seed(12)
    trellis = random_trellis(2, 3, 2.5, gen)
    out = torch.full((32, 48), float("nan"), dtype=torch.float16)
    result = kernels.exl3_decode(trellis, 2.5, "mul1", out=out)
    assert result.data_ptr() == out.data_ptr()
    assert torch.equal(out.view(torch.int16), decode_tiles(trellis, 2.5, "mul1").view(torch.int16))


def test_fallback_hadamard_on_cpu() -> None:
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(4, 256, generator=gen)
    pre, post, bias = (torch.randn(256, generator=gen) for _ in range(3))
    y = kernels.hadamard128(x, pre, post, bias)
    expected = block_hadamard(x * pre, dim=-1) * post + bias
    assert torch.allclose(y, expected, atol=1e-5)


def test_wrappers_reject_bad_bits_and_codebooks() -> None:
    trellis = torch.zeros(1, 1, 64, dtype=torch.int16)
    with pytest.raises(ValueError):
        kernels.exl3_decode(trellis, 4.25, "mul1")
    with pytest.raises(ValueError):
        kernels.exl3_decode(trellis, 4, "nope")
    with pytest.raises(ValueError):
        kernels.exl3_decode(torch.zeros(1, 1, 40, dtype=torch.int16), 2.5, "mcg")


def test_no_ext_environment_variable_forces_fallback() -> None:
    script = (
        "import torch; from exl3cli.ops import cuda_kernels as kernels\n"
        "dev = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
        "t = torch.randint(-32768, 32768, (8, 8, 64), dtype=torch.int16, device=dev)\n"
        "x = torch.randn(2, 128, device=dev)\n"
        "s = torch.ones(128, device=dev)\n"
        "y = kernels.exl3_gemm(x, t, s, s, 4, 'mul1')\n"
        "print(kernels.available(), kernels.unavailable_reason(), tuple(y.shape), y.device.type)\n"
    )
    env = dict(os.environ, EXL3_NO_EXT="1")
    root = Path(__file__).parents[2]
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("False EXL3_NO_EXT is set (2, 128)"), line


# ---------------------------------------------------------------- CUDA tests


def _gpu_ext():
    assert torch.cuda.is_available(), "cuda tests need a GPU"
    assert kernels.available(), f"extension did not load: {kernels.unavailable_reason()}"


@pytest.mark.cuda
def test_extension_loads_on_gpu() -> None:
    _gpu_ext()
    assert kernels.unavailable_reason() is None


@pytest.mark.cuda
@pytest.mark.parametrize(("k", "codebook"), ALL_CASES)
def test_decode_kernel_bit_exact(k: float, codebook: str) -> None:
    _gpu_ext()
    gen = torch.Generator().manual_seed(int(100 * k) + len(codebook))
    for kb, nb in ((1, 1), (3, 5), (8, 24), (17, 9)):
        trellis = random_trellis(kb, nb, k, gen)
        expected = decode_tiles(trellis, k, codebook)
        out = torch.full((16 * kb, 16 * nb), float("nan"), dtype=torch.float16, device="cuda")
        kernels.exl3_decode(trellis.cuda(), k, codebook, out=out)
        assert torch.equal(out.cpu().view(torch.int16), expected.view(torch.int16)), (kb, nb)


@pytest.mark.cuda
@pytest.mark.parametrize("case", sorted({f"{cb}.K{k:g}" for k, cb in ALL_CASES}))
def test_decode_kernel_matches_exllamav3_vectors(case: str) -> None:
    _gpu_ext()
    vectors = load_file(str(VECTORS))
    codebook, k = case.split(".K")
    out = torch.full((256, 256), float("nan"), dtype=torch.float16, device="cuda")
    kernels.exl3_decode(vectors[f"{case}.trellis"].cuda(), float(k), codebook, out=out)
    assert torch.equal(out.cpu().view(torch.int16), vectors[f"{case}.decoded"].view(torch.int16))


@pytest.mark.cuda
@pytest.mark.parametrize(("k", "codebook"), ALL_CASES)
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 32, 33, 57, 64])
def test_fused_gemm_partials_exact_sum(k: float, codebook: str, rows: int) -> None:
    """The split partial sums add up to xh · Ŵ (float32 accumulation of exact products)."""
    _gpu_ext()
    ext = kernels._extension()
    gen = torch.Generator().manual_seed(rows * 31 + int(4 * k))
    trellis = random_trellis(24, 12, k, gen).cuda()
    xh = torch.randn(rows, 384, generator=gen).half().cuda()
    k2 = int(2 * k)
    for splits in (1, 3):
        partial = torch.full((splits, rows, 192), float("nan"), device="cuda")
        ext.gemm_partial(xh, trellis, k2, kernels._CODEBOOK_IDS[codebook], partial)
        expected = xh.double() @ decode_tiles(trellis, k, codebook).double()
        got = partial.double().sum(0)
        assert torch.isfinite(got).all()
        assert float((got - expected).norm() / expected.norm()) < 1e-5, splits


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 31, 32, 33, 64, 65, 100])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gemm_matches_float_reference(rows: int, dtype: torch.dtype) -> None:
    _gpu_ext()
    gen = torch.Generator().manual_seed(rows + 1000 * (dtype == torch.bfloat16))
    for (in_f, out_f), (k, codebook) in (((512, 384), (4, "mul1")), ((1000, 700), (3, "mcg")),
                                         ((256, 1024), (2.5, "mul1")), ((384, 256), (6, "3inst"))):
        tensors = random_linear(in_f, out_f, k, codebook, gen)
        x = torch.randn(rows, in_f, generator=gen)
        ref = reference_linear(x.to(dtype).float(), tensors, in_f, out_f)
        out = torch.full((rows, out_f), float("nan"), dtype=dtype, device="cuda")
        cuda = {name: t.cuda() for name, t in tensors.items()}
        y = kernels.exl3_gemm(x.to(dtype).cuda(), cuda["trellis"], cuda["suh"][:in_f],
                              cuda["svh"][:out_f], k, codebook, bias=cuda["bias"], out=out,
                              out_features=out_f)
        assert y.data_ptr() == out.data_ptr() and y.dtype == dtype
        assert rel_error(out, ref) < 1e-2, (in_f, out_f, k, codebook)


@pytest.mark.cuda
def test_gemm_keeps_leading_dimensions_and_no_bias() -> None:
    _gpu_ext()
    gen = torch.Generator().manual_seed(5)
    tensors = random_linear(256, 256, 4, "mul1", gen, bias=False)
    x = torch.randn(2, 3, 256, generator=gen).half()
    cuda = {name: t.cuda() for name, t in tensors.items()}
    y = kernels.exl3_gemm(x.cuda(), cuda["trellis"], cuda["suh"], cuda["svh"], 4, "mul1")
    assert y.shape == (2, 3, 256)
    assert rel_error(y.reshape(6, 256), reference_linear(x.reshape(6, 256).float(), tensors,
                                                         256, 256)) < 1e-2


@pytest.mark.cuda
@pytest.mark.parametrize("in_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_hadamard_kernel_with_scales_and_bias(in_dtype: torch.dtype,
                                              out_dtype: torch.dtype) -> None:
    _gpu_ext()
    ext = kernels._extension()
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 37, 384, generator=gen).to(in_dtype)
    pre, post, bias = (torch.randn(384, generator=gen) for _ in range(3))
    # Slices are summed before the rotation; columns past 300 of x read as zero.
    expected = block_hadamard(
        torch.nn.functional.pad(x.float().sum(0)[:, :300], (0, 84)) * pre, dim=-1
    ) * post + bias
    out = torch.full((37, 384), float("nan"), dtype=out_dtype, device="cuda")
    ext.hadamard(x[:, :, :300].cuda(), pre.cuda(), post.cuda(), bias.cuda(), out, 384)
    tol = 1e-5 if out_dtype == torch.float32 else 2e-3
    assert rel_error(out, expected.double()) < tol
