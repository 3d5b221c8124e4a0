"""exl3cli.ops.moe_kernels: the MoE decode kernels (``-m cuda``) against the per-expert
path of MoEMLP (its grouped dispatch over the EXL3 experts) and against their PyTorch
twin, on Qwen3-MoE-like and Mixtral-like tiny blocks; the routing plan; a CUDA graph of
an MoE block; the generator's graphs on synthetic MoE folders.

Outputs are poisoned with NaN first, and so is the memory the kernels' scratch buffers
come from (the caching allocator hands the freed NaN block out again), so a slot or a
column that no kernel wrote shows.
"""

from __future__ import annotations

import random

import pytest
import torch

from exl3cli.convert.synthetic import random_exl3_linear, write_synthetic_model
from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.layers.linear import DenseLinear, Exl3Linear, FusedLinear
from exl3cli.engine.layers.mlp import GatedMLP
from exl3cli.engine.layers.moe import MoEMLP, Router
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.text.tokenizer import Tokenizer
from exl3cli.ops import cuda_kernels as kernels
from exl3cli.ops import moe_kernels

pytestmark = pytest.mark.cuda

# (name, hidden, expert width, experts, top_k, bits, codebook, activation)
BLOCKS = [
    ("qwen3-k2", 256, 128, 16, 2, 4, "mul1", "silu"),
    ("qwen3-k4", 256, 128, 16, 4, 4, "mul1", "silu"),
    ("qwen3-k6", 256, 128, 16, 6, 4, "mul1", "silu"),
    ("mixtral", 320, 200, 8, 2, 3.5, "mul1", "silu"),  # hidden, width padded to 384, 256
    ("mcg-k3", 256, 256, 6, 3, 2, "mcg", "gelu_pytorch_tanh"),
    ("3inst-k5", 128, 128, 8, 5, 5, "3inst", "silu"),
]
ROWS = [1, 5, 16, 33, 64]


def _exl3(in_f: int, out_f: int, bits: float, codebook: str, gen: torch.Generator,
          dtype: torch.dtype) -> Exl3Linear:
    return Exl3Linear(random_exl3_linear(in_f, out_f, bits, codebook, gen), in_f, out_f,
                      "cuda", dtype, mode="trellis")


def _block(spec: tuple, dtype: torch.dtype, seed: int = 0) -> MoEMLP:
    _, hidden, width, experts, top_k, bits, codebook, act = spec
    gen = torch.Generator().manual_seed(seed)
    router = DenseLinear((torch.randn(experts, hidden, generator=gen) / hidden**0.5)
                         .to("cuda", dtype))
    mlps = [GatedMLP(FusedLinear([_exl3(hidden, width, bits, codebook, gen, dtype),
                                  _exl3(hidden, width, bits, codebook, gen, dtype)]),
                     _exl3(width, hidden, bits, codebook, gen, dtype), act)
            for _ in range(experts)]
    return MoEMLP(Router(router, top_k), mlps)


def _poison_allocator(megabytes: int = 64) -> None:
    torch.cuda.synchronize()
    block = torch.full((megabytes << 18,), float("nan"), device="cuda")
    del block  # back to the caching allocator, NaN-filled


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    got, want = got.float().cpu(), want.float().cpu()
    assert not got.isnan().any()
    scale = want.abs().max().item() + 1e-6
    assert (got - want).abs().max().item() <= rel * scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("spec", BLOCKS, ids=lambda s: s[0])
def test_kernels_match_the_per_expert_path(spec, rows, dtype):
    block = _block(spec, dtype)
    hidden = spec[1]
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows)).to("cuda", dtype)
    tables = block.kernel_tables(x)
    assert tables is not None and moe_kernels.runs_on_kernels(x, tables)
    weights, chosen = block.router(x)
    want = block._routed(x, weights, chosen)  # grouped dispatch, the experts' own kernels
    twin = moe_kernels.reference_moe_experts(x, weights, chosen, tables)
    _poison_allocator()
    out = torch.full((rows, hidden + 8), float("nan"), dtype=dtype, device="cuda")
    got = moe_kernels.moe_experts(x, weights, chosen, tables, out=out[:, :hidden])
    torch.cuda.synchronize()
    assert out[:, hidden:].isnan().all()  # nothing written past the hidden columns
    _close(got, want, 3e-2)
    _close(got, twin, 2e-2)
    # The router fused into the routing kernel: the same choice, weights and result.
    _poison_allocator()
    routed, w2, c2 = moe_kernels.moe_experts_routed(x, block.router.gate(x), spec[4], True,
                                                    1.0, tables)
    torch.cuda.synchronize()
    order, order2 = chosen.sort(dim=-1), c2.sort(dim=-1)
    assert torch.equal(order.values, order2.values)
    assert (weights.gather(1, order.indices) - w2.gather(1, order2.indices)).abs().max() < 1e-5
    _close(routed, got, 1e-2)
    _close(block(x.view(rows, 1, hidden)).view(rows, hidden), got, 1e-2)  # MoEMLP.forward


def test_the_plan_sorts_pairs_by_expert():
    ext = kernels._extension()
    experts, rows, top_k = 16, 9, 4
    gen = torch.Generator().manual_seed(2)
    chosen = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(rows)])
    chosen[3] = torch.tensor([0, 1, 2, 3])  # experts shared by several rows
    chosen[4] = torch.tensor([3, 2, 1, 0])
    pairs, slots = rows * top_k, min(experts, rows * top_k)
    plan = torch.full((1 + 3 * pairs + 3 * slots,), -7, dtype=torch.int32, device="cuda")
    ext.moe_route(chosen.cuda(), experts, plan)
    plan = plan.cpu()
    active = int(plan[0])
    slot_pair, pair_slot, slot_expert = (plan[1 + i * pairs : 1 + (i + 1) * pairs]
                                         for i in range(3))
    act = plan[1 + 3 * pairs :]
    act_expert, act_offset, act_rows = act[:slots], act[slots : 2 * slots], act[2 * slots :]
    flat = chosen.reshape(-1)
    counts = torch.bincount(flat, minlength=experts)
    assert active == int((counts > 0).sum())
    assert sorted(slot_pair.tolist()) == list(range(pairs))
    assert (pair_slot[slot_pair.long()] == torch.arange(pairs, dtype=torch.int32)).all()
    assert (slot_expert == flat[slot_pair.long()].int()).all()
    assert (slot_expert[1:] >= slot_expert[:-1]).all()  # sorted by expert
    used = counts.nonzero()[:, 0]
    assert act_expert[:active].tolist() == used.tolist()
    assert act_rows[:active].tolist() == counts[used].tolist()
    assert act_offset[:active].tolist() == (torch.cumsum(counts, 0) - counts)[used].tolist()


@pytest.mark.parametrize("spec", [BLOCKS[1], BLOCKS[3]], ids=lambda s: s[0])
def test_an_moe_block_is_captured_by_a_cuda_graph(spec):
    block = _block(spec, torch.bfloat16)
    x = torch.randn(8, 1, spec[1], device="cuda", dtype=torch.bfloat16)
    expected = block(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the graph
        block(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # any read-back (counts, .item()) fails the capture
        out = block(x)
    fresh = torch.randn(8, 1, spec[1], device="cuda", dtype=torch.bfloat16)
    x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert (out.float() - block(fresh).float()).abs().max() == 0  # same kernels, same bits
    assert (out.float() - expected.float()).abs().max() > 0  # the replay computed new rows


def test_prefill_sized_calls_run_the_kernels_in_slices(monkeypatch):
    """Calls past 64 rows (prefill) run the kernels on slices of 64 rows: the same
    result as the grouped dispatch (which EXL3_MOE_PREFILL=grouped keeps), no counts
    read back."""
    block = _block(BLOCKS[1], torch.bfloat16)
    x = torch.randn(1, 150, 256, generator=torch.Generator().manual_seed(5)).to(
        "cuda", torch.bfloat16)
    block.last_counts = []
    _poison_allocator()
    got = block(x)
    torch.cuda.synchronize()
    assert block.last_counts == []  # not the grouped dispatch
    slices = torch.cat([block(x[:, s:s + 64]) for s in range(0, 150, 64)], dim=1)
    assert torch.equal(got, slices)  # each slice is the decode kernels' call on its rows
    monkeypatch.setenv("EXL3_MOE_PREFILL", "grouped")
    want = block(x)
    assert sum(block.last_counts) == 150 * 4  # the grouped path counted them
    _close(got, want, 3e-2)
    monkeypatch.setenv("EXL3_MOE_PREFILL", "sliced")
    with pytest.raises(ValueError, match="EXL3_MOE_PREFILL"):
        block(x)


def _generate(folder, mode: str, jobs: int = 5) -> tuple[list[list[int]], Generator]:
    model = load_causal_lm(folder, device="cuda", dtype=torch.float32)
    rng = random.Random(3)
    generator = Generator(model, Tokenizer.from_folder(folder), decode_mode=mode,
                          num_ctx=512, max_batch=jobs)
    handles = [generator.submit(GenerationJob(
        [rng.randrange(10, 200) for _ in range(rng.choice([3, 40, 130]))],
        {"temperature": 0}, num_predict=rng.randrange(10, 30), ignore_eos=True))
        for _ in range(jobs)]
    generator.run_until_done()
    return [h.token_ids for h in handles], generator


@pytest.mark.parametrize("shape", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_the_generator_replays_graphs_of_moe_models(tmp_path, shape, monkeypatch):
    folder = write_synthetic_model(tmp_path, shape, bits=4.0, seed=4)
    want, _ = _generate(folder, "off")
    got, generator = _generate(folder, "graph")
    assert generator.decode.mode == "graph" and generator.decode.graph_count >= 2
    assert got == want  # float32: the two paths differ only in summation order
    # Without the kernels the grouped dispatch reads expert counts back: no capture.
    monkeypatch.setenv("EXL3_MOE_KERNEL", "0")
    again, generator = _generate(folder, "graph")
    assert generator.decode.mode == "static"
    assert [len(a) for a in again] == [len(w) for w in want]
    torch.randn(4, device="cuda")  # failed captures leave the default generator usable


@pytest.mark.parametrize("shape", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_fused_moe_layers_match_the_unfused_layers(tmp_path, shape, monkeypatch):
    """engine/layers/fused_layer.py with an MoE MLP (and Qwen3's q/k norms) against
    DecoderLayer's unfused kernels and the grouped dispatch, float32 logits."""
    folder = write_synthetic_model(tmp_path, shape, bits=4.0, seed=6)
    ids = torch.randint(0, 250, (2, 9), generator=torch.Generator().manual_seed(1)).cuda()
    fused = load_causal_lm(folder, device="cuda", dtype=torch.float32)
    got = fused(ids)
    assert all(layer._fused is not None for layer in fused.layers)
    monkeypatch.setenv("EXL3_FUSED_LAYER", "0")
    monkeypatch.setenv("EXL3_MOE_KERNEL", "0")
    plain = load_causal_lm(folder, device="cuda", dtype=torch.float32)
    want = plain(ids)
    assert all(layer._fused is None for layer in plain.layers)
    _close(got, want, 1e-2)
