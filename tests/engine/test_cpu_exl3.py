"""EXL3 layers on the CPU at their compressed size: the trellis kernel
(csrc/ops/cpu/exl3_gemm_cpu.cpp) against its PyTorch twin and the codec's reference decode,
the CpuExl3Linear layer, and models loaded with ``cpu_weights="exl3"``."""

from __future__ import annotations

import shutil

import pytest
import torch

from exl3cli.cli.bench_speed import bytes_per_token
from exl3cli.codec import decode_tiles
from exl3cli.codec.bitstream import words_per_tile
from exl3cli.convert.synthetic import random_exl3_linear, write_synthetic_model
from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.layers.cpu_exl3 import CpuExl3Linear
from exl3cli.engine.layers.linear import DenseLinear, Exl3Linear, FusedLinear
from exl3cli.engine.models.loader import load_causal_lm, resolve_cpu_weights
from exl3cli.engine.text.tokenizer import Tokenizer
from exl3cli.errors import InvalidOption
from exl3cli.ops import cpu_kernels

K_VALUES = (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8)
CASES = [(k, cb) for k in K_VALUES for cb in ("mul1", "mcg", "3inst")
         if cb == "mul1" or float(k).is_integer()]  # half K exists for mul1 only


def _kernel_required() -> None:
    if shutil.which("c++") and shutil.which("ninja"):
        assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
    else:
        pytest.fail(f"CPU kernel unavailable: {cpu_kernels.unavailable_reason()}")


def _random_trellis(kb: int, nb: int, k: float, g: torch.Generator) -> torch.Tensor:
    return torch.randint(-32768, 32768, (kb, nb, words_per_tile(k)), generator=g,
                         dtype=torch.int32).to(torch.int16)


def _fresh() -> torch.Generator:
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))


@pytest.mark.parametrize("k,codebook", CASES, ids=lambda v: str(v))
def test_kernel_decode_is_bit_exact(k: float, codebook: str) -> None:
    """Every tile value the kernel decodes in registers equals the codec's decode_tiles
    (random words cover all states' paths through the codebook)."""
    _kernel_required()
    trellis = _random_trellis(3, 5, k, _fresh())
    expected = decode_tiles(trellis, k, codebook).float()
    trellis_t = trellis.transpose(0, 1).contiguous()
    assert torch.equal(cpu_kernels.exl3_decode_cpu(trellis_t, k, codebook), expected)
    assert torch.equal(cpu_kernels.exl3_decode_reference(trellis_t, k, codebook), expected)


@pytest.mark.parametrize("k,codebook", CASES, ids=lambda v: str(v))
def test_kernel_gemv_values_are_bit_exact(k: float, codebook: str) -> None:
    """The 1-2 row GEMV's decoded values (step order, with or without AVX512-FP16's
    float16 arithmetic) are the codec's bit for bit: x a unit vector e_r picks row r of
    the dequantized weight, every other product an exact zero."""
    _kernel_required()
    g = _fresh()
    kb, nb = 3, 40  # 30720 random states
    trellis = _random_trellis(kb, nb, k, g)
    expected = decode_tiles(trellis, k, codebook).float()
    trellis_t = trellis.transpose(0, 1).contiguous()
    eye = torch.eye(16 * kb)
    for rows in (1, 2):
        for r0 in range(0, 16 * kb, rows):
            xh = eye[r0:r0 + rows]
            got = cpu_kernels.exl3_matmul_cpu(xh, trellis_t, k, codebook)
            assert torch.equal(got, expected[r0:r0 + rows]), (rows, r0)


def _veltkamp_half(v: torch.Tensor) -> torch.Tensor:
    """round_half of exl3_step_gemv.h: float32 v rounded to 11 significant bits."""
    c = v * 8193.0
    return c - (c - v)


def test_float32_rounding_of_every_codebook_value_is_float16_rounding() -> None:
    """The step GEMV without AVX512-FP16 rounds each codebook value, computed exactly in
    float32, by Veltkamp's split: for every value the codebooks make (mul1's 1021 byte
    sums, all 65536 states of 3inst and mcg) that is float16 rounding."""
    n = torch.arange(1021, dtype=torch.float32)
    exact = n * (1774 / 262144) - 3.453125  # exact in float32
    assert torch.equal(_veltkamp_half(exact), exact.half().float())
    states = torch.arange(65536, dtype=torch.int64)
    for mult, add in ((89226354, 64248484), (0xCBAC1FED, 0)):  # 3inst, mcg
        x = (states * mult + add) & 0xFFFFFFFF
        m = (x & 0x8FFF8FFF) ^ 0x3B603B60
        lo = (m & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.float16).float()
        hi = (m >> 16).to(torch.int32).to(torch.int16).view(torch.float16).float()
        total = lo + hi  # exact in float32
        assert torch.equal(_veltkamp_half(total), (lo.half() + hi.half()).float())


@pytest.mark.parametrize("k,codebook", CASES, ids=lambda v: str(v))
def test_kernel_matmul_matches_reference(k: float, codebook: str) -> None:
    """Fused decode-multiply (1..8 rows) and the decoded-strip path (more rows)."""
    _kernel_required()
    g = _fresh()
    trellis_t = _random_trellis(4, 3, k, g).transpose(0, 1).contiguous()
    for rows in (1, 2, 5, 8, 9, 33):
        xh = torch.randn(rows, 64, generator=g)
        fast = cpu_kernels.exl3_matmul_cpu(xh, trellis_t, k, codebook)
        twin = cpu_kernels.exl3_matmul_reference(xh, trellis_t, k, codebook)
        assert fast.shape == (rows, 48)
        torch.testing.assert_close(fast, twin, rtol=1e-5, atol=1e-5)


GEMV_CASES = [(k, cb) for k in (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8) for cb in ("mul1", "mcg", "3inst")
              if cb == "mul1" or float(k).is_integer()]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {flag for line in f if line.startswith("flags") for flag in line.split()}
    except OSError:
        return set()


def _has_step_order() -> bool:
    """Whether the -march=native build has the step-order GEMV (AVX-512 BW; the float16
    rounding natively with AVX512-FP16, in float32 without it)."""
    return {"avx512f", "avx512bw"} <= _cpu_flags()


@pytest.mark.parametrize("k,codebook", GEMV_CASES, ids=lambda v: str(v))
def test_kernel_decode_gemv_odd_shapes(k: float, codebook: str) -> None:
    """The 1-2 row GEMV (trellis-step order on AVX-512 BW builds: one window per 32
    steps, the ring's end wrapping into vector 0, a fold of 8 accumulators per strip) on
    one-tile, one-strip and odd-sized trellises, on one and two threads."""
    _kernel_required()
    # The build is -march=native: a CPU with AVX-512 BW must take the step-order path.
    expected_kind = "steps" if _has_step_order() else (
        "rows" if cpu_kernels.simd_level() == "avx512" else "scalar")
    assert [cpu_kernels.exl3_gemv_kind(k, r) for r in (1, 2, 9)] == [expected_kind] * 2 + [
        "strips"]
    g = _fresh()
    threads = torch.get_num_threads()
    try:
        for kb, nb, n_threads in ((1, 1, 1), (1, 7, 1), (7, 1, 1), (5, 9, 2), (13, 3, 2)):
            torch.set_num_threads(n_threads)
            trellis_t = _random_trellis(kb, nb, k, g).transpose(0, 1).contiguous()
            for rows in (1, 2, 3):
                xh = torch.randn(rows, 16 * kb, generator=g)
                fast = cpu_kernels.exl3_matmul_cpu(xh, trellis_t, k, codebook)
                twin = cpu_kernels.exl3_matmul_reference(xh, trellis_t, k, codebook)
                # Float32 summation order only (the values are checked bit for bit in
                # test_kernel_gemv_values_are_bit_exact): relative to the largest output,
                # not an absolute 1e-5 that sums of 208 terms exceed now and then.
                scale = twin.abs().max()
                torch.testing.assert_close(fast / scale, twin / scale, rtol=0, atol=2e-6)
    finally:
        torch.set_num_threads(threads)


# (rows, in, out, K): logical sizes below the padded ones (trimmed), several strips.
LINEAR_SHAPES = [(1, 576, 960, 4), (3, 100, 250, 2), (8, 256, 128, 6), (12, 128, 384, 3),
                 (1, 1536, 576, 5)]


@pytest.mark.parametrize("shape", LINEAR_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("codebook", ["mul1", "mcg", "3inst"])
def test_kernel_linear_matches_dequantized_weight(shape, codebook) -> None:
    """The whole layer (suh, Hadamard, decode, Hadamard, svh, bias, trim) in one op
    against its twin and against x @ W with W dequantized by the codec."""
    _kernel_required()
    rows, n_in, n_out, k = shape
    g = _fresh()
    tensors = random_exl3_linear(n_in, n_out, k, codebook, generator=g)
    tensors["bias"] = torch.randn(n_out, generator=g).half()
    dense = Exl3Linear(tensors, n_in, n_out, mode="dense")
    layer = CpuExl3Linear(Exl3Linear(tensors, n_in, n_out, mode="trellis"))
    assert layer._kernel
    x = torch.randn(rows, n_in, generator=g)
    expected = dense(x)
    got = layer(x)
    twin = cpu_kernels.exl3_linear_reference(x, layer.trellis_t, layer.suh, layer.svh,
                                             layer.bias, k, codebook, n_out)
    scale = float(expected.abs().max())
    assert got.shape == (rows, n_out)
    assert float((got - twin).abs().max()) / scale < 1e-5
    assert float((got - expected).abs().max()) / scale < 1e-5
    # Leading dimensions and other activation dtypes pass through.
    assert layer(x.view(1, rows, n_in).bfloat16()).shape == (1, rows, n_out)


def test_layer_falls_back_to_the_reference_and_holds_the_trellis(monkeypatch) -> None:
    tensors = random_exl3_linear(256, 200, 4, "mul1", generator=torch.Generator().manual_seed(1))
    monkeypatch.setenv("EXL3_NO_EXT", "1")
    layer = CpuExl3Linear(Exl3Linear(tensors, 256, 200, mode="trellis"))
    assert not layer._kernel and layer.dense_weight() is None
    # 4 bits a weight (256 x 256 padded) plus float32 scales: no dense copy.
    assert layer.nbytes == 256 * 256 // 2 + 4 * (256 + 256)
    x = torch.randn(2, 256)
    dense = Exl3Linear(tensors, 256, 200, mode="dense")
    torch.testing.assert_close(layer(x), dense(x), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="trellis mode"):
        CpuExl3Linear(dense)


def test_exl3_mode_resolution(monkeypatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setenv("EXL3_CPU_WEIGHTS", "exl3")
    assert resolve_cpu_weights(None, cpu, torch.float32) == "exl3"
    assert resolve_cpu_weights(None, cpu, torch.bfloat16) == "exl3"  # any activation dtype
    assert resolve_cpu_weights(None, torch.device("cuda"), torch.float32) is None
    with pytest.raises(InvalidOption, match="exl3"):
        resolve_cpu_weights("q4", cpu, torch.float32)


@pytest.fixture(scope="module")
def tiny_exl3(tmp_path_factory):
    return write_synthetic_model(tmp_path_factory.mktemp("tiny"), "tiny", bits=3.5,
                                 head_bits=6)


def _greedy(model, folder, prompt: str, n: int = 12) -> list[int]:
    tokenizer = Tokenizer.from_folder(folder)
    generator = Generator(model, tokenizer, max_batch=1, num_ctx=128)
    handle = generator.submit(GenerationJob(tokenizer.encode(prompt), {"temperature": 0},
                                            num_predict=n))
    generator.run_until_done()
    return handle.token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exl3_mode_model_matches_dense_model(tiny_exl3, dtype) -> None:
    """Compressed and dequantized models: same logits (float order) and greedy text; the
    compressed one holds no dense copy of any EXL3 layer."""
    dense = load_causal_lm(tiny_exl3, device="cpu", dtype=dtype, cpu_weights="fp32")
    small = load_causal_lm(tiny_exl3, device="cpu", dtype=dtype, cpu_weights="exl3")
    linears = [m for m in small.modules() if isinstance(m, CpuExl3Linear)]
    assert len(linears) == 2 * 7 + 1  # 2 layers x q, k, v, o, gate, up, down + head
    assert not any(isinstance(m, DenseLinear) for m in small.modules())
    assert isinstance(small.layers[0].attention.qkv, FusedLinear)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6]])
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(small(ids), dense(ids), rtol=tol, atol=tol)
    if dtype == torch.float32:
        assert _greedy(small, tiny_exl3, "Hello") == _greedy(dense, tiny_exl3, "Hello")
    # exl3 bench's bytes per decode token: the trellises as stored, plus norms and a row.
    stored = sum(m.nbytes for m in linears)
    assert stored < bytes_per_token(small, 0) < stored + 16 * 1024
    assert bytes_per_token(dense, 0) > 2 * stored  # dequantized: 16 or 32 bits a weight
