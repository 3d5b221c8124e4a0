"""CPU decode path of DenseLinear: the packed GEMV kernel (csrc/ops/cpu/gemv_cpu.cpp) against
its PyTorch twin, the packing format, and models loaded with each `cpu_weights` mode."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from exl3cli.engine.layers.linear import GEMV_MAX_ROWS, DenseLinear, pack_for_cpu
from exl3cli.engine.models.loader import load_causal_lm, resolve_cpu_weights
from exl3cli.errors import InvalidOption
from exl3cli.ops import cpu_kernels
from tests.fixtures.paged import PagedSequences
from tests.fixtures.tiny_model import write_tiny_model

MODES = ("fp32", "bf16", "int8")
# (rows, in, out): decode sizes, odd sizes (padding, k tail), one row per kernel pass.
SHAPES = [(1, 576, 960), (3, 64, 100), (8, 1536, 576), (5, 100, 37), (2, 7, 1)]
# Relative error of each mode's weights against the float32 product.
MODE_TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2, "int8": 2e-2}


def _kernel_required() -> None:
    if shutil.which("c++") and shutil.which("ninja"):
        assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
    else:
        pytest.fail(f"CPU kernel unavailable: {cpu_kernels.unavailable_reason()}")


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gemv_kernel_matches_torch_reference(mode: str, shape: tuple[int, int, int]) -> None:
    _kernel_required()
    rows, k, n = shape
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))  # fresh inputs
    weight = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g)
    packed, scale = cpu_kernels.pack_gemv_weight(weight, mode)
    for b in (bias, None):
        fast = cpu_kernels.gemv_cpu(x, packed, scale, b, n)
        twin = cpu_kernels.gemv_reference(x, packed, scale, b, n)
        assert fast.shape == (rows, n) and fast.dtype == torch.float32
        # Errors relative to the size of the terms summed: with one or two outputs the
        # outputs themselves can land near zero by chance.
        magnitude = float(F.linear(x.abs(), weight.abs(), None if b is None else b.abs()).max())
        assert float((fast - twin).abs().max()) / magnitude < 1e-5  # other summation order
        exact = F.linear(x, weight, b)
        assert float((twin - exact).abs().max()) / magnitude < MODE_TOLERANCE[mode]


def test_packing_round_trip_and_int8_scales() -> None:
    weight = torch.randn(70, 33)
    weight[5] = 0.0  # an all-zero row must not divide by zero
    fp32, none = cpu_kernels.pack_gemv_weight(weight, "fp32")
    assert none is None and fp32.shape == (3, 33, 32)  # 70 rows padded to 96
    assert torch.equal(cpu_kernels.unpack_gemv_weight(fp32)[:70], weight)
    assert cpu_kernels.unpack_gemv_weight(fp32)[70:].abs().sum() == 0
    bf16, _ = cpu_kernels.pack_gemv_weight(weight, "bf16")
    assert torch.equal(cpu_kernels.unpack_gemv_weight(bf16)[:70], weight.bfloat16())
    q, scale = cpu_kernels.pack_gemv_weight(weight, "int8")
    assert q.dtype == torch.int8 and scale.shape == (70,)
    assert int(q.abs().max()) == 127 and torch.isfinite(scale).all()
    back = cpu_kernels.unpack_gemv_weight(q, scale)[:70]
    assert ((back - weight).abs() <= scale[:, None] / 2 + 1e-7).all()
    transposed = cpu_kernels.unpack_gemv_weight(q, scale, transposed=True)
    assert torch.equal(transposed[:, :70], back.t())
    with pytest.raises(ValueError, match="int4"):
        cpu_kernels.pack_gemv_weight(weight, "int4")


@pytest.mark.parametrize("mode", MODES)
def test_packed_dense_linear_decode_and_prompt(mode: str) -> None:
    _kernel_required()
    weight, bias = torch.randn(100, 64), torch.randn(100)
    plain = DenseLinear(weight, bias)
    packed = pack_for_cpu(plain, mode)
    assert packed.cpu_weights == mode and packed.weight is None
    assert (packed.in_features, packed.out_features) == (64, 100)
    # Decode rows go through the kernel, a prompt through the unpacked matmul (bf16
    # compute for the low-precision modes).
    for steps, tol in ((1, MODE_TOLERANCE[mode]), (GEMV_MAX_ROWS + 5, 2e-2)):
        x = torch.randn(2, steps, 64)
        y = packed(x)
        assert y.shape == (2, steps, 100) and y.dtype == torch.float32
        assert _rel_err(y, plain(x)) < (1e-5 if mode == "fp32" else tol)
    w, b = packed.dense_weight()
    assert w.shape == (100, 64) and _rel_err(w, weight) < MODE_TOLERANCE[mode]
    assert torch.equal(b, bias)
    with pytest.raises(ValueError, match="cpu_weights"):
        DenseLinear(weight, cpu_weights="fp8")


def test_reference_fallback_without_the_kernel(monkeypatch) -> None:
    weight = torch.randn(40, 24)
    x = torch.randn(1, 24)
    monkeypatch.setenv("EXL3_NO_EXT", "1")
    layer = DenseLinear(weight, cpu_weights="bf16")  # runs the PyTorch twin
    assert _rel_err(layer(x), x @ weight.t()) < MODE_TOLERANCE["bf16"]
    # Without the kernel the exact default keeps the plain matrix (faster there).
    assert resolve_cpu_weights(None, torch.device("cpu"), torch.float32) is None
    assert resolve_cpu_weights("int8", torch.device("cpu"), torch.float32) == "int8"


def test_cpu_weights_resolution(monkeypatch) -> None:
    _kernel_required()
    cpu = torch.device("cpu")
    monkeypatch.delenv("EXL3_CPU_WEIGHTS", raising=False)
    assert resolve_cpu_weights(None, cpu, torch.float32) == "exl3"  # dense layers as fp32
    assert resolve_cpu_weights(None, cpu, torch.bfloat16) == "exl3"
    assert resolve_cpu_weights("fp32", cpu, torch.bfloat16) is None  # kernel takes float32
    assert resolve_cpu_weights("int8", torch.device("cuda"), torch.float32) is None
    assert resolve_cpu_weights("off", cpu, torch.float32) is None
    monkeypatch.setenv("EXL3_CPU_WEIGHTS", "bf16")
    assert resolve_cpu_weights(None, cpu, torch.float32) == "bf16"
    assert resolve_cpu_weights("int8", cpu, torch.float32) == "int8"  # argument wins
    with pytest.raises(InvalidOption, match="int4"):
        resolve_cpu_weights("int4", cpu, torch.float32)


def _decode_logits(model, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits of ids[:, :prompt_len] as a prompt, then of each later token fed alone
    (through the paged cache)."""
    seqs = PagedSequences(model, 1, ids.shape[1])
    logits = seqs.feed(ids[:, :prompt_len])
    logits += [seqs.feed(ids[:, t : t + 1])[0] for t in range(prompt_len, ids.shape[1])]
    return torch.cat(logits)[None]


def test_default_cpu_model_is_packed_and_exact(tmp_path) -> None:
    _kernel_required()
    folder = write_tiny_model(tmp_path, "llama", tie_word_embeddings=True)
    model = load_causal_lm(folder, device="cpu")
    plain = load_causal_lm(folder, device="cpu", cpu_weights="off")
    attention = model.layers[0].attention
    assert attention.qkv.cpu_weights == "fp32" and attention.o.cpu_weights == "fp32"
    assert plain.layers[0].attention.qkv.cpu_weights is None
    # fp32 keeps the tied head on the embedding's storage.
    assert model.lm_head_weight.data_ptr() == model.embed_weight.data_ptr()
    ids = torch.randint(3, 300, (1, 18), generator=torch.Generator().manual_seed(7))
    assert _rel_err(_decode_logits(model, ids, 12), _decode_logits(plain, ids, 12)) < 1e-5


@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_low_precision_modes_stay_close(tmp_path, monkeypatch, mode: str) -> None:
    _kernel_required()
    folder = write_tiny_model(tmp_path, "qwen2", tie_word_embeddings=True)
    monkeypatch.setenv("EXL3_CPU_WEIGHTS", mode)
    model = load_causal_lm(folder, device="cpu")
    plain = load_causal_lm(folder, device="cpu", cpu_weights="off")
    assert model.layers[1].mlp.down.cpu_weights == mode
    assert model.lm_head.cpu_weights == mode  # the tied head gets its own packed copy
    ids = torch.randint(3, 300, (1, 16), generator=torch.Generator().manual_seed(8))
    ours, exact = model(ids), plain(ids)
    assert 0 < _rel_err(ours, exact) < 0.05  # changed, but only a little
    assert _rel_err(_decode_logits(model, ids, 12), _decode_logits(plain, ids, 12)) < 0.05
