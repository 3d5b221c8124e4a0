"""Fused CPU decode ops (csrc/ops/cpu/decode_ops.cpp) against their PyTorch twins in
exl3cli/ops/cpu_kernels.py, and whole models on the fused path against the pure-PyTorch
fallback (EXL3_NO_EXT=1) and transformers: same greedy tokens, logits within float32
rounding, for the contiguous and the paged cache."""

from __future__ import annotations

import shutil

import pytest
import torch

from exl3cli.engine.kvcache.kv_quant import parse_kv_cache_type
from exl3cli.engine.kvcache.paged_attention import PagedBatch
from exl3cli.engine.kvcache.paged_cache import PagePool, PageTable
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.ops import cpu_kernels
from tests.fixtures.tiny_model import tiny_reference_model, write_tiny_model


@pytest.fixture(autouse=True)
def _kernels_built() -> None:
    if shutil.which("c++") and shutil.which("ninja"):
        assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
    else:
        pytest.fail(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(fast: torch.Tensor, ref: torch.Tensor, tol: float = 1e-5) -> None:
    assert fast.shape == ref.shape and fast.dtype == ref.dtype
    scale = max(float(ref.abs().max()), 1.0)
    assert float((fast - ref).abs().max()) <= tol * scale


@pytest.mark.parametrize("shape", [(1, 576), (3, 64), (2, 5, 100), (4, 7)])
def test_rms_norm_and_residual_add(shape: tuple[int, ...]) -> None:
    g = _gen(len(shape) * 100 + shape[-1])
    x, r = torch.randn(shape, generator=g) * 3, torch.randn(shape, generator=g)
    w = torch.randn(shape[-1], generator=g)
    _close(cpu_kernels.rms_norm_cpu(x, w, 1e-5), cpu_kernels.rms_norm_reference(x, w, 1e-5))
    total, normed = cpu_kernels.add_rms_norm_cpu(x, r, w, 1e-6)
    ref_total, ref_normed = cpu_kernels.add_rms_norm_reference(x, r, w, 1e-6)
    assert torch.equal(total, ref_total)  # one float add per element either way
    _close(normed, ref_normed)


@pytest.mark.parametrize("dim", [64, 24, 2])
def test_rotary_in_place_on_leading_heads(dim: int) -> None:
    g = _gen(dim)
    rows, heads = 3, 5
    base = torch.randn(rows, heads + 2, dim, generator=g)
    angles = torch.randn(rows, dim // 2, generator=g).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    fast, ref = base.clone(), base.clone()
    out = cpu_kernels.rotary_cpu(fast, cos, sin, heads)
    cpu_kernels.rotary_reference(ref, cos, sin, heads)
    assert out.data_ptr() == fast.data_ptr()  # in place
    _close(fast, ref)
    assert torch.equal(fast[:, heads:], base[:, heads:])  # the other heads untouched
    # Strided rows (a column slice of a wider projection) rotate the same way.
    wide = torch.randn(rows, heads + 4, dim, generator=g)
    view, copy = wide[:, 1 : heads + 3], wide[:, 1 : heads + 3].clone()
    cpu_kernels.rotary_cpu(view, cos, sin, heads)
    cpu_kernels.rotary_reference(copy, cos, sin, heads)
    _close(view, copy)


def test_silu_mul() -> None:
    gate_up = torch.randn(3, 2 * 1536, generator=_gen(5)) * 6
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturating inputs
    _close(cpu_kernels.silu_mul_cpu(gate_up), cpu_kernels.silu_mul_reference(gate_up))


# (batch, heads, kv_heads, dim, span): GQA groups of 3 and 1, a dim that is not a
# multiple of 16, a single key.
ATTENTION_SHAPES = [(1, 9, 3, 64, 520), (2, 4, 4, 24, 37), (3, 6, 2, 16, 1), (1, 2, 1, 128, 300)]


@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_attend_decode_contiguous_cache(shape: tuple[int, ...]) -> None:
    batch, heads, kv_heads, dim, span = shape
    g = _gen(sum(shape))
    q = torch.randn(batch, heads, dim, generator=g)
    # Views of a longer buffer (strided rows), as a cache layer may hand them over.
    keys = torch.randn(batch, kv_heads, span + 9, dim, generator=g)[:, :, :span]
    values = torch.randn(batch, kv_heads, span + 9, dim, generator=g)[:, :, :span]
    _close(cpu_kernels.attend_decode_cpu(q, keys, values),
           cpu_kernels.attend_decode_reference(q, keys, values))
    lengths = torch.randint(1, span + 1, (batch,), generator=g)
    for window in (None, 5):
        fast = cpu_kernels.attend_decode_cpu(q, keys, values, None, lengths, window)
        _close(fast, cpu_kernels.attend_decode_reference(q, keys, values, None, lengths, window))


@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_attend_decode_paged_store(shape: tuple[int, ...]) -> None:
    batch, heads, kv_heads, dim, span = shape
    g = _gen(sum(shape) + 1)
    q = torch.randn(batch, heads, dim, generator=g)
    store_k = torch.randn(span * batch + 50, kv_heads, dim, generator=g)
    store_v = torch.randn(span * batch + 50, kv_heads, dim, generator=g)
    slots = torch.randperm(store_k.shape[0], generator=g)[: batch * span].view(batch, span)
    lengths = torch.randint(1, span + 1, (batch,), generator=g)
    for window in (None, 7):
        fast = cpu_kernels.attend_decode_cpu(q, store_k, store_v, slots, lengths, window)
        ref = cpu_kernels.attend_decode_reference(q, store_k, store_v, slots, lengths, window)
        _close(fast, ref)
    # The paged reference reads the same values as the contiguous one.
    contiguous_k = store_k[slots].transpose(1, 2)
    contiguous_v = store_v[slots].transpose(1, 2)
    _close(cpu_kernels.attend_decode_cpu(q, store_k, store_v, slots, lengths),
           cpu_kernels.attend_decode_reference(q, contiguous_k, contiguous_v, None, lengths))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [(1, 576, 1000), (3, 40, 71), (8, 64, 3)])
def test_gemv_rows_head(dtype: torch.dtype, size: tuple[int, int, int]) -> None:
    rows, k, n = size
    g = _gen(rows * k + n)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g).to(dtype)
    fast = cpu_kernels.gemv_rows_cpu(x, w)
    ref = cpu_kernels.gemv_rows_reference(x, w)
    assert float((fast - ref).abs().max()) <= 1e-5 * float((x.abs() @ w.float().abs().t()).max())


@pytest.mark.parametrize("mode", ["fp32", "bf16", "int8"])
def test_layer_chains_match_their_references(mode: str) -> None:
    g = _gen(7)
    hidden, heads, kv_heads, dim, inter, rows = 96, 6, 2, 16, 80, 2

    def packed(n: int, k: int, bias: bool = False) -> cpu_kernels.GemvWeights:
        w, s = cpu_kernels.pack_gemv_weight(torch.randn(n, k, generator=g) / k**0.5, mode)
        return cpu_kernels.GemvWeights(w, s, torch.randn(n, generator=g) if bias else None, n)

    qkv = packed((heads + 2 * kv_heads) * dim, hidden, bias=True)
    o, gate_up, down = packed(hidden, heads * dim), packed(2 * inter, hidden), packed(hidden, inter)
    x = torch.randn(rows, hidden, generator=g)
    w1, w2 = torch.rand(hidden, generator=g) + 0.5, torch.rand(hidden, generator=g) + 0.5
    angles = torch.randn(rows, dim // 2, generator=g).repeat(1, 2)
    args = (x, w1, 1e-5, qkv, angles.cos(), angles.sin(), dim, heads + kv_heads)
    _close(cpu_kernels.norm_qkv_rope_cpu(*args), cpu_kernels.norm_qkv_rope_reference(*args))
    attn = torch.randn(rows, heads * dim, generator=g)
    args = (x, attn, o, w2, 1e-5, gate_up, down)
    _close(cpu_kernels.out_mlp_cpu(*args), cpu_kernels.out_mlp_reference(*args))


# --- whole models: fused path vs the pure-PyTorch fallback ---

CASES = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),  # q/k norm: layers keep the per-op path
    "mistral_window": ("mistral", {"sliding_window": 12}),
    "llama_dim24": ("llama", {"hidden_size": 72, "num_attention_heads": 3,
                              "num_key_value_heads": 1}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
}


@pytest.fixture(scope="module")
def model_pairs(tmp_path_factory):
    """name -> (fused model, fallback model, transformers model) on the same weights."""
    root = tmp_path_factory.mktemp("cpu_decode_ops")
    pairs = {}
    with pytest.MonkeyPatch.context() as patch:
        for name, (arch, extra) in CASES.items():
            folder = write_tiny_model(root / name, arch, **extra)
            patch.delenv("EXL3_NO_EXT", raising=False)
            fused = load_causal_lm(folder, "cpu")
            patch.setenv("EXL3_NO_EXT", "1")
            fallback = load_causal_lm(folder, "cpu")
            pairs[name] = (fused, fallback, tiny_reference_model(arch, **extra))
    return pairs


def _greedy_whole(model, prompt: torch.Tensor, steps: int):
    """Greedy decoding by whole-sequence forwards (no cache): the fused prompt path."""
    ids = prompt
    logits = model(ids, last_logits_only=True)[:, -1]
    tokens, all_logits = [], [logits]
    for _ in range(steps):
        token = logits.argmax(-1, keepdim=True)
        tokens.append(int(token))
        ids = torch.cat([ids, token], dim=1)
        logits = model(ids, last_logits_only=True)[:, -1]
        all_logits.append(logits)
    return tokens, torch.cat(all_logits)


def _greedy_paged(model, prompt: torch.Tensor, steps: int):
    config = model.config
    pool = PagePool(8, len(model.layers), config.num_kv_heads, config.head_dim, model.dtype,
                    model.device, parse_kv_cache_type("fp16"), page_size=16)
    table = PageTable(pool)
    ids = prompt[0].tolist()
    assert table.admit(ids, len(ids) + steps + 1)
    logits = model(prompt, PagedBatch(pool, [table], [ids]), last_logits_only=True)[0, -1:]
    tokens, all_logits = [], [logits]
    for _ in range(steps):
        token = int(logits.argmax())
        tokens.append(token)
        logits = model(torch.tensor([[token]]), PagedBatch(pool, [table], [[token]]),
                       last_logits_only=True)[0, -1:]
        all_logits.append(logits)
    return tokens, torch.cat(all_logits)


def _without_kernels(monkeypatch, run, *args):
    """Run with EXL3_NO_EXT=1: modules that decide on first use pick the PyTorch path."""
    monkeypatch.setenv("EXL3_NO_EXT", "1")
    try:
        return run(*args)
    finally:
        monkeypatch.delenv("EXL3_NO_EXT")


@pytest.mark.parametrize("name", list(CASES))
def test_fused_model_decodes_like_the_fallback(model_pairs, monkeypatch, name: str) -> None:
    fused, fallback, reference = model_pairs[name]
    monkeypatch.delenv("EXL3_NO_EXT", raising=False)
    prompt = torch.randint(3, 300, (1, 21), generator=_gen(11))
    steps = 24  # past the sliding window and across several 16-slot pages
    for run in (_greedy_whole, _greedy_paged):
        fused_tokens, fused_logits = run(fused, prompt, steps)
        plain_tokens, plain_logits = _without_kernels(monkeypatch, run, fallback, prompt, steps)
        assert fused_tokens == plain_tokens, run.__name__
        assert torch.allclose(fused_logits, plain_logits, atol=1e-4, rtol=1e-4), run.__name__
    # And both match transformers on the whole sequence.
    sequence = torch.cat([prompt, torch.tensor([fused_tokens])], dim=1)
    with torch.no_grad():
        expected = reference(sequence).logits[0, prompt.shape[1] - 1 :]
    assert float((fused_logits - expected).abs().max()) < 1e-3


def test_fused_path_is_taken_and_fallback_keeps_pytorch(model_pairs, monkeypatch) -> None:
    fused, fallback, _ = model_pairs["llama_tied"]
    monkeypatch.delenv("EXL3_NO_EXT", raising=False)
    _greedy_paged(fused, torch.tensor([[5, 6, 7]]), 2)
    _without_kernels(monkeypatch, _greedy_paged, fallback, torch.tensor([[5, 6, 7]]), 2)
    assert all(layer._decode_plan() is not None for layer in fused.layers)
    assert fused._head_gemv is True
    assert all(layer._decode_plan() is None for layer in fallback.layers)
    assert not fallback.final_norm._fused and fallback._head_gemv is not True
    # A decode step over an unquantized float32 page pool reads the pages in place.
    config = fused.config
    pool = PagePool(2, len(fused.layers), config.num_kv_heads, config.head_dim, fused.dtype,
                    fused.device, parse_kv_cache_type("fp16"), page_size=16)
    table = PageTable(pool)
    assert table.admit([5, 6, 7], 8)
    prompt = PagedBatch(pool, [table], [[5, 6, 7]])
    fused(torch.tensor([[5, 6, 7]]), prompt)
    assert PagedBatch(pool, [table], [[8]])._fused
    quantized = PagePool(2, len(fused.layers), config.num_kv_heads, config.head_dim,
                         fused.dtype, fused.device, parse_kv_cache_type("q8"), page_size=16)
    table = PageTable(quantized)
    assert table.admit([5], 4)
    assert not PagedBatch(quantized, [table], [[5]])._fused  # codes: the PyTorch path


def test_attend_decode_rejects_slots_outside_the_store() -> None:
    q, store = torch.randn(1, 2, 16), torch.randn(10, 1, 16)
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_kernels.attend_decode_cpu(q, store, store, torch.tensor([[0, 10]]))


@pytest.mark.parametrize("span", [128, 256, 700])
def test_attend_decode_split_positions_same_for_any_thread_count(span: int) -> None:
    # One decode row over several 128-position chunks: the chunks run on the threads and
    # merge in a fixed order, so 1 and 2 threads give the same bits, close to the reference.
    g = _gen(span)
    q = torch.randn(1, 9, 64, generator=g)
    keys = torch.randn(1, 3, span, 64, generator=g) * 2
    values = torch.randn(1, 3, span, 64, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.attend_decode_cpu(q, keys, values)
        torch.set_num_threads(2)
        two = cpu_kernels.attend_decode_cpu(q, keys, values)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    _close(one, cpu_kernels.attend_decode_reference(q, keys, values))
