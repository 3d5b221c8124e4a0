"""The compiled Viterbi kernels (C++ CPU, CUDA) against the PyTorch reference search:
the same states on fresh random targets for every K and codebook, dispatch from
``viterbi_states``, and the ``EXL3_NO_EXT=1`` fallback."""

from __future__ import annotations

import shutil

import pytest
import torch

from exl3cli.codec.bitstream import pack_states, states_are_consistent, unpack_states
from exl3cli.codec.codebooks import codebook_lut_float32
from exl3cli.codec.dequant import decode_tiles
from exl3cli.codec.tiles import matrix_to_tiles, tile_to_steps
from exl3cli.ops import cpu_kernels, cuda_viterbi
from exl3cli.ops.viterbi import viterbi_states, viterbi_states_reference

CASES = [("mul1", k) for k in (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8)] + [
    ("3inst", 2), ("3inst", 4), ("mcg", 3), ("mcg", 6)]


def _targets(seed: int, n: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 256, generator=g) * scale


def _cost(states: torch.Tensor, targets: torch.Tensor, codebook: str) -> torch.Tensor:
    lut = codebook_lut_float32(codebook).to(states.device)
    return (lut[states] - targets.to(states.device)).pow(2).sum(dim=1)


def _assert_same_search(states: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor,
                        k_bits: float, codebook: str) -> None:
    states, reference = states.cpu(), reference.cpu()
    assert states.dtype == torch.int64 and states.shape == reference.shape
    assert states_are_consistent(states, k_bits).all()
    # A valid ring packs and unpacks to itself.
    assert torch.equal(unpack_states(pack_states(states, k_bits), k_bits), states)
    # Same float arithmetic and tie-breaking as the reference: the very same states.
    assert torch.equal(states, reference), (
        f"{int((states != reference).any(1).sum())} tiles differ; cost ratio "
        f"{float(_cost(states, targets, codebook).sum() / _cost(reference, targets, codebook).sum())}")


def test_cpu_kernel_builds_where_a_compiler_exists():
    if shutil.which("c++") and shutil.which("ninja"):
        assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
        assert cpu_kernels.simd_level() in ("avx512", "avx2", "scalar")
    else:
        assert not cpu_kernels.available() and cpu_kernels.unavailable_reason()


@pytest.mark.parametrize(("codebook", "k_bits"), CASES)
def test_cpu_kernel_matches_reference(codebook: str, k_bits: float) -> None:
    if not cpu_kernels.available():
        pytest.fail(f"CPU kernel unavailable: {cpu_kernels.unavailable_reason()}")
    seed = torch.randint(0, 2**31 - 1, ()).item()  # fresh targets every run
    # Three tiles: one pair searched together plus one on its own.
    targets = _targets(seed, 3, scale=1.0 + 0.25 * (k_bits % 2))
    reference = viterbi_states_reference(targets, k_bits, codebook)
    states = cpu_kernels.viterbi_states_cpu(targets, k_bits, codebook)
    _assert_same_search(states, reference, targets, k_bits, codebook)


@pytest.mark.parametrize(("codebook", "k_bits"), [("mul1", 2), ("mcg", 5), ("mul1", 3.5)])
def test_cpu_kernel_recovers_representable_tiles(codebook: str, k_bits: float) -> None:
    # Decoded random streams: zero error is reachable, and with many states sharing a
    # value the tie-breaking has to match too.
    g = torch.Generator().manual_seed(int(7 * k_bits))
    source = torch.randint(-32768, 32768, (1, 4, int(16 * k_bits)), generator=g).to(torch.int16)
    decoded = decode_tiles(source, k_bits, codebook).float()  # (16, 64) matrix
    targets = tile_to_steps(matrix_to_tiles(decoded)).reshape(4, 256)
    states = cpu_kernels.viterbi_states_cpu(targets, k_bits, codebook)
    assert _cost(states, targets, codebook).max().item() == 0.0
    _assert_same_search(states, viterbi_states_reference(targets, k_bits, codebook), targets,
                        k_bits, codebook)


def test_dispatch_uses_kernel_and_no_ext_falls_back(monkeypatch, capfd):
    targets = _targets(11, 5)
    fast = viterbi_states(targets, 3, "mul1")
    assert cpu_kernels.available()
    monkeypatch.setenv("EXL3_NO_EXT", "1")
    assert not cpu_kernels.available()
    assert cpu_kernels.unavailable_reason() == "EXL3_NO_EXT is set"
    with pytest.raises(RuntimeError, match="EXL3_NO_EXT"):
        cpu_kernels.viterbi_states_cpu(targets, 3, "mul1")
    slow = viterbi_states(targets, 3, "mul1")  # the PyTorch reference
    assert torch.equal(fast, slow)
    assert "unavailable" not in capfd.readouterr().err  # asked for: no warning


def test_kernel_rejects_bad_input():
    with pytest.raises(ValueError, match="shape"):
        cpu_kernels.viterbi_states_cpu(torch.zeros(2, 255), 4)
    with pytest.raises(ValueError, match="bits per weight"):
        viterbi_states(torch.zeros(2, 256), 4.25)
    with pytest.raises(ValueError, match="mul1"):
        viterbi_states(torch.zeros(2, 256), 2.5, "mcg")
    assert viterbi_states(torch.zeros(0, 256), 4).shape == (0, 256)


# ---- CUDA (run with -m cuda on a GPU machine) --------------------------------------


def _cuda_kernel() -> None:
    assert torch.cuda.is_available(), "no GPU"
    assert cuda_viterbi.available(), cuda_viterbi.unavailable_reason()


@pytest.mark.cuda
@pytest.mark.parametrize(("codebook", "k_bits"), CASES)
def test_cuda_kernel_matches_reference(codebook: str, k_bits: float) -> None:
    _cuda_kernel()
    seed = torch.randint(0, 2**31 - 1, ()).item()
    targets = _targets(seed, 3, scale=1.0 + 0.25 * (k_bits % 2))
    reference = viterbi_states_reference(targets, k_bits, codebook)
    states = cuda_viterbi.viterbi_states_cuda(targets.cuda(), k_bits, codebook)
    assert states.is_cuda
    _assert_same_search(states, reference, targets, k_bits, codebook)


@pytest.mark.cuda
@pytest.mark.parametrize("k_bits", [2, 4, 6])
def test_cuda_kernel_many_tiles_match_cpu_kernel(k_bits: float) -> None:
    # More tiles than SMs: every block loops over several tiles, reusing its scratch.
    _cuda_kernel()
    targets = _targets(100 + k_bits, 2 * torch.cuda.get_device_properties(0)
                       .multi_processor_count + 7)
    states = cuda_viterbi.viterbi_states_cuda(targets.cuda(), k_bits, "mul1")
    expected = cpu_kernels.viterbi_states_cpu(targets, k_bits, "mul1")
    _assert_same_search(states, expected, targets, k_bits, "mul1")


@pytest.mark.cuda
def test_cuda_dispatch_and_torch_gpu_fallback(monkeypatch):
    _cuda_kernel()
    targets = _targets(21, 6)
    reference = viterbi_states_reference(targets, 4, "mul1")
    on_gpu = viterbi_states(targets.cuda(), 4, "mul1")
    assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), reference)
    monkeypatch.setenv("EXL3_NO_EXT", "1")
    assert not cuda_viterbi.available()
    torch_gpu = viterbi_states(targets.cuda(), 4, "mul1")  # the reference, on the GPU
    assert torch_gpu.is_cuda
    _assert_same_search(torch_gpu, reference, targets, 4, "mul1")
