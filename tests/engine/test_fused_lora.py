"""LoRA adapters on the fused decode layer (engine/layers/fused_layer.py), on CPU with the
PyTorch twins of its kernels: an adapted layer stays fused and gives what the unfused
adapted DecoderLayer gives (AdaptedLinear around each projection), per row with the
row's own adapter, for rows of several adapters and bare rows in one batch; the
adapters change the output far more than the tolerance, so a skipped, misplaced or
misrouted update fails. The CUDA kernels are checked against the same twins in
tests/kernels/test_layer_kernels_lora.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exl3cli.engine.adapters.lora import AdaptedLinear, AdapterBank
from exl3cli.engine.layers.fused_layer import FusedDecodeLayer
from exl3cli.engine.models.loader import load_causal_lm
from tests.fixtures.fused_shapes import write_fused_shapes
from tests.fixtures.random_lora import random_adapter

ROWS = ["a", None, "b", "a"]  # the adapter of each batch row (None: the base model)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_fused_shapes(tmp_path_factory, seed=11)


def _adapted_model(folder: Path, dtype: torch.dtype, *, partial: bool = False):
    """The model with adapter "a" on every projection and "b" (another rank) on q, v and
    down only, or (partial) "a" on k and up only."""
    model = load_causal_lm(folder, device="cpu", dtype=dtype, linear_mode="trellis")
    bank = AdapterBank.of(model)
    if partial:
        bank.load(random_adapter(model, "a", seed=1, suffixes=("k_proj", "up_proj")))
        bank.load(random_adapter(model, "b", seed=2, rank=8, suffixes=("o_proj",)))
    else:
        bank.load(random_adapter(model, "a", seed=1))
        bank.load(random_adapter(model, "b", seed=2, rank=8,
                                 suffixes=("q_proj", "v_proj", "down_proj")))
    return model, bank


def _tolerance(dtype: torch.dtype) -> float:
    # As tests/engine/test_fused_layer.py: the fused layer's rotated input is float16.
    return 2e-3 if dtype == torch.float32 else 1.5e-2


@pytest.mark.parametrize("name", ["tiny", "test-hd128", "test-hd64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adapted_fused_layer_matches_the_adapted_decoder_layer(folders, name, dtype):
    model, bank = _adapted_model(folders[name], dtype)
    batch, steps = len(ROWS), 3
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(batch, steps, model.config.hidden_size, generator=gen) * 0.5).to(dtype)
    step = model._plan_step(batch, steps)
    for layer in model.layers:
        plan = FusedDecodeLayer.of(layer, force=True)
        assert plan is not None and plan.qkv_lora is not None and plan.down_lora is not None
        bank.select_rows(ROWS, [steps] * batch)
        want = layer(x, step)
        bank.select_rows(ROWS, [steps] * batch)
        got = plan.forward(x, step)
        bank.release()
        bare = layer(x, step)  # no selection: every row the base model
        scale = want.float().abs().max().item()
        diff = (got.float() - want.float()).abs().max().item()
        assert diff <= _tolerance(dtype) * scale, diff
        # Rows of an adapter differ from the base by far more than the tolerance; the
        # bare row does not.
        for row, adapter in enumerate(ROWS):
            change = (want[row].float() - bare[row].float()).abs().max().item()
            if adapter is None:
                assert torch.equal(want[row], bare[row])
                off = (got[row].float() - bare[row].float()).abs().max().item()
                assert off <= _tolerance(dtype) * scale, off
            else:
                assert change > 5 * _tolerance(dtype) * scale, (row, change)
        x = want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adapters_on_some_parts_only(folders, dtype):
    # "a" on k and up only (zero B rows for q, v and gate), "b" on o only.
    model, bank = _adapted_model(folders["test-hd64"], dtype, partial=True)
    layer = model.layers[0]
    plan = FusedDecodeLayer.of(layer, force=True)
    assert plan is not None and plan.down_lora is None and plan.o_lora is not None
    batch, steps = len(ROWS), 2
    x = (torch.randn(batch, steps, model.config.hidden_size,
                     generator=torch.Generator().manual_seed(8)) * 0.5).to(dtype)
    step = model._plan_step(batch, steps)
    bank.select_rows(ROWS, [steps] * batch)
    want = layer(x, step)
    got = plan.forward(x, step)
    bank.release()
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= _tolerance(dtype) * scale


def test_whole_model_logits_with_adapters_through_fused_layers(folders):
    model, bank = _adapted_model(folders["test-hd64"], torch.float32)
    ids = torch.tensor([[5, 17, 99, 3, 42]]).expand(len(ROWS), -1).contiguous()
    bank.select_rows(ROWS, [ids.shape[1]] * len(ROWS))
    want = model(ids)  # CPU: the unfused adapted layers
    bank.release()
    bare = model(ids)
    for layer in model.layers:
        layer._fused = FusedDecodeLayer.of(layer, force=True)
        assert isinstance(layer.attention.qkv, AdaptedLinear) and layer._fused is not None
    bank.select_rows(ROWS, [ids.shape[1]] * len(ROWS))
    step = model._plan_step(*ids.shape)
    hidden = model._embed(ids)
    for layer in model.layers:
        hidden = layer._fused.forward(hidden, step)
    got = model._project(model.final_norm(hidden)).float()
    bank.release()
    tolerance = 1e-3 * want.abs().max().item()
    assert (got - want).abs().max().item() <= tolerance
    for row, adapter in enumerate(ROWS):
        change = (want[row] - bare[row]).abs().max().item()
        assert (change > 50 * tolerance) == (adapter is not None), (row, change)
    assert (want[0] - want[3]).abs().max().item() <= tolerance  # same adapter, same ids
    assert (want[0] - want[2]).abs().max().item() > 50 * tolerance  # "a" is not "b"


def test_the_plan_reads_the_adapters_loaded_after_it(folders):
    # The bank's rebuild keeps the wrappers and swaps their tensors: a plan made before
    # must use the new ones (they are read at every forward).
    model, bank = _adapted_model(folders["tiny"], torch.float32)
    layer = model.layers[0]
    plan = FusedDecodeLayer.of(layer, force=True)
    bank.load(random_adapter(model, "c", seed=3, rank=2))
    assert FusedDecodeLayer.of(layer, force=True).qkv_lora is plan.qkv_lora
    x = (torch.randn(1, 2, model.config.hidden_size,
                     generator=torch.Generator().manual_seed(9)) * 0.5)
    step = model._plan_step(1, 2)
    bank.select_rows(["c"], [2])
    want = layer(x, step)
    got = plan.forward(x, step)
    bank.release()
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 2e-3 * scale
    bank.unload("a")
    bank.unload("b")
    bank.unload("c")
    assert FusedDecodeLayer.of(layer, force=True).qkv_lora is None
