import pytest
import torch

from exl3cli.engine.cache import KVCache
from exl3cli.errors import ContextOverflow


def new_cache(batch=2, length=8):
    return KVCache(num_layers=2, batch_size=batch, max_seq_len=length, num_kv_heads=1,
                   head_dim=2, dtype=torch.float32, device="cpu")


def test_aligned_rows_write_at_the_common_length():
    cache = new_cache()
    keys = torch.ones(2, 1, 3, 2)
    k, v = cache.write(0, keys, keys * 2, torch.arange(3).expand(2, 3), span=3)
    cache.advance([3, 3])
    assert k.shape == (2, 1, 3, 2) and torch.equal(k, keys) and torch.equal(v, keys * 2)
    assert cache.row_lengths() == [3, 3] and cache.lengths.tolist() == [3, 3]
    assert cache.uniform_length() == 3


def test_rows_of_different_lengths_write_at_their_own_positions():
    cache = new_cache()
    cache.advance([2, 5])
    assert cache.uniform_length() is None
    positions = cache.lengths[:, None] + torch.arange(1)
    keys = torch.tensor([[[[1.0, 1.0]]], [[[7.0, 7.0]]]])
    k, _ = cache.write(1, keys, keys, positions, span=6)
    assert k.shape[2] == 6
    assert k[0, 0, 2].tolist() == [1.0, 1.0] and k[1, 0, 5].tolist() == [7.0, 7.0]
    assert k[0, 0, 5].tolist() == [0.0, 0.0]  # row 0 untouched at row 1's position


def test_overflow_truncate_and_reset():
    cache = new_cache(length=4)
    cache.advance([3, 1])
    cache.check_room(1)
    with pytest.raises(ContextOverflow):
        cache.check_room(2)
    cache.truncate(0, 1)
    assert cache.row_lengths() == [1, 1] and cache.lengths.tolist() == [1, 1]
    with pytest.raises(ValueError):
        cache.truncate(1, 2)
    cache.reset([1])
    assert cache.row_lengths() == [1, 0]
    cache.reset()
    assert cache.lengths.tolist() == [0, 0]
