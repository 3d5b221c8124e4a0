"""The CPU kernels run on torch's threads and give the same bits on any thread count, and
an offloaded layer's projections run on them (issue 15: a split run's CPU half decoded at
one core's rate, because ATen's inline ``at::parallel_for`` ran serially in a build
without OpenMP; bench/NOTES-cpu-exl3.md "Offload: one thread")."""

from __future__ import annotations

import sys

import pytest
import torch

from exl3cli.convert.synthetic import write_synthetic_model
from exl3cli.engine.layers.cpu_exl3 import CpuExl3Linear
from exl3cli.engine.layers.linear import DenseLinear, Exl3Linear, FusedLinear
from exl3cli.engine.layers.offload import HostLinear, offload_device_rows
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.models.placement import estimate_memory
from exl3cli.engine.spec.architecture import load_family_config
from exl3cli.errors import InvalidOption
from exl3cli.ops import cpu_kernels
from exl3cli.ops.cpu_gemv_mode import set_exl3_gemv_mode
from tests.engine.test_cpu_exl3 import _fresh, _kernel_required, _random_trellis


@pytest.fixture
def threads():
    saved = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(saved)


def test_kernel_loops_use_torch_threads(threads) -> None:
    _kernel_required()
    if sys.platform == "linux" and torch.backends.openmp.is_available():
        assert cpu_kernels.openmp_flags() == ["-fopenmp"]
    threads(2)
    assert cpu_kernels.parallel_threads(64) == 2  # 1 in a build without OpenMP
    threads(1)
    assert cpu_kernels.parallel_threads(64) == 1


@pytest.mark.parametrize("mode", ["exact", "fast"])
@pytest.mark.parametrize("k,codebook", [(4, "mul1"), (6, "mul1"), (3, "3inst"), (2, "mcg")],
                         ids=str)
def test_linear_is_the_same_on_any_thread_count(k: float, codebook: str, mode: str,
                                                threads) -> None:
    """Each output strip is one thread's work, so 1 and 2 threads give the same bits; the
    1-2 row products read the caller's lane buffer from every worker (a buffer named
    thread_local inside the parallel body would be each worker's own, empty one)."""
    _kernel_required()
    g = _fresh()
    kb, nb = 16, 37  # an odd number of strips per thread (the product alone)
    trellis_t = _random_trellis(kb, nb, k, g).transpose(0, 1).contiguous()
    wide = _random_trellis(kb, 40, k, g).transpose(0, 1).contiguous()  # 256 x 640: a linear
    suh = torch.randn(16 * kb, generator=g).sign()
    svh = torch.rand(640, generator=g) * 0.01
    bias = torch.randn(640, generator=g)
    set_exl3_gemv_mode(mode)
    try:
        for rows in (1, 2, 3, 12):  # steps (1-2), tile rows (3-8), strips and at::mm (> 8)
            xh = torch.randn(rows, 16 * kb, generator=g)
            x = torch.randn(rows, 16 * kb - 5, generator=g)
            out = []
            for n in (1, 2, 2):
                threads(n)
                out.append((cpu_kernels.exl3_matmul_cpu(xh, trellis_t, k, codebook),
                            cpu_kernels.exl3_linear_cpu(x, wide, suh, svh, bias, k, codebook,
                                                        637)))
            for other in out[1:]:
                assert all(torch.equal(a, b) for a, b in zip(out[0], other, strict=True)), rows
    finally:
        set_exl3_gemv_mode("exact")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_synthetic_model(tmp_path_factory.mktemp("split"), "tiny", bits=4.0,
                                 head_bits=6, num_layers=3, seed=5)


def test_offloaded_layers_run_on_the_exl3_kernel(folder, monkeypatch) -> None:
    """The projections past the GPU budget are EXL3 trellises behind a HostLinear, every
    part called through the compiled kernel in each forward (no dense matrix, no
    reference decode of whole tiles), and the split logits equal the unsplit ones."""
    _kernel_required()
    config = load_family_config(folder)
    whole = load_causal_lm(folder, device="cpu", dtype=torch.float32, cpu_weights="exl3",
                           num_ctx=128)
    estimate = estimate_memory(folder, config, torch.float32, 128)
    fixed = estimate.other + estimate.cache_per_layer * config.num_layers + estimate.workspace
    monkeypatch.setenv("EXL3_GPU_MEMORY", str(fixed + estimate.layers[0]))
    split = load_causal_lm(folder, device="cpu", dtype=torch.float32, cpu_weights="exl3",
                           num_ctx=128)
    assert split.placement.gpu_layers == 1
    parts: dict[int, str] = {}
    for index, layer in enumerate(split.layers[1:], start=1):
        hosted = [m for m in layer.modules() if isinstance(m, HostLinear)]
        assert len(hosted) == 4
        for host in hosted:
            inner = list(host.inner.parts) if isinstance(host.inner, FusedLinear) else [host.inner]
            for part in inner:
                assert type(part) is CpuExl3Linear and part._kernel, part
                assert part.trellis_t.dtype == torch.int16  # K bits a weight, as stored
                parts[part.trellis_t.data_ptr()] = f"layer {index}"
        assert not any(isinstance(m, (DenseLinear, Exl3Linear)) for m in layer.modules())
        assert all(h.device_rows == 0 for h in hosted)  # a CPU main device: no copies

    called: list[int] = []
    kernel = cpu_kernels.exl3_linear_cpu

    def counted(x, trellis_t, *args):
        called.append(trellis_t.data_ptr())
        assert x.dtype == torch.float32
        return kernel(x, trellis_t, *args)

    def refused(*args, **kwargs):
        raise AssertionError("an offloaded layer decoded its tiles in PyTorch")

    monkeypatch.setattr(cpu_kernels, "exl3_linear_cpu", counted)
    monkeypatch.setattr(cpu_kernels, "exl3_linear_reference", refused)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    for _ in range(2):
        called.clear()
        torch.testing.assert_close(split(ids), whole(ids), rtol=0, atol=0)
        assert sorted(p for p in called if p in parts) == sorted(parts)
        ids = ids[:, :1]  # then one row: the decode GEMV


def test_offload_device_rows_setting(monkeypatch) -> None:
    monkeypatch.delenv("EXL3_OFFLOAD_DEVICE_ROWS", raising=False)
    assert offload_device_rows() == 9  # past the CPU's fused GEMV rows
    monkeypatch.setenv("EXL3_OFFLOAD_DEVICE_ROWS", "0")
    assert offload_device_rows() == 0
    monkeypatch.setenv("EXL3_OFFLOAD_DEVICE_ROWS", "many")
    with pytest.raises(InvalidOption, match="EXL3_OFFLOAD_DEVICE_ROWS"):
        offload_device_rows()


def test_device_path_of_an_offloaded_projection(folder, monkeypatch) -> None:
    """``HostLinear.on_device`` (what a prompt on a CUDA host runs: each part's trellis
    moved to x's device, back in the device kernel's (kb, nb) layout, outputs side by
    side): on CPU tensors exl3_gemm takes its PyTorch reference, which must give the
    CPU kernel's product for fused q|k|v and gate|up and a single projection."""
    _kernel_required()
    config = load_family_config(folder)
    estimate = estimate_memory(folder, config, torch.float32, 128)
    fixed = estimate.other + estimate.cache_per_layer * config.num_layers + estimate.workspace
    monkeypatch.setenv("EXL3_GPU_MEMORY", str(fixed + estimate.layers[0]))
    split = load_causal_lm(folder, device="cpu", dtype=torch.float32, cpu_weights="exl3",
                           num_ctx=128)
    g = _fresh()
    hosted = [m for m in split.layers[2].modules() if isinstance(m, HostLinear)]
    assert len(hosted) == 4
    for host in hosted:
        device_path = HostLinear(host.inner, device_rows=1)
        assert device_path.device_rows == 1
        x = torch.randn(1, 12, host.in_features, generator=g)
        want = host.inner(x)
        got = device_path.on_device(x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
