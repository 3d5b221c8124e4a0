"""The first LoRA product inside the fused GEMM's launch (``layer_kernels.gemm_parts_low``,
csrc/ops/cuda/gemm_lora.cuh): extra blocks of the GEMM grid make ``low = x @ A^T``.

CPU: the function is ``gemm_parts`` plus ``lora_low``; inputs that do not fit the
projection are refused with a ValueError before any kernel is called (a fake extension
that fails when touched proves it); the launch is taken only when ``low_in_gemm`` says so.
CUDA (``-m cuda``): the GEMM's partial sums are bit-equal to the bare launch's, ``low``
matches the float32 product; outputs start as NaN and ``low`` sits between NaN guards, so
a value forgotten or written outside shows; 1 to 64 rows (all three row-group kernels),
ranks from 1 to 128, K not a multiple of 256, a row-strided x, every codebook; replayed
from a CUDA graph; the shapes the kernel does not take are refused by the binding and
fall back in Python.
"""

from __future__ import annotations

import pytest
import torch

from exl3cli.ops import cuda_kernels, layer_kernels

cuda = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _product_in_gemm(monkeypatch):
    """The in-GEMM product is the default (EXL3_LORA_GEMM=0 turns it off); these tests
    are about it, so they pin it on whatever the environment says."""
    monkeypatch.setattr(layer_kernels, "_LORA_IN_GEMM", True)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _gemm_inputs(rows: int, k2: int, gen: torch.Generator, kb: int = 16,
                 nbs: tuple[int, ...] = (16, 8, 24)):
    trellises = [torch.randint(-32768, 32768, (kb, nb, 8 * k2), dtype=torch.int16,
                               generator=gen) for nb in nbs]
    xhs = [torch.randn(rows, 16 * kb, generator=gen).half() for _ in nbs]
    return xhs, trellises


def _low_inputs(rows: int, rank: int, k: int, dtype: torch.dtype, gen: torch.Generator):
    x = torch.randn(rows, k, generator=gen).to(dtype)
    a = (torch.randn(rank, k, generator=gen) / k**0.5).to(dtype)
    return x, a


class _NoKernel:
    """An extension whose every kernel fails the test when called."""

    def __getattr__(self, name: str):
        def called(*args, **kwargs):
            raise AssertionError(f"kernel {name} was called")
        return called


class _Recorder:
    """An extension that records which kernels were called (and launches nothing)."""

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def called(*args, **kwargs):
            self.calls.append((name, args))
            return True
        return called


def test_cpu_is_the_two_products():
    gen = _gen(1)
    xhs, trellises = _gemm_inputs(3, 8, gen)
    x, a = _low_inputs(3, 16, 200, torch.float32, gen)
    partials, low = layer_kernels.gemm_parts_low(xhs, trellises, 8, "mul1", 1, x, a)
    want = layer_kernels.gemm_parts(xhs, trellises, 8, "mul1", 1)
    assert all(torch.equal(p, w) for p, w in zip(partials, want, strict=True))
    torch.testing.assert_close(low, x @ a.t())
    # x in another dtype is taken in A's (as lora_low does)
    assert layer_kernels.gemm_parts_low(xhs, trellises, 8, "mul1", 1, x.double(), a)[1].dtype \
        == torch.float32


@pytest.mark.parametrize("case, message", [
    ("rows", "x has 2 rows, the projection's input 3"),
    ("k", r"A is \(16, 199\) \(rank, K\), x has K = 200"),
    ("rank0", r"A is \(0, 200\)"),
    ("flat", "must be 2-D"),
])
def test_bad_products_are_refused_before_any_kernel(monkeypatch, case, message):
    monkeypatch.setattr(layer_kernels, "_ext", lambda *tensors: _NoKernel())
    monkeypatch.setattr(layer_kernels, "low_in_gemm", lambda x, a: True)
    gen = _gen(2)
    xhs, trellises = _gemm_inputs(3, 8, gen)
    x, a = _low_inputs(3, 16, 200, torch.float16, gen)
    if case == "rows":
        x = x[:2]
    elif case == "k":
        a = a[:, :199]
    elif case == "rank0":
        a = a[:0]
    else:
        a = a[0]
    with pytest.raises(ValueError, match=message):
        layer_kernels.gemm_parts_low(xhs, trellises, 8, "mul1", 4, x, a)


def test_the_gemm_launch_is_taken_only_when_low_in_gemm_says(monkeypatch):
    ext = _Recorder()
    monkeypatch.setattr(layer_kernels, "_ext", lambda *tensors: ext)
    gen = _gen(3)
    xhs, trellises = _gemm_inputs(5, 8, gen)
    x, a = _low_inputs(5, 12, 64, torch.float16, gen)
    monkeypatch.setattr(layer_kernels, "low_in_gemm", lambda x, a: True)
    partials, low = layer_kernels.gemm_parts_low(xhs, trellises, 8, "mul1", 4, x, a)
    assert [name for name, _ in ext.calls] == ["gemm_parts_low"]
    args = ext.calls[0][1]
    assert [tuple(p.shape) for p in args[4]] == [(4, 5, 256), (4, 5, 128), (4, 5, 384)]
    assert args[4] == partials and args[5] is x and args[6] is a and args[7] is low
    assert low.shape == (5, 12) and low.dtype == torch.float16
    ext.calls.clear()
    monkeypatch.setattr(layer_kernels, "low_in_gemm", lambda x, a: False)
    _, low = layer_kernels.gemm_parts_low(xhs, trellises, 8, "mul1", 4, x, a)
    assert [name for name, _ in ext.calls] == ["gemm_parts"]  # then lora_low: torch on CPU
    torch.testing.assert_close(low, x @ a.t())


def test_low_in_gemm_refuses_cpu_tensors_and_the_knob(monkeypatch):
    x, a = _low_inputs(2, 16, 64, torch.float16, _gen(4))
    assert not layer_kernels.low_in_gemm(x, a)
    monkeypatch.setattr(layer_kernels, "_LORA_IN_GEMM", False)
    assert not layer_kernels.low_in_gemm(x, a)


# ---- on the GPU ---------------------------------------------------------------------------

def _require_kernels() -> None:
    if not torch.cuda.is_available() or not cuda_kernels.available():
        pytest.fail("the cuda tests need a GPU and the built kernels")


def _ext():
    ext = layer_kernels._ext(torch.empty(1, device="cuda"))
    assert ext is not None and hasattr(ext, "gemm_parts_low")
    return ext


def _nan(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def _run_poisoned(xhs, trellises, k2, cb, splits, x, a):
    """ext.gemm_parts_low into NaN outputs; low between NaN guards: (partials, low, guards)."""
    rows, rank = x.shape[0], a.shape[0]
    partials = [_nan(splits, rows, 16 * t.shape[1]) for t in trellises]
    buf = _nan(rows * rank + 40, dtype=a.dtype)
    low = buf[8 : 8 + rows * rank].view(rows, rank)
    _ext().gemm_parts_low(xhs, trellises, k2, cb, partials, x, a, low)
    return partials, low, torch.cat([buf[:8], buf[8 + rows * rank :]])


def _want_low(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return (x.float() @ a.float().t()).to(a.dtype).float()


def _check_low(got: torch.Tensor, x: torch.Tensor, a: torch.Tensor) -> None:
    want = _want_low(x, a)
    assert got.shape == want.shape and got.dtype == a.dtype
    assert not got.isnan().any()
    tol = (2e-2 if a.dtype == torch.bfloat16 else 4e-3) * (want.abs().max().item() + 1e-6)
    assert (got.float() - want).abs().max().item() <= tol


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows, rank, k", [(1, 16, 4096), (1, 48, 4096), (1, 16, 14336),
                                           (3, 3, 64), (4, 1, 896), (5, 2, 1000),
                                           (16, 32, 4096), (16, 16, 14336), (33, 9, 264),
                                           (64, 128, 2048)])
def test_the_product_rides_in_the_gemm_launch(dtype, rows, rank, k):
    _require_kernels()
    gen = _gen(rows * 1000 + rank)
    xhs, trellises = _gemm_inputs(rows, 8, gen)
    xhs, trellises = [t.cuda() for t in xhs], [t.cuda() for t in trellises]
    x, a = (t.cuda() for t in _low_inputs(rows, rank, k, dtype, gen))
    wide = torch.zeros(rows, k + 8, dtype=dtype, device="cuda")
    wide[:, :k] = x
    xs = wide[:, :k]  # a row-strided view (the kernel reads x_stride)
    bare = layer_kernels.gemm_parts(xhs, trellises, 8, "mul1", 4)
    partials, low, guards = _run_poisoned(xhs, trellises, 8, cuda_kernels._codebook_id("mul1", 8),
                                          4, xs, a)
    for got, want in zip(partials, bare, strict=True):
        assert torch.equal(got, want)  # the GEMM blocks are the bare launch's
    _check_low(low, x, a)
    assert guards.isnan().all()
    assert layer_kernels.low_in_gemm(xs, a)
    public, public_low = layer_kernels.gemm_parts_low(xhs, trellises, 8, "mul1", 4, xs, a)
    assert torch.equal(public_low, low)
    assert all(torch.equal(p, w) for p, w in zip(public, bare, strict=True))


@cuda
@pytest.mark.parametrize("k2, codebook", [(4, "mul1"), (5, "mul1"), (6, "mcg"), (10, "3inst")])
@pytest.mark.parametrize("rows", [1, 16, 40])
def test_every_codebook_and_row_group_carries_the_product(k2, codebook, rows):
    _require_kernels()
    cb = cuda_kernels._codebook_id(codebook, k2)
    gen = _gen(10 * k2 + rows)
    xhs, trellises = _gemm_inputs(rows, k2, gen, kb=32, nbs=(32, 8))
    xhs, trellises = [t.cuda() for t in xhs], [t.cuda() for t in trellises]
    x, a = (t.cuda() for t in _low_inputs(rows, 24, 1536, torch.float16, gen))
    for splits in (1, 8):
        bare = layer_kernels.gemm_parts(xhs, trellises, k2, codebook, splits)
        partials, low, guards = _run_poisoned(xhs, trellises, k2, cb, splits, x, a)
        assert all(torch.equal(p, w) for p, w in zip(partials, bare, strict=True))
        _check_low(low, x, a)
        assert guards.isnan().all()


@cuda
def test_the_product_inside_a_cuda_graph():
    _require_kernels()
    gen = _gen(7)
    xhs, trellises = _gemm_inputs(4, 8, gen)
    xhs, trellises = [t.cuda() for t in xhs], [t.cuda() for t in trellises]
    x, a = (t.cuda() for t in _low_inputs(4, 16, 4096, torch.float16, gen))
    eager = layer_kernels.gemm_parts_low(xhs, trellises, 8, "mul1", 4, x, a)[1]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer_kernels.gemm_parts_low(xhs, trellises, 8, "mul1", 4, x, a)  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer_kernels.gemm_parts_low(xhs, trellises, 8, "mul1", 4, x, a)[1]
    x.copy_(_low_inputs(4, 16, 4096, torch.float16, _gen(8))[0])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, layer_kernels.gemm_parts_low(xhs, trellises, 8, "mul1", 4,
                                                              x, a)[1])
    assert not torch.equal(captured, eager)
    _check_low(captured, x, a)


@cuda
def test_shapes_the_kernel_does_not_take_are_refused_and_fall_back():
    _require_kernels()
    gen = _gen(9)
    xhs, trellises = _gemm_inputs(3, 8, gen)
    xhs, trellises = [t.cuda() for t in xhs], [t.cuda() for t in trellises]
    x, a = (t.cuda() for t in _low_inputs(3, 16, 512, torch.float16, gen))
    shifted = torch.zeros(3, 520, dtype=torch.float16, device="cuda")
    shifted[:, 1:513] = x
    cases = {
        "float32": (x.float(), a.float()),
        "rank 129": (x, torch.randn(129, 512, device="cuda").half()),
        "K not whole loads": (x[:, :100], a[:, :100]),
        "x not 16-byte aligned": (shifted[:, 1:513], a),
    }
    for name, (xi, ai) in cases.items():
        assert not layer_kernels.low_in_gemm(xi, ai), name
        got = layer_kernels.gemm_parts_low(xhs, trellises, 8, "mul1", 1, xi, ai)[1]
        torch.testing.assert_close(got.float(), (xi.to(ai.dtype) @ ai.t()).float(),
                                   rtol=4e-3, atol=4e-3)


# The binding's own refusals, each case in its own child process: run 30 and the issue-16
# run on the H200 died of a segfault here (the whole pytest process with it, then the
# child of all cases at its second case), so a crash fails its case with its signal.
_REFUSAL_CASES = ("float32", "rank 129", "K not whole loads", "x not 16-byte aligned", "rows")


@cuda
@pytest.mark.parametrize("case", _REFUSAL_CASES)
def test_the_binding_refuses_each_shape_the_kernel_does_not_take(case):
    _require_kernels()
    assert_refused_in_child(_BINDING_REFUSAL, case)


@cuda
def test_a_refusal_by_the_extension_raises_in_python():
    # Whether a TORCH_CHECK of the CUDA extension with one literal (the bare GEMM's
    # partial-shape check) reaches Python as a RuntimeError.
    _require_kernels()
    assert_refused_in_child(_GEMM_REFUSAL)


@cuda
@pytest.mark.parametrize("kind", [0, 2])
def test_both_ways_the_bindings_refuse_reach_python(kind):
    # refusal_probe: 0 TORCH_CHECK with one literal, 2 EXL3_CHECK with formatted pieces
    # (what every binding refusal is now). Kind 1, TORCH_CHECK with formatted pieces,
    # is bench/diag/refusal_paths.py's (it crashed the process on the H200).
    _require_kernels()
    assert_refused_in_child(_PROBE, str(kind))


_GEMM_REFUSAL = """
import torch
from exl3cli.ops import cuda_kernels
ext = cuda_kernels._extension()
trellis = torch.zeros(8, 4, 64, dtype=torch.int16, device="cuda")
xh = torch.zeros(3, 128, dtype=torch.float16, device="cuda")
try:
    ext.gemm_parts([xh], [trellis], 8, 2, [torch.empty(1, 3, 63, device="cuda")])
except RuntimeError as error:
    assert "partial must be" in str(error), str(error)
else:
    raise SystemExit("a partial of the wrong shape was accepted")
"""


_PROBE = """
import sys
from exl3cli.ops import cuda_kernels
ext = cuda_kernels._extension()
try:
    ext.refusal_probe(int(sys.argv[1]))
except RuntimeError as error:
    want = "a literal" if sys.argv[1] == "0" else "rank 129 outside 1..128"
    assert want in str(error), str(error)
else:
    raise SystemExit("refusal_probe did not raise")
"""


_BINDING_REFUSAL = """
import sys
import torch
from exl3cli.ops import cuda_kernels
ext = cuda_kernels._extension()
gen = torch.Generator().manual_seed(9)
trellises = [torch.randint(-32768, 32768, (8, nb, 64), dtype=torch.int16, generator=gen).cuda()
             for nb in (16, 8, 24)]
xhs = [torch.randn(3, 128, generator=gen).half().cuda() for _ in trellises]
x = torch.randn(3, 512, generator=gen).half().cuda()
a = torch.randn(16, 512, generator=gen).half().cuda()
shifted = torch.zeros(3, 520, dtype=torch.float16, device="cuda")
shifted[:, 1:513] = x
cases = {"float32": (x.float(), a.float(), 3, "float16 or bfloat16"),
         "rank 129": (x, torch.randn(129, 512).half().cuda(), 3, "rank 129 outside 1..128"),
         "K not whole loads": (x[:, :100], a[:, :100], 3, "multiples of 8"),
         "x not 16-byte aligned": (shifted[:, 1:513], a, 3, "16-byte aligned"),
         "rows": (x[:2], a, 2, "x has 2 rows, the parts 3")}
xi, ai, rows, message = cases[sys.argv[1]]
low = torch.empty(rows, ai.shape[0], dtype=ai.dtype, device="cuda")
partials = [torch.empty(1, 3, 16 * t.shape[1], device="cuda") for t in trellises]
try:
    ext.gemm_parts_low(xhs, trellises, 8, 2, partials, xi, ai, low)
except RuntimeError as error:
    assert "gemm_parts_low" in str(error) and message in str(error), str(error)
else:
    raise SystemExit("accepted")
"""


def assert_refused_in_child(code: str, *args: str) -> None:
    """Run `code` in a child Python (faulthandler on: a crash prints where); it must exit
    0 (a crash fails with its signal and the child's output)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code, *args],
                          capture_output=True, text=True, timeout=300)
    tail = (done.stdout + done.stderr)[-1500:]
    assert done.returncode == 0, (f"child {args} exited {done.returncode} "
                                  f"(negative: a signal)\n{tail}")
