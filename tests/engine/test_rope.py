import math

import pytest
import torch

from exl3cli.engine.layers.rope import RotaryEmbedding, rope_inv_freq
from exl3cli.errors import UnsupportedArchitecture
from exl3cli.ops.reference import apply_rotary


def test_default_frequencies():
    inv_freq = rope_inv_freq(8, 10000.0, {"rope_type": "default"})
    expected = torch.tensor([10000.0 ** (-i / 8) for i in (0, 2, 4, 6)])
    assert torch.allclose(inv_freq, expected)


def test_linear_divides_every_frequency():
    base = rope_inv_freq(16, 10000.0, {"rope_type": "default"})
    assert torch.allclose(rope_inv_freq(16, 10000.0, {"rope_type": "linear", "factor": 4.0}),
                          base / 4)


def test_llama3_keeps_high_and_divides_low_frequencies():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    base = rope_inv_freq(64, 500000.0, {"rope_type": "default"})
    scaled = rope_inv_freq(64, 500000.0, scaling)
    wavelen = 2 * math.pi / base
    high = wavelen < 64 / 4
    low = wavelen > 64 / 1
    assert high.any() and low.any() and (~high & ~low).any()
    assert torch.equal(scaled[high], base[high])
    assert torch.allclose(scaled[low], base[low] / 8)
    middle = ~high & ~low
    assert (scaled[middle] < base[middle]).all() and (scaled[middle] > base[middle] / 8).all()


def test_dynamic_only_changes_past_the_original_length():
    scaling = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 32}
    base = rope_inv_freq(16, 10000.0, {"rope_type": "default"})
    assert torch.equal(rope_inv_freq(16, 10000.0, scaling, seq_len=20), base)
    longer = rope_inv_freq(16, 10000.0, scaling, seq_len=128)
    assert (longer[1:] < base[1:]).all()


def test_unknown_rope_type_is_unsupported():
    with pytest.raises(UnsupportedArchitecture, match="yarn-like"):
        rope_inv_freq(8, 10000.0, {"rope_type": "yarn-like"})


def test_rotation_preserves_norm_and_position_zero_is_identity():
    rope = RotaryEmbedding(8, 10000.0, {"rope_type": "default"}, 64, torch.device("cpu"),
                           torch.float32)
    positions = torch.arange(5)[None]
    cos, sin = rope.lookup(positions, 5)
    x = torch.randn(1, 5, 8)
    rotated = apply_rotary(x, cos, sin)
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.allclose(rotated[:, 0], x[:, 0])
    assert not torch.allclose(rotated[:, 1:], x[:, 1:])
    # Relative property: <R(p) q, R(p + d) k> depends only on d.
    q, k = torch.randn(8), torch.randn(8)
    cos, sin = rope.lookup(torch.tensor([0, 3, 10, 13]), 14)
    r = apply_rotary(torch.stack([q, k, q, k]), cos, sin)
    assert torch.allclose(r[0] @ r[1], r[2] @ r[3], atol=1e-4)


def _transformers_rope(scaling: dict, head_dim: int = 32, theta: float = 10000.0,
                       max_position: int = 256, seq_len: int | None = None):
    """transformers' own (inv_freq, attention factor) for a Llama config with `scaling`."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=max_position,
        rope_parameters={"rope_theta": theta, **scaling})
    return ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu", seq_len=seq_len)


YARN_CASES = {
    "qwen2.5_128k": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "deepseek_mscale": {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0,
                        "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
                        "original_max_position_embeddings": 64},
    "no_truncate": {"rope_type": "yarn", "factor": 8.0, "truncate": False,
                    "original_max_position_embeddings": 128},
    "given_attention_factor": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3,
                               "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("case", sorted(YARN_CASES))
def test_yarn_matches_transformers(case):
    from exl3cli.engine.layers.rope import rope_attention_factor

    scaling = YARN_CASES[case]
    expected, factor = _transformers_rope(scaling)
    ours = {**scaling, "max_position": 256}
    assert torch.allclose(rope_inv_freq(32, 10000.0, ours), expected, rtol=1e-6)
    assert rope_attention_factor(ours) == pytest.approx(factor)
    assert factor != 1.0 and not torch.allclose(expected, rope_inv_freq(32, 10000.0, {}))


@pytest.mark.parametrize("seq_len", [None, 30, 100])
def test_longrope_matches_transformers_on_both_sides_of_the_original_length(seq_len):
    from exl3cli.engine.layers.rope import rope_attention_factor

    gen = torch.Generator().manual_seed(0)
    scaling = {"rope_type": "longrope", "original_max_position_embeddings": 64,
               "short_factor": (1 + torch.rand(16, generator=gen)).tolist(),
               "long_factor": (2 + 4 * torch.rand(16, generator=gen)).tolist()}
    expected, factor = _transformers_rope(scaling, seq_len=seq_len)
    ours = {**scaling, "max_position": 256}
    assert torch.allclose(rope_inv_freq(32, 10000.0, ours, seq_len=seq_len), expected)
    assert rope_attention_factor(ours) == pytest.approx(factor)  # sqrt(1 + ln 4 / ln 64)


def test_longrope_table_switches_to_long_factors_past_the_original_length():
    scaling = {"rope_type": "longrope", "original_max_position_embeddings": 8,
               "short_factor": [1.0] * 4, "long_factor": [4.0] * 4}
    rope = RotaryEmbedding(8, 10000.0, scaling, 32, torch.device("cpu"), torch.float32)
    assert rope.dynamic  # the table depends on the sequence length
    position = torch.tensor([[3]])
    short = rope.lookup(position, 8)[0].clone()
    long = rope.lookup(position, 9)[0]
    assert not torch.allclose(short, long)
    scale = math.sqrt(1 + math.log(4) / math.log(8))
    assert rope.lookup(torch.tensor([[0]]), 9)[0].max().item() == pytest.approx(scale)


def test_mrope_sections_match_transformers_and_reduce_to_plain_rope():
    import transformers
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

    config = transformers.Qwen2_5_VLTextConfig(
        hidden_size=64, num_attention_heads=4, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    reference = Qwen2_5_VLRotaryEmbedding(config)
    rotary = RotaryEmbedding(16, 10000.0, {"rope_type": "default"}, 64, torch.device("cpu"),
                             torch.float32)
    positions = torch.randint(0, 40, (3, 2, 9), generator=torch.Generator().manual_seed(0))
    cos, sin = rotary.lookup_sections(positions, 64, [2, 3, 3])
    expected_cos, expected_sin = reference(torch.zeros(1, dtype=torch.float32), positions)
    assert (cos - expected_cos).abs().max() < 1e-6 and (sin - expected_sin).abs().max() < 1e-6
    same = positions[:1].expand(3, -1, -1)
    plain_cos, plain_sin = rotary.lookup(same[0], 64)
    cos, sin = rotary.lookup_sections(same, 64, [2, 3, 3])
    assert torch.equal(cos, plain_cos) and torch.equal(sin, plain_sin)
    with pytest.raises(UnsupportedArchitecture, match="do not cover"):
        rotary.lookup_sections(positions, 64, [2, 2, 2])


def test_dynamic_ntk_prompt_and_decode_match_transformers_cached_decode(tmp_path):
    """Dynamic NTK past the trained length (transformers reads it from
    max_position_embeddings): the prompt and 20 greedy tokens through our paged cache
    against transformers decoding through its own cache. Both rotate each new key with
    the frequencies of the length so far (a full-sequence forward would re-rotate the
    old keys too, so it is not the reference for a cached decode)."""
    from exl3cli.engine.models.loader import load_causal_lm
    from tests.fixtures.paged import PagedSequences
    from tests.fixtures.tiny_model import tiny_reference_model, write_tiny_model

    overrides = {"max_position_embeddings": 8,
                 "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}
    model = load_causal_lm(write_tiny_model(tmp_path, "llama", **overrides), device="cpu")
    reference = tiny_reference_model("llama", **overrides)
    prompt = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(1))
    seqs = PagedSequences(model, 1, 12 + 20)
    ours = torch.stack(seqs.feed(prompt))
    with torch.no_grad():
        out = reference(prompt, use_cache=True)
    theirs, past = out.logits.float(), out.past_key_values
    worst = (ours - theirs).abs().max().item()
    for _ in range(20):
        token = ours[:, -1].argmax(-1, keepdim=True)
        assert torch.equal(token, theirs[:, -1].argmax(-1, keepdim=True))
        ours = torch.stack(seqs.feed(token))
        with torch.no_grad():
            out = reference(token, past_key_values=past, use_cache=True)
        theirs, past = out.logits.float(), out.past_key_values
        worst = max(worst, (ours - theirs).abs().max().item())
    assert worst < 1e-3
    # The scaling is in force: plain rope gives other logits over the same tokens.
    plain = load_causal_lm(write_tiny_model(tmp_path / "plain", "llama",
                                            max_position_embeddings=8), device="cpu")
    assert (plain(prompt) - model(prompt)).abs().max() > 1e-2
