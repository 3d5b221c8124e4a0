"""The fused decode layer (engine/layers/fused_layer.py) on CPU, with the PyTorch twins of its
kernels: it must give what DecoderLayer gives, for every rounding dtype, head size and
GQA shape it accepts, and refuse the layers it does not cover. The CUDA kernels are
checked against the same twins in tests/kernels/test_layer_kernels.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exl3cli.engine.layers.fused_layer import FusedDecodeLayer
from exl3cli.engine.models.loader import load_causal_lm
from tests.fixtures.fused_shapes import write_fused_shapes


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_fused_shapes(tmp_path_factory, seed=7)


def _layer_io(model, batch: int, steps: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    x = (torch.randn(batch, steps, hidden, generator=gen) * 0.5).to(model.dtype)
    return x, model._plan_step(batch, steps)


@pytest.mark.parametrize("name", ["tiny", "test-hd128", "test-hd64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_matches_the_decoder_layer(folders, name, dtype):
    model = load_causal_lm(folders[name], device="cpu", dtype=dtype, linear_mode="trellis")
    x, step = _layer_io(model, batch=2, steps=3, seed=1)
    for layer in model.layers:
        plan = FusedDecodeLayer.of(layer, force=True)
        assert plan is not None
        assert plan.fused_rope == (layer.attention.head_dim in (64, 128))
        want = layer(x, step)
        got = plan.forward(x, step)
        assert got.dtype == want.dtype and got.shape == want.shape
        scale = want.float().abs().max().item()
        diff = (got.float() - want.float()).abs().max().item()
        # float32: the rotated input xh is float16 (as the CUDA GEMM reads it), ~5e-4
        # relative; bfloat16: a few values one rounding apart. A wrong scale, head or
        # rotation is off by O(1).
        assert diff <= (2e-3 if dtype == torch.float32 else 3e-2) * scale, diff
        x = want


def test_whole_model_logits_through_fused_layers(folders):
    model = load_causal_lm(folders["test-hd64"], device="cpu", dtype=torch.float32,
                           linear_mode="trellis")
    ids = torch.tensor([[5, 17, 99, 3, 42]])
    want = model(ids)
    for layer in model.layers:
        layer._fused = FusedDecodeLayer.of(layer, force=True)
    # DecoderLayer takes the fused path on CUDA only: call it as the model would there.
    step = model._plan_step(1, ids.shape[1])
    hidden = model._embed(ids)
    for layer in model.layers:
        hidden = layer._fused.forward(hidden, step)
    got = model._project(model.final_norm(hidden)).float()
    assert torch.allclose(got, want, atol=1e-3 * want.abs().max().item())


def test_layers_it_does_not_cover_are_refused(folders):
    dense = load_causal_lm(folders["tiny"], device="cpu", dtype=torch.float32,
                           linear_mode="dense")
    assert FusedDecodeLayer.of(dense.layers[0], force=True) is None
    model = load_causal_lm(folders["tiny"], device="cpu", dtype=torch.float32,
                           linear_mode="trellis")
    layer = model.layers[0]
    assert FusedDecodeLayer.of(layer) is None  # CPU: no kernels to fuse
    layer.attention.position_query_scale = (0.1, 16.0)  # Ministral 3: applied in forward
    assert FusedDecodeLayer.of(layer, force=True) is None
    layer.attention.position_query_scale = None
    assert FusedDecodeLayer.of(layer, force=True) is not None
    layer.mlp.activation = "gelu"  # exact GELU: no fused activation for it
    assert FusedDecodeLayer.of(layer, force=True) is None


def test_a_replaced_projection_makes_the_layer_decide_again(folders):
    # A LoRA adapter wraps a layer's projections: a plan made before must not skip it.
    model = load_causal_lm(folders["tiny"], device="cpu", dtype=torch.float32,
                           linear_mode="trellis")
    layer = model.layers[0]
    layer._fused = plan = FusedDecodeLayer.of(layer, force=True)
    layer._fused_modules = (layer.attention.qkv, layer.attention.o, layer.mlp.gate_up,
                            layer.mlp.down)
    assert layer._fused_plan() is plan
    layer.attention.o = torch.nn.Identity()  # what an adapter wrapper does to the module
    assert layer._fused_plan() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q_k_norms_are_applied_before_the_rotation(folders, dtype):
    """Qwen3's per-head q/k RMSNorm: the fused layer norms after its q/k/v output kernel
    and rotates in PyTorch (the kernel's own rotation would come before the norm)."""
    from exl3cli.engine.layers.norm import RMSNorm

    model = load_causal_lm(folders["test-hd128"], device="cpu", dtype=dtype,
                           linear_mode="trellis")
    x, step = _layer_io(model, batch=2, steps=3, seed=4)
    layer = model.layers[0]
    attention = layer.attention
    gen = torch.Generator().manual_seed(9)
    weight = 1 + 0.5 * torch.randn(attention.num_heads + attention.num_kv_heads,
                                   attention.head_dim, generator=gen)
    attention.qk_norm = RMSNorm(weight.to(dtype), 1e-6)
    plan = FusedDecodeLayer.of(layer, force=True)
    assert plan is not None and not plan.fused_rope
    want = layer(x, step)
    got = plan.forward(x, step)
    scale = want.float().abs().max().item()
    diff = (got.float() - want.float()).abs().max().item()
    assert diff <= (2e-3 if dtype == torch.float32 else 3e-2) * scale, diff
    attention.qk_norm = None  # the norm really changes the output: the test can fail
    assert (layer(x, step).float() - want.float()).abs().max().item() > 10 * diff
