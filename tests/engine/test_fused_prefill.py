"""A prompt's rows through the fused layer (EXL3_PREFILL=fused: engine/layers/fused_layer.py
with decode + cuBLAS GEMMs): the same as DecoderLayer's ops, on CPU with the PyTorch twins
and on the GPU (`-m cuda`) against the unfused prompt path, with and without a paged
cache; and the layers and devices it must refuse."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exl3cli.engine.kvcache.paged_attention import PagedBatch
from exl3cli.engine.kvcache.paged_cache import PagePool, PageTable
from exl3cli.engine.layers.fused_layer import FusedDecodeLayer
from exl3cli.engine.models.loader import load_causal_lm
from tests.fixtures.fused_shapes import write_fused_shapes


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_fused_shapes(tmp_path_factory, seed=21)


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> float:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all()
    diff = (got.float() - want.float()).abs().max().item()
    assert diff <= rel * want.float().abs().max().item(), diff
    return diff


@pytest.mark.parametrize(("batch", "steps", "mode"), [(1, 80, "fused"), (2, 65, "half")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_rows_match_the_decoder_layer_on_cpu(folders, monkeypatch, batch, steps, mode,
                                                    dtype):
    monkeypatch.setenv("EXL3_PREFILL", mode)  # "half": float16 sums of Ŵ * max|svh|
    model = load_causal_lm(folders["test-hd128"], device="cpu", dtype=dtype,
                           linear_mode="trellis")
    gen = torch.Generator().manual_seed(steps)
    x = (torch.randn(batch, steps, model.config.hidden_size, generator=gen) * 0.5).to(dtype)
    step = model._plan_step(batch, steps)
    for layer in model.layers:
        plan = FusedDecodeLayer.of(layer, force=True)
        want = layer(x, step)
        _close(plan.forward(x, step), want, 2e-3 if dtype == torch.float32 else 3e-2)
        x = want


def test_prompt_rows_refused_without_the_switch_or_kernels(folders, monkeypatch):
    model = load_causal_lm(folders["tiny"], device="cpu", dtype=torch.float32,
                           linear_mode="trellis")
    plan = FusedDecodeLayer.of(model.layers[0], force=True)
    x = torch.zeros(1, 100, model.config.hidden_size)
    monkeypatch.setenv("EXL3_PREFILL", "fused")
    assert plan.accepts(x[:, :64]) and not plan.accepts(x)  # CPU: no decode + cuBLAS
    monkeypatch.setenv("EXL3_PREFILL", "nonsense")
    with pytest.raises(ValueError, match="EXL3_PREFILL"):
        plan.accepts(x)


def _cuda_model(folder: Path, dtype: torch.dtype):
    assert torch.cuda.is_available(), "cuda tests need a GPU"
    model = load_causal_lm(folder, device="cuda", dtype=dtype)
    assert all(layer._fused_plan() is not None for layer in model.layers), "no fused plan"
    return model


def _paged(model, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    config = model.config
    pool = PagePool(32, len(model.layers), config.num_kv_heads, config.head_dim, model.dtype,
                    model.device, page_size=16)
    table = PageTable(pool)
    assert table.admit(ids.tolist(), len(ids))
    outs, start = [], 0
    for size in chunks:
        piece = ids[start : start + size]
        outs.append(model.forward(piece[None].cuda(),
                                  PagedBatch(pool, [table], [piece.tolist()])).float())
        start += size
    return torch.cat(outs, dim=1)[0]


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["tiny", "test-hd128", "test-hd64"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_prompt_gives_the_unfused_logits(folders, monkeypatch, name, dtype):
    model = _cuda_model(folders[name], dtype)
    gen = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (2, 150), generator=gen)
    x = torch.zeros(2, 150, model.config.hidden_size, dtype=dtype, device="cuda")
    plan = model.layers[0]._fused_plan()
    monkeypatch.setenv("EXL3_PREFILL", "old")
    assert not plan.accepts(x)
    want = model(ids.cuda()).float()
    want_paged = _paged(model, ids[0], [100, 37, 1, 12])
    for mode in ("fused", "half", "fp32"):
        monkeypatch.setenv("EXL3_PREFILL", mode)
        assert plan.accepts(x) == (mode != "fp32")
        got = model(ids.cuda()).float()
        _close(got, want, 3e-2)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() > 0.9
        _close(_paged(model, ids[0], [100, 37, 1, 12]), want_paged, 3e-2)
    # The check can fail: the fused prompt path with the o projection's svh zeroed.
    monkeypatch.setenv("EXL3_PREFILL", "fused")
    kept = plan.o
    plan.o = kept._replace(posts=[torch.zeros_like(p) for p in kept.posts])
    try:
        broken = model(ids.cuda()).float()
    finally:
        plan.o = kept
    assert (broken - want).abs().max().item() > 3e-2 * want.abs().max().item()
