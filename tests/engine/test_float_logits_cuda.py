"""A float16/bfloat16 head on CUDA writes float32 logits (`-m cuda`): cuBLAS's float32
accumulators go out as they are (linear.float_product), not rounded to the half type
first, so a near tie between two logits is decided at float32 resolution (run 60's
Gemma 3 fp16 divergence: a reference gap of 0.0140 against a float16 logit step of
1/64 at that size)."""

from __future__ import annotations

import pytest
import torch

from exl3cli.engine.layers.linear import dense_product, float_product
from exl3cli.engine.models.loader import load_causal_lm
from tests.fixtures.tiny_model import write_tiny_model

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float_product_keeps_the_accumulators_precision(dtype):
    gen = torch.Generator().manual_seed(3)
    x = (4 * torch.randn(5, 640, generator=gen)).to(dtype)
    w = torch.randn(4096, 640, generator=gen).to(dtype)
    want = x.double() @ w.double().t()
    got = float_product(x.cuda(), w.cuda()).cpu()
    rounded = dense_product(x.cuda(), w.cuda(), None).float().cpu()
    assert got.dtype == torch.float32 and got.shape == (5, 4096)
    error, half_error = (got.double() - want).abs(), (rounded.double() - want).abs()
    assert error.max() < half_error.max() / 8  # the half type's rounding is gone
    assert error.max() / want.abs().max() < 1e-5


def test_a_float16_model_returns_logits_off_the_float16_grid(tmp_path):
    folder = write_tiny_model(tmp_path / "m", "llama", vocab_size=400,
                              max_position_embeddings=256)
    model = load_causal_lm(folder, device="cuda", dtype=torch.float16)
    logits = model(torch.randint(3, 400, (1, 12)).cuda()).float()
    assert logits.dtype == torch.float32
    off_grid = (logits.half().float() != logits).float().mean()
    assert off_grid > 0.5  # float16-rounded logits would all sit on the grid
