"""The paged decode-attention and quantized cache-write kernels (csrc/ops/cuda/paged_attention.cu)
against the PyTorch reference (engine/generation/decode_step.py, kv_quant.py), on the GPU.

Pools with shuffled page tables, lengths across several 256-position chunks, sliding
windows, soft-caps, grouped heads (G = 1..8), head dims 64/128/256, float16/bfloat16
pages and every quantized key/value width. On the CPU only the refusal is checked:
without the extension the wrapper answers None and the reference runs.
"""

from __future__ import annotations

import pytest
import torch

from exl3cli.engine.generation.decode_step import reference_paged_attention
from exl3cli.engine.kvcache.kv_quant import KVCacheType, pack_codes, quantize_rows
from exl3cli.engine.kvcache.paged_cache import PagePool
from exl3cli.ops import cuda_kernels as kernels


def test_no_kernel_on_cpu_means_none():
    q = torch.randn(2, 4, 64)
    store = torch.randn(512, 2, 64)
    table = torch.zeros(2, 1, dtype=torch.long)
    lengths = torch.tensor([3, 5])
    assert kernels.paged_attention(q, store, store, 16, 16, table, lengths, 256, None) is None
    rows = torch.randn(3, 64)
    codes = torch.zeros(512, 32, dtype=torch.uint8)
    scales = torch.zeros(512, 2, dtype=torch.float16)
    assert not kernels.kv_quant_write(rows, torch.tensor([0, 1, 2]), 4, codes, scales)


def _pool(kv_heads, dim, dtype, cache_type, pages, gen):
    pool = PagePool(pages, 1, kv_heads, dim, dtype, "cuda", cache_type)
    slots = torch.arange(pool.storage_pages * pool.page_size, device="cuda")
    keys = torch.randn(len(slots), kv_heads, dim, generator=gen, device="cuda").to(dtype)
    values = torch.randn(len(slots), kv_heads, dim, generator=gen, device="cuda").to(dtype)
    if cache_type is not None and cache_type.quantized:
        # Fill through the reference write so the test does not depend on the kernel.
        for store, rows, bits in ((pool.keys[0], keys, cache_type.key_bits),
                                  (pool.values[0], values, cache_type.value_bits)):
            codes, scales = quantize_rows(rows.reshape(len(slots), -1).float(), bits)
            store[0].copy_(pack_codes(codes, bits))
            store[1].copy_(scales)
    else:
        pool.keys[0].copy_(keys)
        pool.values[0].copy_(values)
    return pool


def _case(batch, heads, kv_heads, dim, dtype, cache_type, window, softcap, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = 12
    pool = _pool(kv_heads, dim, dtype, cache_type, pages, gen)
    width = 5  # pages per row in the table: up to 1280 positions, 5 chunks
    order = torch.randperm(pages + 1, generator=gen, device="cuda")  # scratch page too
    table = torch.stack([order[torch.randperm(pages + 1, generator=gen, device="cuda")[:width]]
                         for _ in range(batch)])
    lengths = torch.randint(1, width * 256 + 1, (batch,), generator=gen, device="cuda")
    lengths[0] = 1
    lengths[-1] = width * 256
    query = torch.randn(batch, heads, dim, generator=gen, device="cuda").to(dtype)
    slots = (table[:, :, None] * 256 + torch.arange(256, device="cuda")).reshape(batch, -1)
    scale = None if softcap is None else 0.3 * dim**-0.5
    kind = pool.cache_type
    got = kernels.paged_attention(query, pool.keys[0], pool.values[0], kind.key_bits,
                                  kind.value_bits, table, lengths, 256, window,
                                  softcap=softcap, scale=scale)
    assert got is not None, "the kernel did not run"
    pool32 = pool if kind.quantized else _pool_as_float(pool)
    want = reference_paged_attention(query.float(), pool32, 0, slots, lengths, window,
                                     softcap, scale)
    error = (got.float() - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)
    assert torch.isfinite(got).all()
    assert error.max() < 2e-2, error.max()
    return got


def _pool_as_float(pool):
    copy = PagePool(pool.num_pages, 1, pool.num_kv_heads, pool.head_dim, torch.float32, "cuda")
    copy.keys[0].copy_(pool.keys[0].float())
    copy.values[0].copy_(pool.values[0].float())
    return copy


@pytest.mark.cuda
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 128), (9, 3, 64), (4, 1, 256),
                                                (8, 8, 128), (14, 2, 64)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_matches_the_reference(heads, kv_heads, dim, dtype):
    _case(6, heads, kv_heads, dim, dtype, None, None, None, seed=heads + dim)


@pytest.mark.cuda
@pytest.mark.parametrize("bits", [(8, 8), (6, 6), (4, 4), (8, 4), (2, 2), (5, 3)])
def test_kernel_reads_quantized_pages(bits):
    _case(5, 32, 8, 128, torch.bfloat16, KVCacheType(*bits), None, None, seed=sum(bits))
    _case(3, 9, 3, 64, torch.float16, KVCacheType(*bits), None, None, seed=7 * bits[0])
    _case(2, 4, 1, 256, torch.float16, KVCacheType(*bits), None, None, seed=3 * bits[1])


@pytest.mark.cuda
@pytest.mark.parametrize("cache_type", [None, KVCacheType(4, 4)])
def test_kernel_gives_the_same_bits_every_run(cache_type):
    # The warps' value sums are added in a fixed order: shared-memory atomics made two
    # generations of one model differ at near-tied tokens.
    first = _case(6, 32, 8, 128, torch.float16, cache_type, None, None, seed=5)
    for _ in range(24):
        again = _case(6, 32, 8, 128, torch.float16, cache_type, None, None, seed=5)
        assert torch.equal(again, first)


@pytest.mark.cuda
@pytest.mark.parametrize("window,softcap", [(300, None), (7, None), (None, 5.0), (512, 3.0)])
def test_kernel_windows_and_softcaps(window, softcap):
    _case(4, 8, 2, 128, torch.bfloat16, None, window, softcap, seed=11)
    _case(4, 8, 2, 128, torch.bfloat16, KVCacheType(8, 4), window, softcap, seed=12)


@pytest.mark.cuda
@pytest.mark.parametrize("bits", [8, 6, 5, 4, 3, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("strided", [False, True])
def test_quantized_write_matches_the_reference(bits, dtype, strided):
    gen = torch.Generator(device="cuda").manual_seed(bits)
    channels, rows = 256, 70
    x = (torch.randn(rows, channels, generator=gen, device="cuda") * 3).to(dtype)
    x[0] = 0  # an all-zero group: scale 0, codes from the tiny-scale guard
    if strided:  # the rows of a wider tensor (k or v of the fused q|k|v projection)
        wide = torch.randn(rows, channels + 96, generator=gen, device="cuda").to(dtype)
        wide[:, 32 : 32 + channels] = x
        x = wide[:, 32 : 32 + channels]
        assert not x.is_contiguous()
    slots = torch.randperm(300, generator=gen, device="cuda")[:rows]
    codes = torch.full((300, channels // 8 * bits), 0xAB, dtype=torch.uint8, device="cuda")
    scales = torch.full((300, channels // 32), 7.0, dtype=torch.float16, device="cuda")
    assert kernels.kv_quant_write(x, slots, bits, codes, scales)
    want_codes, want_scales = quantize_rows(x.float().cpu(), bits)
    # The rotation's summation order may move a value across a rounding boundary: a
    # scale one float16 step up (rarely), a code one step off (rarely).
    got_scales = scales[slots].cpu()
    assert (got_scales != want_scales).float().mean() < 0.01
    torch.testing.assert_close(got_scales, want_scales, rtol=2e-3, atol=0)
    got = codes[slots].cpu()
    want = pack_codes(want_codes, bits)
    assert (got != want).float().mean() < 0.02
    untouched = torch.ones(300, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert (codes.cpu()[untouched] == 0xAB).all()
    assert (scales.cpu()[untouched] == 7.0).all()
