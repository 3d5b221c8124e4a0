"""exl3cli.ops.layer_kernels: the fused decode-layer CUDA kernels against their PyTorch
twins (``-m cuda``), and the fused layer against DecoderLayer on the GPU.

Each case draws fresh inputs, runs the kernel on CUDA and the twin on CPU copies;
outputs the caller owns are poisoned with NaN first, so a column the kernel forgot to
write (or wrote outside its slice) shows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exl3cli.convert.synthetic import SHAPES, write_synthetic_model
from exl3cli.engine.layers.fused_layer import FusedDecodeLayer
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.ops import cuda_kernels as kernels
from exl3cli.ops import layer_kernels
from tests.fixtures.qkv_out import qkv_out_case, run_qkv_out

pytestmark = pytest.mark.cuda
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    got, want = got.float().cpu(), want.float().cpu()
    assert not got.isnan().any()
    scale = want.abs().max().item() + 1e-6
    assert (got - want).abs().max().item() <= rel * scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 33, 64])
@pytest.mark.parametrize("norm", ["none", "rms", "unit_offset"])
def test_norm_hadamard(dtype, rows, norm):
    gen = _gen(rows)
    cols, width = 320, 384  # padded: the last block is half zeros
    x = (torch.randn(rows, cols, generator=gen) * 3).to(dtype)
    weight = None if norm == "none" else torch.rand(cols, generator=gen) + 0.5
    pres = [torch.randn(width, generator=gen) for _ in range(3)]
    want = layer_kernels.norm_hadamard(x, weight, 1e-5, norm == "unit_offset", pres, width)
    got = layer_kernels.norm_hadamard(
        x.cuda(), None if weight is None else weight.cuda(), 1e-5, norm == "unit_offset",
        [p.cuda() for p in pres], width)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float16 and g.shape == (rows, width)
        _close(g, w, 1e-2 if dtype == torch.bfloat16 else 2e-3)


@pytest.mark.parametrize("rows", [1, 5, 16, 40])
@pytest.mark.parametrize("k, codebook", [(2, "mul1"), (4, "mul1"), (3, "mcg"), (5, "3inst"),
                                         (2.5, "mul1")])
def test_gemm_parts_sum_to_the_reference(rows, k, codebook):
    gen = _gen(int(10 * k) + rows)
    kb, nbs = 16, [16, 8, 24]
    k2 = int(2 * k)
    trellises = [torch.randint(-32768, 32768, (kb, nb, 8 * k2), dtype=torch.int16,
                               generator=gen) for nb in nbs]
    xhs = [torch.randn(rows, 16 * kb, generator=gen).half() for _ in nbs]
    want = layer_kernels.gemm_parts(xhs, trellises, k2, codebook, 1)
    got = layer_kernels.gemm_parts([x.cuda() for x in xhs], [t.cuda() for t in trellises],
                                   k2, codebook, 4)
    for g, w, nb in zip(got, want, nbs, strict=True):
        assert g.shape == (4, rows, 16 * nb)
        _close(g.sum(0), w.sum(0), 1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("rows", [1, 9, 64])
def test_hadamard_out_with_rope_bias_and_slices(dtype, head_dim, rows):
    case = qkv_out_case(rows, head_dim, dtype, _gen(head_dim + rows))
    want, got = run_qkv_out(case, "cpu", dtype), run_qkv_out(case, "cuda", dtype)
    assert got[:, -16:].isnan().all()  # outside every slice: untouched
    _close(got[:, :-16], want[:, :-16], 1e-2 if dtype == torch.bfloat16 else 2e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hadamard_out_adds_the_residual(dtype):
    gen = _gen(3)
    rows, cols, width = 4, 320, 384
    partial = torch.randn(5, rows, width, generator=gen)
    post = torch.randn(width, generator=gen) * 0.1
    residual = torch.randn(rows, cols, generator=gen).to(dtype)

    def run(device):
        out = torch.full((rows, cols), float("nan"), dtype=dtype, device=device)
        layer_kernels.hadamard_out([partial.to(device)], [post.to(device)], [None], [out], [0],
                                   residual=residual.to(device))
        return out

    _close(run("cuda"), run("cpu"), 1e-2 if dtype == torch.bfloat16 else 2e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows", [1, 33])
@pytest.mark.parametrize("splits", [6, 19])  # under one batch of loads in flight; several
def test_glu_hadamard(dtype, act, rows, splits):
    gen = _gen(rows + splits)
    inter, width = 320, 384
    gate, up = (torch.randn(splits, rows, width, generator=gen) for _ in range(2))
    post_g, post_u, pre = (torch.randn(width, generator=gen) * 0.3 for _ in range(3))
    bias_g = torch.randn(inter, generator=gen)
    args = (post_g, post_u, bias_g, None)
    want = layer_kernels.glu_hadamard(gate, up, *args, inter, act, pre, dtype)
    got = layer_kernels.glu_hadamard(gate.cuda(), up.cuda(),
                                     *(None if a is None else a.cuda() for a in args),
                                     inter, act, pre.cuda(), dtype)
    _close(got, want, 2e-2 if dtype == torch.bfloat16 else 3e-3)


SHAPE_128 = dict(SHAPES["tiny"], hidden_size=256, intermediate_size=384,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=128)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(SHAPES, "test-hd128", SHAPE_128)
        return write_synthetic_model(tmp_path_factory.mktemp("hd128"), "test-hd128", seed=9)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_layers_give_the_unfused_logits_on_the_gpu(folder, dtype):
    assert kernels.available()
    model = load_causal_lm(folder, device="cuda", dtype=dtype)
    ids = torch.tensor([[5, 17, 99, 3, 42, 7, 7, 8]])
    fused = model(ids).float()
    assert all(isinstance(layer._fused, FusedDecodeLayer) for layer in model.layers)
    for layer in model.layers:
        layer._fused = None  # the unfused kernels
    plain = model(ids).float()
    assert (fused - plain).abs().max().item() <= 3e-2 * plain.abs().max().item()
    assert (fused.argmax(-1) == plain.argmax(-1)).float().mean().item() >= 0.85


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("rows", [1, 9, 64])
def test_qk_norm_rope_in_place_matches_its_twin(dtype, dim, rope, rows):
    """Qwen3's per-head q/k norm + rotary on the q and k heads of a q|k|v row block: the
    kernel writes in place, v heads (past the q/k columns) untouched."""
    gen = _gen(rows + dim)
    heads, kv = 6, 2
    qkv = (torch.randn(rows, heads + 2 * kv, dim, generator=gen) * 2).to(dtype)
    weight = torch.rand(heads + kv, dim, generator=gen) + 0.5
    cos = torch.randn(rows, dim, generator=gen).to(dtype) if rope else None
    sin = torch.randn(rows, dim, generator=gen).to(dtype) if rope else None
    want = layer_kernels.qk_norm_rope(qkv[:, : heads + kv], weight.to(dtype), 1e-6, cos, sin)
    device = qkv.cuda()
    got = layer_kernels.qk_norm_rope(device[:, : heads + kv], weight.to(dtype).cuda(), 1e-6,
                                     None if cos is None else cos.cuda(),
                                     None if sin is None else sin.cuda())
    assert got.data_ptr() == device.data_ptr()  # in place
    _close(device[:, : heads + kv], want, 1e-2 if dtype == torch.bfloat16 else 2e-3)
    assert torch.equal(device[:, heads + kv :].cpu(), qkv[:, heads + kv :])
