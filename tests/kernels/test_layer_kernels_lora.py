"""The LoRA inputs of the fused decode-layer kernels (exl3cli.ops.layer_kernels: a
``LowRank`` update in ``hadamard_out`` and ``glu_hadamard``, the ``normed`` rows of
``norm_hadamard``, the ``product`` of ``glu_hadamard``) on CUDA against their PyTorch
twins (``-m cuda``).

Rows mix three adapters' rank columns (one adapter no row uses) and rows without an
adapter; outputs the caller owns are poisoned with NaN first and are views into wider
buffers, so a column written outside its slice or forgotten shows. Rows without an
adapter must come out bit for bit as without the update.
"""

from __future__ import annotations

import pytest
import torch

from exl3cli.ops import layer_kernels
from exl3cli.ops.layer_kernels import LowRank
from tests.fixtures.qkv_out import qkv_out_case, run_qkv_out

pytestmark = pytest.mark.cuda
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
COLUMNS = [1] * 4 + [2] * 8 + [3] * 4  # the adapter slot of each rank column
# Over 32 rank columns and none a multiple of 8: the kernel's second chunk of columns
# and a last group past the rank.
WIDE_COLUMNS = [2] * 13 + [1] * 20 + [3] * 12


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rel(dtype: torch.dtype) -> float:
    return 1e-2 if dtype == torch.bfloat16 else 2e-3


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    got, want = got.float().cpu(), want.float().cpu()
    assert not got.isnan().any()
    scale = want.abs().max().item() + 1e-6
    assert (got - want).abs().max().item() <= rel * scale


def _slots(rows: int) -> torch.Tensor:
    return torch.tensor([(1, 0, 2)[r % 3] for r in range(rows)], dtype=torch.long)


def _lora(rows: int, cols: int, dtype: torch.dtype, gen: torch.Generator,
          columns: list[int] = COLUMNS) -> LowRank:
    low = torch.randn(rows, len(columns), generator=gen).to(dtype)
    bt = (torch.randn(len(columns), cols, generator=gen) * 0.5).to(dtype)
    return LowRank(low, bt, torch.tensor(columns), _slots(rows))


def _on(lora: LowRank, device: str) -> LowRank:
    return LowRank(*(t.to(device) for t in lora))


def _bare_rows(rows: int) -> torch.Tensor:
    return _slots(rows) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("rows", [1, 9, 64])
def test_hadamard_out_adds_the_update_before_rotary(dtype, head_dim, rows):
    gen = _gen(head_dim + rows)
    case = qkv_out_case(rows, head_dim, dtype, gen)
    lora = _lora(rows, sum(case.widths), dtype, gen)

    def run(device: str, update: LowRank | None) -> torch.Tensor:
        return run_qkv_out(case, device, dtype, None if update is None else _on(update, device))

    want, got = run("cpu", lora), run("cuda", lora)
    assert got[:, -16:].isnan().all()  # outside every slice: untouched
    _close(got[:, :-16], want[:, :-16], _rel(dtype))
    plain = run("cuda", None)
    bare = _bare_rows(rows).cuda()
    assert torch.equal(got[bare, :-16], plain[bare, :-16])
    if (~bare).any():  # the update is no rounding detail
        change = (got[~bare, :-16].float() - plain[~bare, :-16].float()).abs().max().item()
        assert change > 0.1 * want[:, :-16].float().abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [2, 33])
@pytest.mark.parametrize("cols, columns", [(320, COLUMNS), (318, WIDE_COLUMNS)])
def test_hadamard_out_adds_the_update_before_the_residual(dtype, rows, cols, columns):
    # 318 columns: bt rows not 4-aligned (the kernel's scalar loads), a partial last group.
    gen = _gen(rows + cols)
    width = 384
    partial = torch.randn(5, rows, width, generator=gen)
    post = torch.randn(width, generator=gen) * 0.1
    residual = torch.randn(rows, cols, generator=gen).to(dtype)
    lora = _lora(rows, cols, dtype, gen, columns)

    def run(device: str) -> torch.Tensor:
        out = torch.full((rows, cols + 8), float("nan"), dtype=dtype, device=device)
        layer_kernels.hadamard_out([partial.to(device)], [post.to(device)], [None],
                                   [out[:, :cols]], [0], residual=residual.to(device),
                                   lora=_on(lora, device))
        return out

    got = run("cuda")
    assert got[:, cols:].isnan().all()
    _close(got[:, :cols], run("cpu")[:, :cols], _rel(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows", [1, 33])
@pytest.mark.parametrize("inter, columns", [(320, COLUMNS), (318, WIDE_COLUMNS)])
def test_glu_hadamard_adds_the_updates_before_the_activation(dtype, act, rows, inter, columns):
    gen = _gen(rows + inter)
    width = 384
    gate, up = (torch.randn(6, rows, width, generator=gen) for _ in range(2))
    post_g, post_u, pre = (torch.randn(width, generator=gen) * 0.3 for _ in range(3))
    bias_g = torch.randn(inter, generator=gen)
    args = (post_g, post_u, bias_g, None)
    lora = _lora(rows, 2 * inter, dtype, gen, columns)

    def run(device: str, update: LowRank | None) -> tuple[torch.Tensor, torch.Tensor]:
        product = torch.full((rows, inter + 8), float("nan"), dtype=dtype, device=device)
        out = layer_kernels.glu_hadamard(
            gate.to(device), up.to(device), *(None if a is None else a.to(device) for a in args),
            inter, act, pre.to(device), dtype,
            lora=None if update is None else _on(update, device), product=product[:, :inter])
        return out, product

    (want, want_product), (got, got_product) = run("cpu", lora), run("cuda", lora)
    assert got_product[:, inter:].isnan().all()
    _close(got_product[:, :inter], want_product[:, :inter], 2 * _rel(dtype))
    _close(got, want, 2e-2 if dtype == torch.bfloat16 else 3e-3)
    plain, plain_product = run("cuda", None)
    bare = _bare_rows(rows).cuda()
    assert torch.equal(got[bare], plain[bare])
    assert torch.equal(got_product[bare, :inter], plain_product[bare, :inter])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("norm", ["none", "rms", "unit_offset"])
def test_norm_hadamard_writes_the_normed_rows(dtype, rows, norm):
    gen = _gen(rows + 5)
    cols, width = 320, 384
    x = (torch.randn(rows, cols, generator=gen) * 3).to(dtype)
    weight = None if norm == "none" else torch.rand(cols, generator=gen) + 0.5
    pres = [torch.randn(width, generator=gen) for _ in range(2)]

    def run(device: str, keep: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        normed = torch.full((rows, cols + 8), float("nan"), dtype=dtype, device=device)
        outs = layer_kernels.norm_hadamard(
            x.to(device), None if weight is None else weight.to(device), 1e-5,
            norm == "unit_offset", [p.to(device) for p in pres], width,
            normed=normed[:, :cols] if keep else None)
        return outs, normed

    (want, want_normed), (got, got_normed) = run("cpu", True), run("cuda", True)
    assert got_normed[:, cols:].isnan().all()
    _close(got_normed[:, :cols], want_normed[:, :cols], _rel(dtype))
    if norm == "none":
        assert torch.equal(got_normed[:, :cols].cpu(), x)
    plain, _ = run("cuda", False)
    for g, w, p in zip(got, want, plain, strict=True):
        _close(g, w, 1e-2 if dtype == torch.bfloat16 else 2e-3)
        assert torch.equal(g, p)  # writing the normed rows changes nothing else
