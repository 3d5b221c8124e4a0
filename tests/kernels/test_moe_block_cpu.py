"""exl3cli.ops.moe_block on CPU: its reference (the fused norm-route kernel's steps)
against the modules it replaces (RMSNorm, the router's dense linear, Router), its twin
block against MoEMLP's grouped dispatch, and MoEMLP.decode_block's dispatch and
EXL3_MOE_DECODE. The CUDA kernels are tested against these in test_moe_block.py."""

from __future__ import annotations

import pytest
import torch

from exl3cli.convert.synthetic import random_exl3_linear
from exl3cli.engine.layers.linear import DenseLinear, Exl3Linear, FusedLinear
from exl3cli.engine.layers.mlp import GatedMLP
from exl3cli.engine.layers.moe import MoEMLP, Router
from exl3cli.engine.layers.norm import RMSNorm
from exl3cli.ops import moe_block, moe_kernels

HIDDEN = 64


def _norm(dtype: torch.dtype, unit_offset: bool, gen: torch.Generator) -> RMSNorm:
    return RMSNorm((1 + 0.3 * torch.randn(HIDDEN, generator=gen)).to(dtype), 1e-5,
                   unit_offset=unit_offset)


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts, top_k", [(8, 2), (128, 8)])
def test_the_reference_is_the_norm_and_the_router(experts, top_k, dtype, unit_offset):
    gen = torch.Generator().manual_seed(experts + top_k)
    norm = _norm(dtype, unit_offset, gen)
    gate = DenseLinear((torch.randn(experts, HIDDEN, generator=gen) / 8).to(dtype))
    router = Router(gate, top_k)
    x = (2 * torch.randn(7, HIDDEN, generator=gen)).to(dtype)
    normed, logits, weights, chosen = moe_block.reference_norm_route(
        x, norm.weight.float(), norm.eps, unit_offset, gate.weight, top_k, True, 1.0)
    assert normed.dtype == dtype
    if dtype == torch.float32:  # RMSNorm's own CPU kernel sums in another order
        assert (normed - norm(x)).abs().max() < 1e-5
    else:
        assert torch.equal(normed, norm(x))
    want_logits = gate(normed).float()
    ulp = 1e-5 if dtype == torch.float32 else 1.6e-2
    assert (logits - want_logits).abs().max() <= ulp * want_logits.abs().max()
    if dtype == torch.float32:  # no rounded near-ties: the router's very choice
        want_w, want_e = router(normed)
        assert torch.equal(chosen, want_e)
        assert (weights - want_w).abs().max() < 1e-6
    assert torch.allclose(weights.sum(-1), torch.ones(7))
    scaled = moe_block.reference_norm_route(x, norm.weight.float(), norm.eps, unit_offset,
                                            gate.weight, top_k, False, 2.0)[2]
    probs = torch.softmax(logits, dim=-1)
    assert torch.allclose(scaled, 2.0 * probs.gather(1, chosen))


def _exl3_block(experts: int, top_k: int, width: int, gen: torch.Generator) -> MoEMLP:
    def exl3(i: int, o: int) -> Exl3Linear:
        return Exl3Linear(random_exl3_linear(i, o, 4, "mul1", gen), i, o, mode="trellis")

    mlps = [GatedMLP(FusedLinear([exl3(HIDDEN, width), exl3(HIDDEN, width)]),
                     exl3(width, HIDDEN), "silu") for _ in range(experts)]
    gate = DenseLinear(torch.randn(experts, HIDDEN, generator=gen) / 8)
    return MoEMLP(Router(gate, top_k), mlps)


@pytest.mark.parametrize("experts, top_k, width", [(8, 2, 40), (32, 8, 24)])
def test_the_twin_block_is_h_plus_the_experts_of_the_normed_rows(experts, top_k, width):
    gen = torch.Generator().manual_seed(3)
    block = _exl3_block(experts, top_k, width, gen)
    norm = _norm(torch.float32, False, gen)
    tables = moe_kernels.ExpertTables.build(
        [e.gate_up.parts[0] for e in block.experts], [e.gate_up.parts[1] for e in block.experts],
        [e.down for e in block.experts], "silu", HIDDEN)
    assert tables is not None
    h = torch.randn(5, HIDDEN, generator=gen)
    weight = block.router.gate.weight
    assert not moe_block.runs_on_kernels(h, weight, top_k, tables)  # CPU: the twin
    counter = torch.zeros(moe_block.counters_for(tables), dtype=torch.int32)
    out, normed, weights, chosen = moe_block.moe_block(
        h, norm.weight, norm.eps, False, weight, top_k, True, 1.0, tables, counter)
    want = h + block._routed(norm(h), *block.router(norm(h)))
    assert (normed - norm(h)).abs().max() < 1e-5
    assert (out - want).abs().max() < 1e-2 * want.abs().max()  # xh rounded to float16
    plain = moe_block.moe_block(h, norm.weight, norm.eps, False, weight, top_k, True, 1.0,
                                tables, counter, residual=False)[0]
    assert torch.allclose(plain + h, out)


def test_decode_block_on_cpu_is_the_unfused_sum(monkeypatch):
    """No MoE kernels on CPU: decode_block is h + block(norm(h)) under either variant,
    and a bad EXL3_MOE_DECODE is a clear error."""
    gen = torch.Generator().manual_seed(5)
    block = _exl3_block(8, 2, 40, gen)
    norm = _norm(torch.float32, False, gen)
    h = torch.randn(2, 3, HIDDEN, generator=gen)
    want = h + block(norm(h))
    assert torch.equal(block.decode_block(h, norm, norm.weight), want)
    for variant in ("old", "combine"):
        monkeypatch.setenv("EXL3_MOE_DECODE", variant)
        assert torch.equal(block.decode_block(h, norm, norm.weight), want)
    monkeypatch.setenv("EXL3_MOE_DECODE", "")
    assert torch.equal(block.decode_block(h, norm, norm.weight), want)  # empty: default
    monkeypatch.setenv("EXL3_MOE_DECODE", "fast")
    with pytest.raises(ValueError, match="EXL3_MOE_DECODE='fast'"):
        block.decode_block(h, norm, norm.weight)
