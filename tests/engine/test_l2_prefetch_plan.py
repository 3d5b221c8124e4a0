"""The decode layer's L2 prefetch plan (ops/layer_kernels.py prefetch_budget, prefetch_plan,
l2_prefetch): the budget read from EXL3_L2_PREFETCH_MB, how it is split between the next
projections, bad values refused by name, and no effect on what a layer computes on the CPU.
The kernel itself is tested on the GPU in tests/kernels/test_layer_kernels.py."""

from __future__ import annotations

import pytest
import torch

from exl3cli.engine.layers.fused_layer import FusedDecodeLayer
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.ops import layer_kernels
from tests.fixtures.fused_shapes import write_fused_shapes

MIB = 1 << 20


@pytest.mark.parametrize("raw, want", [("", 0), ("0", 0), ("24", 24 * MIB), (" 0.5 ", MIB // 2)])
def test_the_budget_comes_from_the_environment(monkeypatch, raw, want):
    monkeypatch.setenv("EXL3_L2_PREFETCH_MB", raw)
    assert layer_kernels.prefetch_budget() == want


@pytest.mark.parametrize("raw", ["lots", "-1", "24MB"])
def test_a_bad_budget_is_refused_by_name(monkeypatch, raw):
    monkeypatch.setenv("EXL3_L2_PREFETCH_MB", raw)
    with pytest.raises(ValueError, match="EXL3_L2_PREFETCH_MB"):
        layer_kernels.prefetch_budget()


def _u8(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.uint8)


def test_the_plan_takes_the_first_whole_then_equal_shares_of_the_rest():
    o, gate, up = _u8(1000), _u8(5000), _u8(5000)
    tensors, counts = layer_kernels.prefetch_plan([o], [gate, up], 3000)
    assert [t is x for t, x in zip(tensors, [o, gate, up], strict=True)] == [True] * 3
    assert counts == [1000, 1000, 1000]
    # A budget smaller than the first: only part of it, nothing of the rest.
    tensors, counts = layer_kernels.prefetch_plan([o], [gate, up], 600)
    assert len(tensors) == 1 and tensors[0] is o and counts == [600]
    # A budget larger than everything: each tensor whole, never past its end.
    _, counts = layer_kernels.prefetch_plan([o], [gate, up], 10 ** 9)
    assert counts == [1000, 5000, 5000]
    assert layer_kernels.prefetch_plan([o], [gate, up], 0) == ([], [])
    assert layer_kernels.prefetch_plan([o], [], 4000) == ([o], [1000])


def test_prefetch_on_the_cpu_is_a_no_op_and_checks_its_counts():
    t = torch.arange(64, dtype=torch.float32)
    layer_kernels.l2_prefetch([t], [256])
    assert torch.equal(t, torch.arange(64, dtype=torch.float32))
    with pytest.raises(ValueError, match="one byte count per tensor"):
        layer_kernels.l2_prefetch([t], [])


def test_a_budget_changes_nothing_a_cpu_layer_computes(tmp_path_factory, monkeypatch):
    folder = write_fused_shapes(tmp_path_factory, seed=3)["tiny"]
    monkeypatch.setenv("EXL3_L2_PREFETCH_MB", "64")
    model = load_causal_lm(folder, device="cpu", dtype=torch.float32, linear_mode="trellis")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 2, model.config.hidden_size, generator=gen) * 0.5
    step = model._plan_step(1, 2)
    layer = model.layers[0]
    plan = FusedDecodeLayer.of(layer, force=True)
    assert plan is not None and plan.prefetch == ([], [])  # CPU: no plan at all
    assert torch.equal(plan.forward(x, step), FusedDecodeLayer.of(layer, force=True).forward(x, step))
