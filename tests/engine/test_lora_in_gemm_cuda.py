"""The generator end to end with LoRA's first product inside the GEMM launch
(``EXL3_LORA_GEMM=1``: ``layer_kernels.gemm_parts_low``, csrc/ops/cuda/gemm_lora.cuh) on
the GPU (`-m cuda`), float16 (the in-GEMM product takes float16/bfloat16 only): jobs of
two adapters and bare jobs through captured decode graphs, against the unfused adapted
model's logits and the same steps run eagerly; the launches are counted, so a silent
fall-back to the separate product fails."""

from __future__ import annotations

import pytest
import torch

from exl3cli.engine.text.tokenizer import Tokenizer
from exl3cli.ops import layer_kernels
from tests.engine.test_fused_lora_cuda import (
    ROWS,
    _adapted,
    _CountingExt,
    _first_decode_logits,
    _fused_with_adapters,
    _jobs,
    _joining_tokens,
    folder,  # noqa: F401 (the fixture)
)

pytestmark = pytest.mark.cuda


@pytest.fixture
def in_gemm(monkeypatch) -> _CountingExt:
    """EXL3_LORA_GEMM=1 for this test; the extension, counting gemm_parts_low calls."""
    monkeypatch.setattr(layer_kernels, "_LORA_IN_GEMM", True)
    real = layer_kernels._ext
    counting = _CountingExt(real(torch.empty(1, device="cuda")))
    monkeypatch.setattr(layer_kernels, "_ext", lambda *t: counting if real(*t) else None)
    return counting


def test_graph_step_with_the_product_in_the_gemm_matches_the_unfused_step(
        folder, in_gemm, monkeypatch):  # noqa: F811
    model, _ = _adapted(folder, torch.float16)
    tokenizer = Tokenizer.from_folder(folder)
    got, generator = _first_decode_logits(model, tokenizer, _jobs(ROWS), "graph")
    assert generator.decode.mode == "graph" and generator.decode.graph_count >= 1
    assert _fused_with_adapters(model)
    assert in_gemm.low_launches >= 4 * len(model.layers)  # captured with the in-GEMM product
    bare, _ = _first_decode_logits(model, tokenizer, _jobs([None] * len(ROWS)), "graph")
    monkeypatch.setenv("EXL3_FUSED_LAYER", "0")
    for layer in model.layers:
        layer._fused = False  # decided again: unfused (AdaptedLinear's two matmuls)
    want, _ = _first_decode_logits(model, tokenizer, _jobs(ROWS), "off")
    for row, adapter in enumerate(ROWS):
        error = ((got[row] - want[row]).norm() / want[row].norm()).item()
        change = ((bare[row] - want[row]).norm() / want[row].norm()).item()
        assert error < 2e-2, (row, error)
        assert (change > 0.1) == (adapter is not None), (row, change)


def test_graph_tokens_with_the_product_in_the_gemm_equal_the_eager_steps(folder, in_gemm):  # noqa: F811
    # Jobs join between replays; each decode step's graph and the same fixed-shape step
    # run eagerly launch the same kernels, so the tokens are equal even in float16; bare
    # jobs get the base model's tokens to the bit (the GEMM blocks are the bare launch's).
    model, _ = _adapted(folder, torch.float16)
    tokenizer = Tokenizer.from_folder(folder)
    names = ["a", None, "b", "a", "b", None]
    got, generator = _joining_tokens(model, tokenizer, "graph", names)
    assert generator.decode.graph_count >= 1 and _fused_with_adapters(model)
    launches = in_gemm.low_launches
    assert launches >= 4 * len(model.layers)
    want, _ = _joining_tokens(model, tokenizer, "static", names)
    assert in_gemm.low_launches > launches  # the eager steps take the in-GEMM product too
    assert got == want
    bare, _ = _joining_tokens(model, tokenizer, "graph", [None] * len(names))
    for mine, base, adapter in zip(got, bare, names, strict=True):
        assert (mine != base) == (adapter is not None)
