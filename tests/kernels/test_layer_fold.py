"""exl3cli.ops.layer_fold: the folds that take launches out of a decode layer. Their
PyTorch twins are checked on CPU against what they replace; on CUDA (``-m cuda``) the
kernels give the bits of the launches they replace (poisoned outputs, several shapes),
and a generator with every fold on gives the tokens of one with none."""

from __future__ import annotations

import pytest
import torch

from exl3cli.codec import block_hadamard
from exl3cli.convert.synthetic import write_synthetic_model
from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.kvcache.paged_cache import PagePool
from exl3cli.engine.layers.fused_layer import FusedDecodeLayer
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.text.tokenizer import Tokenizer
from exl3cli.ops import cuda_kernels as kernels
from exl3cli.ops import layer_fold, layer_kernels
from tests.fixtures.fused_shapes import write_fused_shapes

cuda = pytest.mark.cuda


def test_fold_names():
    assert layer_fold.fold_names("") == frozenset()
    assert layer_fold.fold_names("0") == frozenset()
    assert layer_fold.fold_names("all") == {"kv", "combine", "norm"}
    assert layer_fold.fold_names(" kv ") == {"kv"}
    with pytest.raises(ValueError, match="unknown fold"):
        layer_fold.fold_names("kv,rope")


def test_kv_and_combine_are_on_unless_turned_off(monkeypatch):
    monkeypatch.setattr(layer_fold, "FOLDS", None)
    monkeypatch.delenv("EXL3_LAYER_FOLD", raising=False)
    assert layer_fold.active_folds() == {"kv", "combine"}
    for off in ("0", "none", "off"):
        monkeypatch.setenv("EXL3_LAYER_FOLD", off)
        assert layer_fold.active_folds() == frozenset()
    monkeypatch.setenv("EXL3_LAYER_FOLD", "all")
    assert layer_fold.active_folds() == {"kv", "combine", "norm"}


def test_kv_ranges_over_split_and_fused_parts():
    heads, kv_heads, dim = 4, 2, 8
    assert layer_fold.kv_ranges([32, 16, 16], heads, kv_heads, dim) == [
        0, 0, 0, 0, 0, 16, 0, 0, 0, 0, 0, 16]
    assert layer_fold.kv_ranges([64], heads, kv_heads, dim) == [32, 48, 48, 64]
    assert layer_fold.kv_ranges([40, 24], heads, kv_heads, dim) is None  # k split over two


def _chunk_parts(q, k, v, chunk):
    """Per-chunk (unnormalised acc, max, sum) of one head's attention, as the kernel keeps."""
    scores = (k @ q) * q.shape[0] ** -0.5
    accs, mls = [], []
    for c in range(0, len(scores), chunk):
        s = scores[c : c + chunk]
        m = s.max()
        p = torch.exp(s - m)
        accs.append(p @ v[c : c + chunk])
        mls.append(torch.stack([m, p.sum()]))
    return torch.stack(accs), torch.stack(mls), torch.softmax(scores, 0) @ v


def test_combine_reference_is_the_softmax_over_all_chunks():
    gen = torch.Generator().manual_seed(1)
    rows, heads, dim, positions = 2, 3, 64, 150
    acc = torch.empty(rows, heads, 4, dim)
    ml = torch.empty(rows, heads, 4, 2)
    want = torch.empty(rows, heads, dim)
    for r in range(rows):
        for h in range(heads):
            q, k, v = (torch.randn(*s, generator=gen, dtype=torch.float64)
                       for s in ((dim,), (positions, dim), (positions, dim)))
            a, m, w = _chunk_parts(q, k, v, 64)
            acc[r, h, :3], ml[r, h, :3], want[r, h] = a.float(), m.float(), w.float()
    acc[:, :, 3] = float("nan")  # a chunk past the row: (-inf, 0), its acc never read
    ml[:, :, 3, 0], ml[:, :, 3, 1] = -float("inf"), 0.0
    got = layer_fold.combine_reference(acc, ml, torch.float32)
    assert torch.allclose(got, want.reshape(rows, -1), atol=1e-5)


def test_combine_hadamard_twin_is_norm_hadamard_of_the_combine():
    gen = torch.Generator().manual_seed(2)
    acc = torch.randn(3, 4, 2, 64, generator=gen)
    ml = torch.stack([torch.randn(3, 4, 2, generator=gen),
                      torch.rand(3, 4, 2, generator=gen) + 0.5], -1)
    pre = torch.randn(384, generator=gen)
    attended = layer_fold.combine_reference(acc, ml, torch.float16)
    want = layer_kernels.norm_hadamard(attended, None, 0.0, False, [pre], 384)[0]
    got = layer_fold.combine_hadamard(acc, ml, attended, pre, 384)
    assert torch.equal(got, want)


def _out_case(rows, dtype, device, seed):
    """q/k/v partials of 3 parts (heads 4, kv heads 2, dim 64) and a 4-page pool."""
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = 4, 2, 64
    widths = [heads * dim, kv_heads * dim, kv_heads * dim]
    partials = [torch.randn(3, rows, w, generator=gen).to(device) for w in widths]
    posts = [torch.rand(w, generator=gen).add(0.5).to(device) for w in widths]
    biases = [None, torch.randn(widths[1], generator=gen).to(device), None]
    cos = torch.rand(rows, dim, generator=gen).to(device, dtype)
    sin = torch.rand(rows, dim, generator=gen).to(device, dtype)
    pool = PagePool(4, 1, kv_heads, dim, dtype, device)
    pool.keys[0].fill_(7.0)
    pool.values[0].fill_(7.0)
    slots = torch.randperm(pool.keys[0].shape[0], generator=gen)[:rows].to(device)
    ranges = layer_fold.kv_ranges(widths, heads, kv_heads, dim)
    rope = [heads * dim, kv_heads * dim, 0]
    return partials, posts, biases, cos, sin, pool, slots, ranges, rope, widths


def _run_out_kv(rows, dtype, device, seed):
    partials, posts, biases, cos, sin, pool, slots, ranges, rope, widths = _out_case(
        rows, dtype, device, seed)
    outs = [torch.full((rows, w), float("nan"), dtype=dtype, device=device) for w in widths]
    layer_fold.hadamard_out_kv(partials, posts, biases, outs, rope, cos, sin, 64,
                               layer_fold.KvStore(pool.keys[0], pool.values[0], slots, ranges))
    plain = [torch.empty_like(o) for o in outs]
    layer_kernels.hadamard_out(partials, posts, biases, plain, rope, cos=cos, sin=sin,
                               head_dim=64)
    return outs, plain, pool, slots


def test_hadamard_out_kv_twin_stores_the_rotated_keys_and_values():
    outs, plain, pool, slots = _run_out_kv(3, torch.float32, "cpu", 3)
    assert all(torch.equal(o, p) for o, p in zip(outs, plain, strict=True))
    assert torch.equal(pool.keys[0][slots].reshape(3, -1), outs[1])
    assert torch.equal(pool.values[0][slots].reshape(3, -1), outs[2])
    others = torch.ones(pool.keys[0].shape[0], dtype=torch.bool)
    others[slots] = False
    assert (pool.keys[0][others] == 7.0).all() and (pool.values[0][others] == 7.0).all()


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 6, 64])
def test_hadamard_out_kv_kernel_gives_the_plain_outputs_and_stores(dtype, rows):
    assert kernels.available() and layer_kernels._ext(torch.empty(1, device="cuda"))
    outs, plain, pool, slots = _run_out_kv(rows, dtype, "cuda", 10 + rows)
    assert all(torch.equal(o, p) for o, p in zip(outs, plain, strict=True))
    assert torch.equal(pool.keys[0][slots].reshape(rows, -1), outs[1])
    assert torch.equal(pool.values[0][slots].reshape(rows, -1), outs[2])
    others = torch.ones(pool.keys[0].shape[0], dtype=torch.bool, device="cuda")
    others[slots] = False
    assert (pool.keys[0][others] == 7.0).all() and (pool.values[0][others] == 7.0).all()


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows, heads, kv_heads, dim, width", [
    (1, 32, 8, 128, 4096), (5, 9, 3, 64, 640), (64, 8, 2, 128, 1024), (3, 4, 4, 256, 1152)])
@pytest.mark.parametrize("pages, page_size", [(1, 64), (1, 256), (3, 256)])  # 1, 4, 12 chunks
def test_combine_hadamard_gives_the_bits_of_combine_then_norm_hadamard(
        dtype, rows, heads, kv_heads, dim, width, pages, page_size):
    assert hasattr(layer_kernels._ext(torch.empty(1, device="cuda")), "combine_hadamard")
    gen = torch.Generator(device="cuda").manual_seed(rows * 7 + pages)
    slots_n = 8 * page_size
    keys = torch.randn(slots_n, kv_heads, dim, generator=gen, device="cuda").to(dtype)
    values = torch.randn(slots_n, kv_heads, dim, generator=gen, device="cuda").to(dtype)
    table = torch.stack([torch.randperm(8, generator=gen, device="cuda")[:pages]
                         for _ in range(rows)])
    lengths = torch.randint(1, pages * page_size + 1, (rows,), generator=gen, device="cuda")
    lengths[0] = 1
    query = torch.randn(rows, heads, dim, generator=gen, device="cuda").to(dtype)
    pre = torch.rand(width, generator=gen, device="cuda") + 0.5
    want_attn = kernels.paged_attention(query, keys, values, 16, 16, table, lengths, page_size,
                                        None)
    want = layer_kernels.norm_hadamard(want_attn.reshape(rows, -1), None, 0.0, False, [pre],
                                       width)[0]
    acc, ml = layer_fold.attention_parts(rows, heads, pages, page_size, dim,
                                         torch.device("cuda"))
    acc.fill_(float("nan"))
    ml.fill_(float("nan"))
    got_attn = kernels.paged_attention(query, keys, values, 16, 16, table, lengths, page_size,
                                       None, parts=(acc, ml))
    if kernels.attention_chunks(pages, page_size) == 1:
        assert torch.equal(got_attn, want_attn)
    else:  # the chunks stay uncombined; their twin gives the kernel's combine closely
        twin = layer_fold.combine_reference(acc, ml, dtype)
        assert (twin.float() - want_attn.reshape(rows, -1).float()).abs().max() < 2e-2
    got = torch.full((rows, width), float("nan"), dtype=torch.float16, device="cuda")
    layer_kernels._ext(acc).combine_hadamard(acc, ml, got_attn.reshape(rows, -1), pre, got,
                                             0 if dtype == torch.float16 else 1)
    assert not got.isnan().any()
    assert torch.equal(got, want)
    assert torch.equal(layer_fold.combine_hadamard(acc, ml, got_attn.reshape(rows, -1), pre,
                                                   width), want)
    cpu = block_hadamard(torch.nn.functional.pad(want_attn.reshape(rows, -1).float().cpu(),
                                                 (0, width - heads * dim)) * pre.cpu(), dim=-1)
    assert (got.float().cpu() - cpu).abs().max() <= 2e-3 * cpu.abs().max() + 1e-3


@cuda
@pytest.mark.parametrize("cache", ["fp16", "q4"])
def test_generator_with_every_fold_gives_the_same_tokens(tmp_path, monkeypatch, cache):
    folder = write_synthetic_model(tmp_path, "smollm2-135m", bits=4.0, num_layers=2, seed=5)
    tokenizer = Tokenizer.from_folder(folder)
    tokens = {}
    for folds in ("", "all"):
        monkeypatch.setattr(layer_fold, "FOLDS", layer_fold.fold_names(folds))
        model = load_causal_lm(folder, device="cuda", dtype=torch.float16)
        generator = Generator(model, tokenizer, decode_mode="graph", num_ctx=1024,
                              max_batch=4, kv_cache_type=cache)
        handles = [generator.submit(GenerationJob(list(range(10 + j, 10 + j + 40 + 90 * j)),
                                                  {"temperature": 0}, num_predict=40,
                                                  ignore_eos=True)) for j in range(3)]
        generator.run_until_done()
        tokens[folds] = [h.token_ids for h in handles]
        plans = [layer._fused for layer in model.layers]
        assert all(isinstance(p, FusedDecodeLayer) for p in plans)
        assert (plans[0].successor is plans[1]) == (folds == "all")  # the hand-over ran
        del generator, model
    assert tokens[""] == tokens["all"]


def _out_norm_case(rows, width, cols, in_width, nparts, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    partial = torch.randn(5, rows, width, generator=gen).to(device)
    post = torch.rand(width, generator=gen).add(0.5).to(device)
    bias = torch.randn(cols, generator=gen).mul(0.1).to(device)
    residual = torch.randn(rows, cols, generator=gen).to(device, dtype)
    norm_w = torch.rand(cols, generator=gen).add(0.5).to(device)
    pres = [torch.randn(in_width, generator=gen).to(device) for _ in range(nparts)]
    return partial, post, bias, residual, norm_w, pres


def _out_norm_both(rows, width, cols, in_width, nparts, dtype, device, unit_offset, seed,
                   counters=None):
    partial, post, bias, residual, norm_w, pres = _out_norm_case(
        rows, width, cols, in_width, nparts, dtype, device, seed)
    h = torch.full((rows, cols), float("nan"), dtype=dtype, device=device)
    if counters is None:
        got = layer_fold.out_norm(partial, post, bias, residual, h, norm_w, 1e-5, unit_offset,
                                  pres, in_width, counters)
    else:  # the kernel itself, into poisoned outputs
        got = [torch.full((rows, in_width), float("nan"), dtype=torch.float16, device=device)
               for _ in pres]
        layer_kernels._ext(partial).out_norm(partial, post, bias, residual, h, norm_w, 1e-5,
                                             unit_offset, pres, got, in_width, counters)
    h_want = torch.empty_like(h)
    layer_kernels.hadamard_out([partial], [post], [bias], [h_want], [0], residual=residual)
    want = layer_kernels.norm_hadamard(h_want, norm_w, 1e-5, unit_offset, pres, in_width)
    return h, got, h_want, want


def test_out_norm_twin_is_hadamard_out_then_norm_hadamard():
    h, got, h_want, want = _out_norm_both(3, 640, 576, 640, 2, torch.float32, "cpu", False, 4)
    assert torch.equal(h, h_want) and all(torch.equal(g, w) for g, w in zip(got, want,
                                                                            strict=True))


def test_norm_fold_hands_the_next_layers_input_over_on_cpu(monkeypatch, tmp_path_factory):
    folder = write_fused_shapes(tmp_path_factory, seed=7)["test-hd64"]
    model = load_causal_lm(folder, device="cpu", dtype=torch.bfloat16, linear_mode="trellis")
    ids = torch.tensor([[5, 17, 99, 3, 42]])
    results = {}
    for folds in ("", "norm"):
        monkeypatch.setattr(layer_fold, "FOLDS", layer_fold.fold_names(folds))
        plans = [FusedDecodeLayer.of(layer, force=True) for layer in model.layers]
        for _ in range(2):  # the first forward links the layers, the second hands over
            step = model._plan_step(1, ids.shape[1])
            hidden = model._embed(ids)
            for plan in plans:
                hidden = plan.forward(hidden, step)
        linked = [p.successor is q for p, q in zip(plans, plans[1:], strict=False)]
        assert all(linked) == (folds == "norm") and any(linked) == (folds == "norm")
        results[folds] = hidden
    assert torch.equal(results[""], results["norm"])


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, width, cols, in_width, nparts, unit_offset", [
    (1, 4096, 4096, 4096, 2, False), (7, 640, 576, 640, 2, True),
    (64, 1024, 1024, 1024, 3, False), (2, 2048, 2048, 2048, 1, False)])
def test_out_norm_kernel_gives_the_bits_of_the_two_launches(dtype, rows, width, cols, in_width,
                                                            nparts, unit_offset):
    assert hasattr(layer_kernels._ext(torch.empty(1, device="cuda")), "out_norm")
    counters = layer_fold.out_norm_counters(torch.device("cuda"))
    for seed in (1, 2):  # twice: the tickets are back at zero after each launch
        h, got, h_want, want = _out_norm_both(rows, width, cols, in_width, nparts, dtype,
                                              "cuda", unit_offset, seed, counters)
        assert torch.equal(h, h_want)
        for g, w in zip(got, want, strict=True):
            assert not g.isnan().any() and torch.equal(g, w)
        assert (counters == 0).all()
