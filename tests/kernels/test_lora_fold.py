"""The first LoRA product folded into the fused decode layer's input kernels
(exl3cli.ops.layer_kernels ``LoraFold``: ``norm_hadamard`` for the normed rows or the
attention output, ``glu_hadamard`` for act(gate) * up), and the output kernels adding
the folded float32 slices (``LowRank.low`` (slices, rows, R)), on CUDA (``-m cuda``)
against the PyTorch twins, plus the CPU checks of the twins themselves.

The folded partials are poisoned with NaN first (every slice must be written); their sum
is checked against the kernel's own input rows (written in the same launch: only the
float32 summation order may differ), and the kernels' other outputs must not change by a
bit with the fold. The output kernels' short path for a part whose rank columns span at
most 16 (``LowRank.ranges``, a fused q|k|v's block-diagonal B^T) must give the long
path's sums to the bit. Widths span one slice, a last block with warps past the width (11
column blocks), 14 slices (an 8B MLP), input columns not a multiple of 4 (scalar loads
of A), ranks 8/16, one over a 16-column chunk (24) and the limit (128), rows 1..16.
"""

from __future__ import annotations

import pytest
import torch

from exl3cli.ops import layer_kernels
from exl3cli.ops.layer_kernels import LoraFold, LowRank, part_ranges
from tests.fixtures.qkv_out import qkv_out_case, run_qkv_out

cuda = pytest.mark.cuda
KERNEL_DTYPES = [torch.float16, torch.bfloat16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _slots(rows: int) -> torch.Tensor:
    return torch.tensor([(1, 0, 2)[r % 3] for r in range(rows)], dtype=torch.long)


def _columns(rank: int) -> torch.Tensor:
    return torch.tensor([1 + (k * 2) // rank for k in range(rank)], dtype=torch.long)


def _a(rank: int, cols: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(rank, cols, generator=gen) / cols**0.5).to(dtype)


def _nan_partial(cols: int, rows: int, rank: int, device: str) -> torch.Tensor:
    slices = -(-cols // layer_kernels.FOLD_SPAN)
    return torch.full((slices, rows, rank), float("nan"), dtype=torch.float32, device=device)


def _check_sum(partial: torch.Tensor, x_in: torch.Tensor, a: torch.Tensor) -> None:
    """partial's slices add up to x_in @ a^T but for float32 summation order."""
    assert not partial.isnan().any()
    x, a = x_in.double().cpu(), a.double().cpu()
    want, bound = x @ a.t(), x.abs() @ a.abs().t()
    got = partial.cpu().double().sum(0)
    assert ((got - want).abs() <= 1e-5 * bound + 1e-7).all()


def _rel(dtype: torch.dtype) -> float:
    return 1e-2 if dtype == torch.bfloat16 else 2e-3


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    got, want = got.float().cpu(), want.float().cpu()
    assert not got.isnan().any()
    assert (got - want).abs().max().item() <= rel * (want.abs().max().item() + 1e-6)


def _require_kernels() -> None:
    from exl3cli.ops import cuda_kernels

    if not torch.cuda.is_available() or not cuda_kernels.available():
        pytest.fail("the cuda tests need a GPU and the built kernels")


@cuda
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("rows", [1, 4, 9, 16])
@pytest.mark.parametrize("cols, width, rank", [(4096, 4096, 16), (320, 384, 8),
                                               (1402, 1408, 24), (5120, 5120, 128)])
@pytest.mark.parametrize("norm", ["none", "rms"])
def test_norm_hadamard_folds_the_first_product(dtype, rows, cols, width, rank, norm):
    _require_kernels()
    gen = _gen(rows * 7 + rank)
    x = (torch.randn(rows, cols, generator=gen) * 2).to(dtype)
    weight = None if norm == "none" else torch.rand(cols, generator=gen) + 0.5
    pres = [torch.randn(width, generator=gen) for _ in range(3)]
    a = _a(rank, cols, dtype, gen)

    def run(device: str, fold: LoraFold | None, normed: torch.Tensor | None):
        return layer_kernels.norm_hadamard(
            x.to(device), None if weight is None else weight.to(device), 1e-5, False,
            [p.to(device) for p in pres], width, normed=normed, fold=fold)

    normed = torch.full((rows, cols), float("nan"), dtype=dtype, device="cuda")
    fold = LoraFold(a.cuda(), _nan_partial(width, rows, rank, "cuda"))
    outs = run("cuda", fold, normed)
    _check_sum(fold.partial, normed, a)
    for got, plain in zip(outs, run("cuda", None, None), strict=True):
        assert torch.equal(got, plain)  # the fold changes no other output
    twin = LoraFold(a, _nan_partial(width, rows, rank, "cpu"))
    run("cpu", twin, None)
    _close(fold.partial.sum(0), twin.partial.sum(0), _rel(dtype))


def _glu_inputs(rows: int, inter: int, width: int, gen: torch.Generator):
    gate, up = (torch.randn(4, rows, width, generator=gen) for _ in range(2))
    post_g, post_u, pre = (torch.randn(width, generator=gen) * 0.3 for _ in range(3))
    return gate, up, post_g, post_u, torch.randn(inter, generator=gen), pre


@cuda
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("inter, width, rank", [(320, 384, 16), (318, 384, 8),
                                                (1400, 1408, 24), (14336, 14336, 16)])
@pytest.mark.parametrize("adapted", [True, False])
def test_glu_hadamard_folds_the_down_product(dtype, rows, inter, width, rank, adapted):
    # adapted: gate/up with their own update (mixed slots) in the same launch.
    _require_kernels()
    gen = _gen(rows + inter + rank)
    gate, up, post_g, post_u, bias_g, pre = _glu_inputs(rows, inter, width, gen)
    a = _a(rank, inter, dtype, gen)
    lora = None
    if adapted:
        low = torch.randn(rows, 16, generator=gen).to(dtype)
        bt = (torch.randn(16, 2 * inter, generator=gen) * 0.5).to(dtype)
        lora = LowRank(low, bt, _columns(16), _slots(rows))

    def run(device: str, fold: LoraFold | None, product: torch.Tensor | None):
        update = None if lora is None else lora.to(device)
        return layer_kernels.glu_hadamard(
            gate.to(device), up.to(device), post_g.to(device), post_u.to(device),
            bias_g.to(device), None, inter, "silu", pre.to(device), dtype, lora=update,
            product=product, fold=fold)

    product = torch.full((rows, inter + 8), float("nan"), dtype=dtype, device="cuda")
    fold = LoraFold(a.cuda(), _nan_partial(width, rows, rank, "cuda"))
    out = run("cuda", fold, product[:, :inter])
    assert product[:, inter:].isnan().all()
    _check_sum(fold.partial, product[:, :inter], a)
    plain_product = torch.empty(rows, inter, dtype=dtype, device="cuda")
    assert torch.equal(out, run("cuda", None, plain_product))
    assert torch.equal(product[:, :inter], plain_product)
    assert torch.equal(out, run("cuda", LoraFold(a.cuda(), fold.partial.clone()), None))
    twin = LoraFold(a, _nan_partial(width, rows, rank, "cpu"))
    run("cpu", twin, None)
    _close(fold.partial.sum(0), twin.partial.sum(0), 2 * _rel(dtype))


def _sequential_low(partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The output kernels' sum of the slices: in slice order from 0, rounded to dtype."""
    total = torch.zeros_like(partial[0])
    for piece in partial:
        total = total + piece
    return total.to(dtype)


@cuda
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("rows", [1, 9, 16])
@pytest.mark.parametrize("rank", [8, 16, 45])
@pytest.mark.parametrize("slices", [1, 4, 14])
def test_output_kernels_add_the_folded_slices(dtype, rows, rank, slices):
    # The same update as from low = the slices' sum rounded to dtype, to the bit; the
    # twin within the usual tolerance. Rank 45: the output kernels' path past 16 columns.
    _require_kernels()
    gen = _gen(rows * 100 + rank + slices)
    width, cols, inter = 384, 320, 320
    partial = torch.randn(slices, rows, rank, generator=gen) * 0.4
    bt = (torch.randn(rank, 2 * inter, generator=gen) * 0.5).to(dtype)
    columns, slots = _columns(rank), _slots(rows)
    splits = torch.randn(3, rows, width, generator=gen)
    post = torch.randn(width, generator=gen) * 0.1
    residual = torch.randn(rows, cols, generator=gen).to(dtype)

    def out(device: str, low: torch.Tensor) -> torch.Tensor:
        lora = LowRank(low.to(device), bt[:, :cols].contiguous().to(device),
                       columns.to(device), slots.to(device))
        y = torch.full((rows, cols + 8), float("nan"), dtype=dtype, device=device)
        layer_kernels.hadamard_out([splits.to(device)], [post.to(device)], [None],
                                   [y[:, :cols]], [0], residual=residual.to(device), lora=lora)
        assert y[:, cols:].isnan().all()  # outside the output's columns: untouched
        return y[:, :cols]

    def glu(device: str, low: torch.Tensor) -> torch.Tensor:
        lora = LowRank(low.to(device), bt.to(device), columns.to(device), slots.to(device))
        return layer_kernels.glu_hadamard(splits.to(device), splits.flip(0).to(device),
                                          post.to(device), None, None, None, inter, "silu",
                                          post.to(device), dtype, lora=lora)

    low = _sequential_low(partial.cuda(), dtype)
    for run in (out, glu):
        got = run("cuda", partial)
        assert torch.equal(got, run("cuda", low))
        _close(got, run("cpu", partial), 2 * _rel(dtype))


def _block_diagonal(widths: list[int], adapters: list[list[int]], dtype: torch.dtype,
                    gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """bt and columns of stacked adapters (slot i + 1: adapters[i]'s rank per part, 0 for
    a part it leaves alone), each part's rows of B^T nonzero only in its own columns."""
    blocks, columns = [], []
    for slot, ranks in enumerate(adapters, start=1):
        start = 0
        for width, rank in zip(widths, ranks, strict=True):
            block = torch.zeros(rank, sum(widths))
            block[:, start : start + width] = torch.randn(rank, width, generator=gen) * 0.5
            blocks.append(block)
            columns += [slot] * rank
            start += width
    return torch.cat(blocks).to(dtype), torch.tensor(columns)


@cuda
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("rows", [1, 6, 16])
@pytest.mark.parametrize("adapters", [[[16, 16, 16]], [[16, 16, 16], [8, 0, 8]], [[4, 16, 0]]])
def test_block_diagonal_updates_take_the_short_path(dtype, rows, adapters):
    # A fused q|k|v (and gate|up) adapter: each part's rank columns are its own 16 or
    # fewer (the short path) or, with a second adapter on q and v, span more (the long
    # path, mixed in one launch). The same sums as without the ranges, to the bit.
    _require_kernels()
    gen = _gen(rows + len(adapters))
    case = qkv_out_case(rows, 128, dtype, gen)
    bt, columns = _block_diagonal(case.widths, adapters, dtype, gen)
    lora = LowRank(torch.randn(rows, bt.shape[0], generator=gen).to(dtype), bt, columns,
                   _slots(rows))
    ranged = lora._replace(ranges=part_ranges(bt, case.widths))
    got = run_qkv_out(case, "cuda", dtype, ranged.to("cuda"))
    assert got[:, -16:].isnan().all()
    assert torch.equal(got, run_qkv_out(case, "cuda", dtype, lora.to("cuda")))
    _close(got[:, :-16], run_qkv_out(case, "cpu", dtype, ranged)[:, :-16], _rel(dtype))
    # gate|up: the first two parts' ranks on [gate | up] of 320 columns each.
    inter, width = 320, 384
    gate, up, post_g, post_u, bias_g, pre = _glu_inputs(rows, inter, width, gen)
    bt, columns = _block_diagonal([inter, inter], [a[:2] for a in adapters], dtype, gen)
    lora = LowRank(torch.randn(rows, bt.shape[0], generator=gen).to(dtype), bt, columns,
                   _slots(rows))
    ranged = lora._replace(ranges=part_ranges(bt, [inter, inter]))

    def glu(device: str, update: LowRank) -> torch.Tensor:
        return layer_kernels.glu_hadamard(
            gate.to(device), up.to(device), post_g.to(device), post_u.to(device),
            bias_g.to(device), None, inter, "silu", pre.to(device), dtype,
            lora=update.to(device))

    got = glu("cuda", ranged)
    assert torch.equal(got, glu("cuda", lora))
    _close(got, glu("cpu", ranged), 2e-2 if dtype == torch.bfloat16 else 3e-3)


@cuda
def test_folded_update_inside_a_cuda_graph():
    _require_kernels()
    rows, cols, width, rank, dtype = 4, 4096, 4096, 16, torch.float16
    gen = _gen(3)
    x = torch.randn(rows, cols, generator=gen).to("cuda", dtype)
    weight = (torch.rand(cols, generator=gen) + 0.5).cuda()
    pres = [torch.randn(width, generator=gen).cuda()]
    a = _a(rank, cols, dtype, gen).cuda()
    fold = LoraFold(a, _nan_partial(width, rows, rank, "cuda"))

    def step() -> None:
        layer_kernels.norm_hadamard(x, weight, 1e-5, False, pres, width, fold=fold)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    x.copy_(torch.randn(rows, cols, generator=gen).to("cuda", dtype))
    fold.partial.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    replayed = fold.partial.clone()
    step()
    assert torch.equal(replayed, fold.partial)  # deterministic, and the new input's


@cuda
def test_bad_folds_are_refused_clearly():
    _require_kernels()
    x = torch.randn(2, 256, device="cuda")
    pres = [torch.randn(256, device="cuda")]
    a = torch.randn(16, 256, device="cuda")
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        layer_kernels.norm_hadamard(x, None, 0.0, False, pres, 256,
                                    fold=LoraFold(a, torch.empty(1, 2, 16, device="cuda")))
    with pytest.raises(RuntimeError, match="lora_partial"):
        layer_kernels.norm_hadamard(x.half(), None, 0.0, False, pres, 256,
                                    fold=LoraFold(a.half(), torch.empty(2, 2, 16, device="cuda")))
    gen = _gen(2)
    case = qkv_out_case(2, 128, torch.float16, gen)
    bt, columns = _block_diagonal(case.widths, [[16, 16, 16]], torch.float16, gen)
    lora = LowRank(torch.randn(2, 48).half(), bt, columns, _slots(2)).to("cuda")
    for ranges in [(0, 16, 16, 16), (0, 16, 16, 16, 40, 16), (0, 16, 16, 0, 5, 0)]:
        with pytest.raises(RuntimeError, match="lora_ranges"):
            run_qkv_out(case, "cuda", torch.float16, lora._replace(ranges=ranges))
    with pytest.raises(RuntimeError, match="lora_a"):
        layer_kernels.norm_hadamard(x.half(), None, 0.0, False, pres, 256,
                                    fold=LoraFold(a[:, :128].half().contiguous(),
                                                  torch.empty(1, 2, 16, device="cuda")))


def test_twins_fill_one_slice_and_zero_the_rest():
    gen = _gen(1)
    x = torch.randn(3, 200, generator=gen)
    a = _a(8, 200, torch.float32, gen)
    fold = LoraFold(a, _nan_partial(2048, 3, 8, "cpu"))
    layer_kernels.norm_hadamard(x, None, 0.0, False, [torch.ones(256)], 256, fold=fold)
    assert fold.partial.shape == (2, 3, 8) and torch.equal(fold.partial[1], torch.zeros(3, 8))
    torch.testing.assert_close(fold.partial[0], x @ a.t())
    lora = LowRank(fold.partial, torch.randn(8, 5, generator=gen), _columns(8), _slots(3))
    want = layer_kernels.low_rank_delta(lora._replace(low=x @ a.t()))
    torch.testing.assert_close(layer_kernels.low_rank_delta(lora), want)


def test_part_ranges_span_each_parts_nonzero_rank_columns():
    bt = torch.zeros(24, 30)
    bt[3, 0] = bt[10, 5] = 1.0  # part 0 (10 columns): rank columns 3..10
    assert part_ranges(bt, [10, 20]) == (3, 8, 0, 0)  # part 1: none
    bt, _ = _block_diagonal([64, 32, 32], [[16, 16, 16], [8, 0, 8]], torch.float32, _gen(0))
    assert part_ranges(bt, [64, 32, 32]) == (0, 56, 16, 16, 32, 32)


def test_no_fold_on_cpu_or_when_switched_off(monkeypatch):
    x, a = torch.randn(2, 64).half(), torch.randn(16, 64).half()
    assert layer_kernels.lora_fold(x, a, 128) is None  # CPU: no kernels
    monkeypatch.setattr(layer_kernels, "_fold_kernels", lambda _x: True)
    fold = layer_kernels.lora_fold(x, a, 2100)
    assert fold is not None and fold.partial.shape == (3, 2, 16)
    assert fold.partial.dtype == torch.float32
    assert layer_kernels.lora_fold(x, a.float(), 128) is None  # A in another dtype
    assert layer_kernels.lora_fold(x, torch.randn(129, 64).half(), 128) is None
    monkeypatch.setenv("EXL3_LORA_FOLD", "0")
    assert layer_kernels.lora_fold(x, a, 128) is None
