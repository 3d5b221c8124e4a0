"""The first LoRA product of the fused decode layer, ``layer_kernels.lora_low`` (x @ A^T
by csrc/ops/cuda/lora_low.cu for up to 64 rows; the engine sends it up to 4
rows, the tests all 64), against torch's float32 product (``-m
cuda``), and its fallbacks.

K spans one slice (64) to the widest split (28,672 columns, a 70B MLP) and values not a
multiple of 256; ranks below a warp count, over it and at the limit; the kernel's ticket
must be left at 0 (the next launch relies on it) and the result must be the same when
the call is replayed inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from exl3cli.ops import cuda_kernels, layer_kernels

cuda = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _kernel_for_every_row(monkeypatch):
    monkeypatch.setattr(layer_kernels, "_LORA_KERNEL_ROWS", 64)


def _inputs(rows: int, rank: int, k: int, dtype: torch.dtype, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(device, dtype)
    a = (torch.randn(rank, k, generator=gen) / k**0.5).to(device, dtype)
    return x, a


def _want(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return (x.float() @ a.float().t()).to(a.dtype).float()


def test_cpu_equals_matmul():
    x, a = _inputs(3, 16, 200, torch.float32, "cpu")
    torch.testing.assert_close(layer_kernels.lora_low(x, a), x @ a.t())
    # x in another dtype is taken in a's
    assert layer_kernels.lora_low(x.double(), a).dtype == torch.float32


def _require_kernels() -> None:
    if not torch.cuda.is_available() or not cuda_kernels.available():
        pytest.fail("the cuda tests need a GPU and the built kernels")


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,rank,k", [(1, 16, 4096), (1, 16, 14336), (5, 3, 64),
                                         (16, 40, 4104), (64, 16, 14336), (64, 128, 28672),
                                         (33, 9, 1000)])
def test_kernel_matches_float32_product(dtype, rows, rank, k):
    _require_kernels()
    x, a = _inputs(rows, rank, k, dtype, "cuda", seed=rows * 1000 + rank)
    layer_kernels.lora_workspace(x.device)
    ticket = layer_kernels._lora_workspaces[x.device][1]
    got = layer_kernels.lora_low(x, a)
    want = _want(x, a)
    assert got.shape == (rows, rank) and got.dtype == dtype
    assert not got.isnan().any()
    tol = (2e-2 if dtype == torch.bfloat16 else 4e-3) * (want.abs().max().item() + 1e-6)
    assert (got.float() - want).abs().max().item() <= tol
    assert ticket.item() == 0
    # Twice in a row (the ticket reset) and a row-strided view of a wider x.
    wide = torch.zeros(rows, k + 8, dtype=dtype, device="cuda")
    wide[:, :k] = x
    again = layer_kernels.lora_low(wide[:, :k], a)
    assert torch.equal(again, got)


@cuda
def test_kernel_inside_a_cuda_graph():
    _require_kernels()
    x, a = _inputs(4, 16, 4096, torch.float16, "cuda", seed=7)
    layer_kernels.lora_workspace(x.device)
    eager = layer_kernels.lora_low(x, a)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer_kernels.lora_low(x, a)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer_kernels.lora_low(x, a)
    x.copy_(_inputs(4, 16, 4096, torch.float16, "cuda", seed=8)[0])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, layer_kernels.lora_low(x, a))
    assert not torch.equal(captured, eager)


@cuda
def test_shapes_the_kernel_does_not_take_fall_back():
    _require_kernels()
    layer_kernels.lora_workspace(torch.device("cuda"))
    # Too many rows, too high a rank, K not whole 16-byte loads, K past the workspace's
    # slices (> 32,768), float32.
    for rows, rank, k in [(65, 16, 512), (2, 129, 512), (2, 16, 100), (2, 16, 32776),
                          (3, 16, 512)]:
        if rows == 3:  # float32 is torch's
            x, a = _inputs(rows, rank, k, torch.float32, "cuda")
            torch.testing.assert_close(layer_kernels.lora_low(x, a), x @ a.t())
            continue
        x, a = _inputs(rows, rank, k, torch.float16, "cuda", seed=rows)
        got = layer_kernels.lora_low(x, a)
        torch.testing.assert_close(got, x @ a.t())
