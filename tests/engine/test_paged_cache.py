import pytest
import torch

from exl3cli.engine.kvcache.kv_quant import KVCacheType
from exl3cli.engine.kvcache.paged_cache import ROOT_HASH, PagePool, PageTable, chain_hash

SIZE = 4  # small pages keep the bookkeeping tests readable


def new_pool(num_pages=6, cache_type=None):
    return PagePool(num_pages, num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                    device="cpu", cache_type=cache_type, page_size=SIZE)


def test_hash_chain_depends_on_the_whole_prefix():
    a = chain_hash(chain_hash(ROOT_HASH, [1, 2, 3, 4]), [5, 6, 7, 8])
    b = chain_hash(chain_hash(ROOT_HASH, [9, 2, 3, 4]), [5, 6, 7, 8])
    assert a != b
    assert a == chain_hash(chain_hash(ROOT_HASH, [1, 2, 3, 4]), [5, 6, 7, 8])


def run_prompt(pool, prompt, max_tokens=None):
    table = PageTable(pool)
    assert table.admit(prompt, max_tokens or len(prompt) + 2)
    table.slots(len(prompt) - table.length)
    table.commit(prompt[table.length:])
    return table


def test_full_pages_are_reused_and_one_prompt_token_is_always_left():
    pool = new_pool()
    first = run_prompt(pool, list(range(10, 20)))  # 2 full pages + 2 tokens
    assert pool.pages_in_use == 3
    second = PageTable(pool)
    assert second.admit(list(range(10, 18)) + [99, 98], 12)
    assert second.reused_tokens == 8 and second.pages == first.pages[:2]
    assert pool.refcounts[first.pages[0]] == 2
    exact = PageTable(pool)
    assert exact.admit(list(range(10, 18)), 9)  # prompt = exactly 2 pages
    assert exact.reused_tokens == 4  # the last page is recomputed for its logits


def test_a_different_first_page_shares_nothing():
    pool = new_pool()
    run_prompt(pool, list(range(10, 20)))
    other = PageTable(pool)
    assert other.admit([0] + list(range(11, 20)), 12)
    assert other.reused_tokens == 0


def test_freed_pages_stay_reusable_until_evicted_lru_first():
    pool = new_pool(num_pages=5)
    old = run_prompt(pool, [1, 2, 3, 4, 5])  # pages: [1..4] published, [5] partial
    newer = run_prompt(pool, [7, 7, 7, 7, 8])
    old.free()
    newer.free()
    assert pool.pages_in_use == 0 and pool.cached_pages == 2 and pool.available == 5
    # Needs 4 pages: the 3 free ones, then the least recently freed cached page (old's).
    filler = run_prompt(pool, [5] * 13, max_tokens=16)
    assert pool.pages_in_use == 4 and pool.cached_pages == 1
    filler.free()
    lost = PageTable(pool)
    assert lost.admit([1, 2, 3, 4, 5], 6)
    assert lost.reused_tokens == 0
    lost.free()
    kept = PageTable(pool)
    assert kept.admit([7, 7, 7, 7, 9], 5)
    assert kept.reused_tokens == 4


def test_reservations_bound_admission_and_free_restores_the_pool():
    pool = new_pool(num_pages=4)
    a = PageTable(pool)
    assert a.admit([1, 2, 3], 12)  # reserves 3 pages
    b = PageTable(pool)
    assert not b.admit([4, 5, 6], 8)  # needs 2, only 1 left
    assert b.pages == [] and pool.reserved == 3
    a.slots(12)
    a.commit([7] * 12)
    with pytest.raises(RuntimeError):
        a.slots(1)  # beyond what it reserved
    a.free()
    assert pool.reserved == 0 and pool.available == 4 and pool.pages_in_use == 0


def test_admission_counts_cached_pages_it_takes_as_used():
    pool = new_pool(num_pages=2)
    first = run_prompt(pool, [1, 2, 3, 4, 5], max_tokens=8)
    first.free()  # page [1..4] cached, the other free
    holder = PageTable(pool)
    assert holder.admit([9], 4)  # reserves one page: the free one or the cached one
    reuser = PageTable(pool)
    # Reusing the cached page would leave the holder's reservation without a page.
    assert not reuser.admit([1, 2, 3, 4, 5], 6)
    holder.slots(1)
    holder.free()


def test_storage_round_trip_plain_and_quantized():
    torch.manual_seed(0)
    # Worst cases from the half-step bound, sqrt(32) * absmax / 2^bits (absmax < 4.5).
    for cache_type, key_tol, value_tol in ((None, 0.0, 0.0), (KVCacheType(8, 4), 0.1, 1.6)):
        pool = new_pool(cache_type=cache_type)
        keys = torch.randn(5, 2, 16)
        values = torch.randn(5, 2, 16)
        slots = torch.tensor([3, 9, 0, 22, 17])
        pool.write(0, slots, keys, values)
        got_k, got_v = pool.read(0, slots.view(5, 1))
        assert got_k.shape == (5, 1, 2, 16)
        assert torch.allclose(got_k[:, 0], keys, atol=key_tol + 1e-7)
        assert torch.allclose(got_v[:, 0], values, atol=value_tol + 1e-7)
        if cache_type is not None:  # 4-bit values are visibly coarser than 8-bit keys
            assert (got_v[:, 0] - values).abs().mean() > 4 * (got_k[:, 0] - keys).abs().mean()


def _stored_bytes_per_slot(pool) -> float:
    tensors = [t for layer in (*pool.keys, *pool.values)
               for t in (layer if isinstance(layer, tuple) else (layer,))]
    return sum(t.numel() * t.element_size() for t in tensors) / (pool.storage_pages * pool.page_size)


@pytest.mark.parametrize("cache_type", [None, KVCacheType(8, 8), KVCacheType(6, 6),
                                        KVCacheType(4, 4), KVCacheType(8, 4)])
def test_reported_bytes_per_token_is_what_the_pool_allocates(cache_type):
    pool = new_pool(cache_type=cache_type)
    assert pool.bytes_per_token() == _stored_bytes_per_slot(pool)


def test_quantized_pool_is_smaller_per_token():
    plain, quantized = new_pool(), new_pool(cache_type=KVCacheType(4, 4))
    # float32 test pool: 4-bit codes are 1/8 of it, plus one float16 scale per 32.
    assert quantized.bytes_per_token() < plain.bytes_per_token() / 6
