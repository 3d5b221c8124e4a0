"""Request settings the runner reads: KV cache type and parallel slots."""

from __future__ import annotations

import pytest

from exl3cli.errors import InvalidOption
from exl3cli.runtime.options import cache_type_option, default_num_parallel, int_option


def test_cache_type_option_prefers_the_request_then_the_environment(monkeypatch):
    monkeypatch.delenv("EXL3_KV_CACHE_TYPE", raising=False)
    assert cache_type_option({}).name == "fp16"
    assert cache_type_option({"kv_cache_type": "q6"}).key_bits == 6
    monkeypatch.setenv("EXL3_KV_CACHE_TYPE", "k8v4")
    from_env = cache_type_option({})
    assert (from_env.key_bits, from_env.value_bits) == (8, 4)
    assert cache_type_option({"kv_cache_type": "q8"}).name == "q8"
    for bad in ("q99", 8):
        with pytest.raises(InvalidOption):
            cache_type_option({"kv_cache_type": bad})


def test_num_parallel_and_integer_options(monkeypatch):
    monkeypatch.delenv("EXL3_NUM_PARALLEL", raising=False)
    assert default_num_parallel() == 4
    monkeypatch.setenv("EXL3_NUM_PARALLEL", "7")
    assert default_num_parallel() == 7
    monkeypatch.setenv("EXL3_NUM_PARALLEL", "many")
    with pytest.raises(InvalidOption):
        default_num_parallel()
    assert int_option({"num_keep": "5"}, "num_keep") == 5
    assert int_option({}, "num_keep") is None
    with pytest.raises(InvalidOption):
        int_option({"num_keep": "five"}, "num_keep")
