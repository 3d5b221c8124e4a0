import pytest
import torch

from exl3cli.engine.kvcache.kv_quant import parse_kv_cache_type
from exl3cli.engine.kvcache.paged_attention import PagedBatch, attend_chunk, attend_decode
from exl3cli.engine.kvcache.paged_cache import PagePool, PageTable
from exl3cli.engine.models.loader import load_causal_lm
from tests.fixtures.tiny_model import write_tiny_model

PAGE = 16  # small pages: a short prompt already spans many of them


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("paged")
    cases = {
        "llama": ("llama", {}),
        "qwen3": ("qwen3", {}),  # q/k norm, head_dim 32
        "mistral_window": ("mistral", {"sliding_window": 20}),
    }
    return {name: load_causal_lm(write_tiny_model(root / name, arch, **extra), "cpu")
            for name, (arch, extra) in cases.items()}


def new_pool(model, kv_cache_type="fp16", pages=32):
    config = model.config
    return PagePool(pages, len(model.layers), config.num_kv_heads, config.head_dim,
                    model.dtype, model.device, parse_kv_cache_type(kv_cache_type),
                    page_size=PAGE)


def paged_logits(model, ids, chunks, kv_cache_type="fp16"):
    """Full logits of `ids` [T], fed through a paged cache in chunks of the given sizes."""
    pool = new_pool(model, kv_cache_type)
    table = PageTable(pool)
    assert table.admit(ids.tolist(), len(ids))
    outputs, start = [], 0
    for size in chunks:
        piece = ids[start : start + size]
        outputs.append(model.forward(piece[None], PagedBatch(pool, [table], [piece.tolist()])))
        start += size
    assert start == len(ids) and table.length == len(ids)
    return torch.cat(outputs, dim=1)[0]


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral_window"])
def test_paged_forward_matches_the_contiguous_model(models, name):
    model = models[name]
    torch.manual_seed(1)
    ids = torch.randint(3, 300, (70,))
    reference = model.forward(ids[None])[0]
    # A prompt chunk, chunks across page boundaries, then single decode tokens.
    got = paged_logits(model, ids, [23, 17, 26, 1, 1, 1, 1])
    assert torch.allclose(got, reference, atol=1e-4, rtol=1e-4)


def test_mixed_step_equals_separate_steps(models):
    """One forward over a decoding sequence and a prompt chunk of another gives each
    the logits it gets alone."""
    model = models["mistral_window"]
    torch.manual_seed(2)
    a, b = torch.randint(3, 300, (41,)), torch.randint(3, 300, (30,))
    alone_a = paged_logits(model, a, [40, 1])[-1]
    alone_b = paged_logits(model, b, [30])[-1]
    pool = new_pool(model)
    table_a, table_b = PageTable(pool), PageTable(pool)
    assert table_a.admit(a.tolist(), 41) and table_b.admit(b.tolist(), 30)
    model.forward(a[None, :40], PagedBatch(pool, [table_a], [a[:40].tolist()]))
    batch = PagedBatch(pool, [table_a, table_b], [a[40:].tolist(), b.tolist()])
    both = model.forward(torch.cat([a[40:], b])[None], batch, last_logits_only=True)[0]
    assert both.shape == (2, model.config.vocab_size)
    assert torch.allclose(both[0], alone_a, atol=1e-4)
    assert torch.allclose(both[1], alone_b, atol=1e-4)
    assert table_a.length == 41 and table_b.length == 30


def test_decode_and_chunk_attention_agree():
    torch.manual_seed(3)
    keys, values = torch.randn(2, 37, 2, 8), torch.randn(2, 37, 2, 8)
    query = torch.randn(2, 4, 8)
    lengths = torch.tensor([37, 25])
    for window in (None, 10):
        batched = attend_decode(query, keys, values, lengths, window)
        for row, length in enumerate(lengths.tolist()):
            single = attend_chunk(query[row][:, None], keys[row, :length], values[row, :length],
                                  length - 1, window)
            assert torch.allclose(batched[row], single[:, 0], atol=1e-5)


def test_quantized_cache_logits_track_the_fp16_cache(models):
    """The random tiny model has large weights (peaky attention), a harsh case; the
    error still falls by ~2x per bit and q8 stays close to fp16."""
    model = models["llama"]
    torch.manual_seed(4)
    ids = torch.randint(3, 300, (64,))
    plain = paged_logits(model, ids, [40, 24])
    quantized = {kind: paged_logits(model, ids, [40, 24], kind)
                 for kind in ("q8", "q6", "q4", "k8v4")}
    errors = {kind: float((logits - plain).abs().mean()) for kind, logits in quantized.items()}
    assert errors["q8"] * 3 < errors["q6"] and errors["q6"] * 2 < errors["q4"]
    assert errors["q8"] < errors["k8v4"] < errors["q4"]  # 4-bit values cost, 8-bit keys help
    reference = plain.log_softmax(-1)
    q8 = quantized["q8"].log_softmax(-1)
    kl = float((reference.exp() * (reference - q8)).sum(-1).mean())
    assert kl < 1e-3
    assert float((quantized["q8"].argmax(-1) == plain.argmax(-1)).float().mean()) > 0.9


def test_paged_step_rejects_a_wrong_input_shape(models):
    model = models["llama"]
    pool = new_pool(model)
    table = PageTable(pool)
    assert table.admit([5, 6, 7], 3)
    with pytest.raises(ValueError):
        model.forward(torch.tensor([[5, 6]]), PagedBatch(pool, [table], [[5, 6, 7]]))
