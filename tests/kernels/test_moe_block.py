"""exl3cli.ops.moe_block on CUDA (``-m cuda``): the fused RMSNorm + router + top-k + plan
kernel against its PyTorch reference, the whole block (norm-route, experts, residual)
against the MoE kernels run after the reference's steps, MoEMLP.decode_block's two
variants (EXL3_MOE_DECODE), and a CUDA graph of the block. Qwen3-like (128 experts,
top-8), Mixtral-like (8 experts, top-2, padded widths) and mcg / 3inst blocks.

Outputs are NaN-poisoned, and so is the memory the scratch buffers come from.
"""

from __future__ import annotations

import pytest
import torch

from exl3cli.engine.layers.norm import RMSNorm
from exl3cli.ops import cuda_kernels as kernels
from exl3cli.ops import moe_block, moe_kernels
from tests.kernels.test_moe_kernels import _block, _close, _poison_allocator

pytestmark = pytest.mark.cuda

# (name, hidden, expert width, experts, top_k, bits, codebook, activation)
BLOCKS = [
    ("qwen3-128x8", 256, 128, 128, 8, 4, "mul1", "silu"),
    ("mixtral-8x2", 320, 200, 8, 2, 3.5, "mul1", "silu"),
    ("mcg-60x4", 256, 256, 60, 4, 2, "mcg", "gelu_pytorch_tanh"),
    ("3inst-16x5", 128, 128, 16, 5, 5, "3inst", "silu"),
]
ROWS = [1, 3, 16, 64]
_GEN = torch.Generator().manual_seed(11)


def _norm(hidden: int, dtype: torch.dtype, unit_offset: bool = False) -> RMSNorm:
    weight = (1.0 + 0.2 * torch.randn(hidden, generator=_GEN)).to("cuda", dtype)
    return RMSNorm(weight, 1e-6, unit_offset=unit_offset)


def _route(x, norm, router_w, top_k, normalize=True, scale=1.0):
    ext = kernels._extension()
    rows, experts = x.shape[0], router_w.shape[0]
    pairs = rows * top_k
    nan = float("nan")
    normed = torch.full_like(x, nan)
    logits = torch.full((rows, experts), nan, device="cuda")
    weights = torch.full((rows, top_k), nan, device="cuda")
    chosen = torch.full((rows, top_k), -1, dtype=torch.int64, device="cuda")
    plan = torch.full((1 + 3 * pairs + 3 * min(experts, pairs),), -7, dtype=torch.int32,
                      device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    ext.moe_norm_route(x, norm.weight.float().contiguous(), norm.eps, norm.unit_offset,
                       router_w, top_k, normalize, scale, normed, logits, weights, chosen,
                       plan, counter)
    torch.cuda.synchronize()
    assert counter.item() == 0  # set back for the next launch
    return normed, logits, weights, chosen, plan


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("experts, top_k, hidden", [(128, 8, 2048), (8, 2, 4096),
                                                    (60, 4, 264), (256, 8, 512)])
def test_norm_route_matches_the_reference(experts, top_k, hidden, rows, dtype):
    x = (3 * torch.randn(rows, hidden, generator=_GEN)).to("cuda", dtype)
    norm = _norm(hidden, dtype, unit_offset=hidden == 264)
    router_w = (torch.randn(experts, hidden, generator=_GEN) / hidden**0.5).to("cuda", dtype)
    normalize, scale = experts != 60, 2.5 if experts == 60 else 1.0
    normed, logits, weights, chosen, plan = _route(x, norm, router_w, top_k, normalize, scale)
    want_n, want_l, _, _ = moe_block.reference_norm_route(
        x, norm.weight.float(), norm.eps, norm.unit_offset, router_w, top_k, normalize, scale)
    ulp = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}[dtype]
    _close(normed, want_n, ulp)
    _close(logits, want_l, 2 * ulp)
    # The choice from the kernel's own logits: the top_k largest (exact ties may go to
    # either expert in torch.topk), distinct; the weights from those logits.
    assert (chosen.sort(dim=-1).values.diff(dim=-1) > 0).all()
    picked = logits.gather(1, chosen)
    assert torch.equal(picked.sort(dim=-1, descending=True).values,
                       torch.topk(logits, top_k, dim=-1).values)
    want_w = torch.softmax(logits, dim=-1).gather(1, chosen)
    if normalize:
        want_w = want_w / want_w.sum(dim=-1, keepdim=True)
    assert (weights - want_w * scale).abs().max() < 1e-5 * max(1.0, scale)
    # The plan equals the one moe_route builds from the same ids (slot order within an
    # expert aside).
    again = torch.full_like(plan, -7)
    kernels._extension().moe_route(chosen, experts, again)
    pairs = rows * top_k
    assert plan[0] == again[0]
    assert torch.equal(plan[1 + 3 * pairs :], again[1 + 3 * pairs :])  # act_* arrays
    slot_pair, pair_slot, slot_expert = (plan[1 + i * pairs : 1 + (i + 1) * pairs].long()
                                         for i in range(3))
    assert torch.equal(slot_expert, again[1 + 2 * pairs : 1 + 3 * pairs].long())
    assert torch.equal(pair_slot[slot_pair], torch.arange(pairs, device="cuda"))
    assert torch.equal(slot_expert, chosen.reshape(-1)[slot_pair])


@pytest.mark.parametrize("combine", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 33, 64])
@pytest.mark.parametrize("spec", BLOCKS, ids=lambda s: s[0])
def test_the_block_is_the_kernels_after_the_routing(spec, rows, dtype, combine):
    """moe_block = h + moe_experts(normed, weights, chosen) bit for bit (the same kernels
    after the routing, the residual rounded as torch's add; with `combine`, at <= 16
    pairs, the down GEMM's own weighted sum, rounded and ordered as moe_out), and its
    routing is the reference's."""
    block = _block(spec, dtype)
    hidden, top_k = spec[1], spec[4]
    h = torch.randn(rows, hidden, generator=_GEN).to("cuda", dtype)
    norm = _norm(hidden, dtype)
    w32 = norm.weight.float().contiguous()
    tables = block.kernel_tables(h)
    router_w = block.router.gate.weight
    assert tables is not None and moe_block.runs_on_kernels(h, router_w, top_k, tables)
    block.on_kernels()
    _poison_allocator()
    out, normed, weights, chosen = moe_block.moe_block(
        h, w32, norm.eps, False, router_w, top_k, True, 1.0, tables, block._counter,
        combine=combine)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    assert torch.equal(out, h + moe_kernels.moe_experts(normed, weights, chosen, tables))
    twin = moe_kernels.reference_moe_experts(normed, weights, chosen, tables)
    _close(out, h + twin, 2e-2)
    _close(normed, norm(h), 2e-2)
    plain, _, _, _ = moe_block.moe_block(
        h, w32, norm.eps, False, router_w, top_k, True, 1.0, tables, block._counter,
        residual=False, combine=combine)
    assert torch.equal(plain, moe_kernels.moe_experts(normed, weights, chosen, tables))
    assert (block._counter == 0).all()  # every counter set back for the next launch


@pytest.mark.parametrize("spec", [BLOCKS[0], BLOCKS[1]], ids=lambda s: s[0])
def test_decode_block_variants(spec, monkeypatch):
    """EXL3_MOE_DECODE=new (the fused block) against old (norm module, router linear,
    MoE kernels, add): the same result where the two routers choose the same experts."""
    block = _block(spec, torch.float16)
    hidden = spec[1]
    norm = _norm(hidden, torch.float16)
    w32 = norm.weight.float().contiguous()
    h = torch.randn(16, 1, hidden, generator=_GEN).to("cuda", torch.float16)
    assert block._block_router(h.view(16, hidden)) is not None
    new = block.decode_block(h, norm, w32)
    monkeypatch.setenv("EXL3_MOE_DECODE", "combine")  # 16 rows: past the combine's pairs
    assert torch.equal(block.decode_block(h, norm, w32), new)
    one = h[:1]
    combined = block.decode_block(one, norm, w32)
    monkeypatch.setenv("EXL3_MOE_DECODE", "new")
    assert torch.equal(combined, block.decode_block(one, norm, w32))
    monkeypatch.setenv("EXL3_MOE_DECODE", "old")
    old = block.decode_block(h, norm, w32)
    want = h + block(norm(h))
    assert torch.equal(old, want)
    _, chosen_old = block.router(norm(h).view(16, hidden))
    _, _, _, chosen_new = moe_block.moe_block(
        h.view(16, hidden), w32, norm.eps, False, block.router.gate.weight, spec[4], True, 1.0,
        block._tables, block._counter)
    same = (chosen_old.sort(-1).values == chosen_new.sort(-1).values).all(-1)
    assert same.float().mean() >= 0.75  # near-tied experts may flip (logit rounding)
    _close(new.view(16, hidden)[same], old.view(16, hidden)[same], 2e-2)
    monkeypatch.setenv("EXL3_MOE_DECODE", "fused")
    with pytest.raises(ValueError, match="EXL3_MOE_DECODE"):
        block.decode_block(h, norm, w32)


@pytest.mark.parametrize("variant", ["new", "combine"])
def test_the_block_is_captured_by_a_cuda_graph(variant, monkeypatch):
    monkeypatch.setenv("EXL3_MOE_DECODE", variant)
    spec = BLOCKS[1]  # Mixtral-like: 4 rows x top-2 = 8 pairs, within the combine's 16
    block = _block(spec, torch.bfloat16)
    hidden = spec[1]
    norm = _norm(hidden, torch.bfloat16)
    w32 = norm.weight.float().contiguous()
    h = torch.randn(4, 1, hidden, device="cuda", dtype=torch.bfloat16)
    expected = block.decode_block(h, norm, w32)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the graph
        block.decode_block(h, norm, w32)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a read-back or a zero-fill would show here
        out = block.decode_block(h, norm, w32)
    for _ in range(3):  # the counter comes back to 0 after every replay
        fresh = torch.randn(4, 1, hidden, device="cuda", dtype=torch.bfloat16)
        h.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, block.decode_block(fresh, norm, w32))
    assert (out.float() - expected.float()).abs().max() > 0
    assert (block._counter == 0).all()
