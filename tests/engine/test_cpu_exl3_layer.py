"""The EXL3 decode layer in two CPU calls (csrc/ops/cpu/exl3_layer_cpu.cpp,
ops/cpu_exl3_layer.py, engine/layers/cpu_exl3.Exl3DecodePlan) against its PyTorch twins
and against the per-op path it replaces (EXL3_CPU_LAYER=0)."""

from __future__ import annotations

import pytest
import torch

from exl3cli.convert.synthetic import write_synthetic_model
from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.layers.cpu_exl3 import Exl3DecodePlan
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.text.tokenizer import Tokenizer
from exl3cli.ops import cpu_exl3_layer as ops
from exl3cli.ops import cpu_kernels
from exl3cli.ops.cpu_gemv_mode import set_exl3_gemv_mode


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
    return write_synthetic_model(tmp_path_factory.mktemp("layer"), "tiny", bits=3.5,
                                 head_bits=6, num_layers=3, seed=4)


def _load(folder):
    return load_causal_lm(folder, device="cpu", dtype=torch.float32, cpu_weights="exl3")


@pytest.mark.parametrize("rows", [1, 3])
def test_ops_match_their_twins(folder, rows) -> None:
    layer = _load(folder).layers[1]
    plan = layer._decode_plan()
    assert isinstance(plan, Exl3DecodePlan)
    assert [len(g) for g in plan.weights[:4]] == [3, 1, 2, 1]  # q|k|v, o, gate|up, down
    attention, norm = layer.attention, layer.input_norm
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, norm.weight.numel(), generator=g)
    dim, rot = attention.head_dim, attention.num_heads + attention.num_kv_heads
    angles = torch.rand(rows, dim // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    args = (x, norm.weight, norm.eps, plan.weights, cos, sin, dim, rot)
    torch.testing.assert_close(ops.exl3_norm_qkv_rope_cpu(*args),
                               ops.exl3_norm_qkv_rope_reference(*args), rtol=1e-4, atol=1e-4)
    attn = torch.randn(rows, attention.num_heads * dim, generator=g)
    post = layer.post_attention_norm
    args = (x, attn, post.weight, post.eps, plan.weights)
    torch.testing.assert_close(ops.exl3_out_mlp_cpu(*args), ops.exl3_out_mlp_reference(*args),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 3, 12])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fast", [False, True])
def test_parts_in_one_region_equal_part_by_part(folder, rows, threads, fast) -> None:
    """q|k|v (3 parts) run as one parallel region inside the op: bit for bit the outputs of
    exl3_linear_cpu part by part (the integer GEMV too), any thread count, decode rows and
    prompt rows."""
    layer = _load(folder).layers[2]
    plan = layer._decode_plan()
    norm, attention = layer.input_norm, layer.attention
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, norm.weight.numel(), generator=g)
    dim = attention.head_dim
    cos, sin = torch.ones(rows, dim), torch.zeros(rows, dim)
    before = torch.get_num_threads()
    mode = set_exl3_gemv_mode("fast" if fast else "exact")
    try:
        torch.set_num_threads(threads)
        got = ops.exl3_norm_qkv_rope_cpu(x, norm.weight, norm.eps, plan.weights, cos, sin, dim, 0)
        normed = cpu_kernels.rms_norm_cpu(x, norm.weight, norm.eps)
        book = plan.weights.codebook
        want = torch.cat([cpu_kernels.exl3_linear_cpu(normed, p.trellis_t, p.suh, p.svh, p.bias,
                                                      p.k_bits, book, p.n)
                          for p in plan.weights.qkv], dim=-1)
    finally:
        torch.set_num_threads(before)
        set_exl3_gemv_mode("exact")
    assert mode in ("fast", "exact")
    assert torch.equal(got, want)


def _greedy(model, folder) -> list[int]:
    tokenizer = Tokenizer.from_folder(folder)
    generator = Generator(model, tokenizer, max_batch=2, num_ctx=128)
    handles = [generator.submit(GenerationJob(tokenizer.encode(text), {"temperature": 0},
                                              num_predict=16, ignore_eos=True))
               for text in ("Two calls", "per layer")]
    generator.run_until_done()
    return [t for h in handles for t in h.token_ids]


def test_decode_through_the_plan_matches_the_per_op_path(folder, monkeypatch) -> None:
    fused = _load(folder)
    monkeypatch.setenv("EXL3_CPU_LAYER", "0")
    plain = _load(folder)
    assert plain.layers[0]._decode_plan() is None
    monkeypatch.delenv("EXL3_CPU_LAYER")
    assert isinstance(fused.layers[0]._decode_plan(), Exl3DecodePlan)
    assert _greedy(fused, folder) == _greedy(plain, folder)
    ids = torch.tensor([[9], [4]])  # two one-token rows: the decode-rows path
    torch.testing.assert_close(fused(ids), plain(ids), rtol=1e-5, atol=1e-5)


def test_the_op_refuses_mismatched_lists(folder) -> None:
    plan = _load(folder).layers[0]._decode_plan()
    weights = plan.weights._replace(down=())
    x = torch.randn(1, 192)
    with pytest.raises(RuntimeError, match="every projection has a part"):
        ops.exl3_out_mlp_cpu(x, torch.randn(1, 192), torch.ones(192), 1e-5, weights)


@pytest.mark.parametrize("rows", [1, 2])
def test_the_decode_pool_gives_the_bits_of_openmp(folder, rows) -> None:
    """EXL3_CPU_POOL's pool (csrc/ops/cpu/decode_pool.cpp) runs the products' strips and the
    attention tasks that at::parallel_for ran: the same outputs bit for bit, 2 threads."""
    model = _load(folder)
    pool = cpu_kernels._ops().exl3_decode_pool
    before, threads = pool(-1), torch.get_num_threads()
    ids = torch.tensor([[9, 4, 7]] * rows)
    g = torch.Generator().manual_seed(rows)
    q = torch.randn(rows, 8, 32, generator=g)
    k, v = torch.randn(rows, 2, 300, 32, generator=g), torch.randn(rows, 2, 300, 32, generator=g)
    out = {}
    try:
        torch.set_num_threads(2)
        for on in (0, 1):
            assert pool(on) == bool(on)
            out[on] = (model(ids), cpu_kernels.attend_decode_cpu(q, k, v))
    finally:
        pool(int(before))
        torch.set_num_threads(threads)
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
