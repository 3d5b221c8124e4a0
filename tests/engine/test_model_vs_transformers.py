"""The engine's logits must match transformers' on the same checkpoint.

Every family is checked over a prompt and 20 greedily decoded tokens fed through our
KV cache one at a time; transformers runs the full sequence at once, eager attention.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from exl3cli.engine.models.loader import load_causal_lm
from tests.fixtures.paged import PagedSequences
from tests.fixtures.tiny_model import tiny_reference_model, write_tiny_model

TOLERANCE = 1e-3
DECODE_STEPS = 20

LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    # Small original context so the prompt positions reach the scaled band.
    "original_max_position_embeddings": 16,
}

# head_dim 16: 8 factors each (LongRoPE scales every frequency by its own factor).
PHI3_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 2.0, 3.0, 4.0],
                 "long_factor": [1.0, 1.5, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0]}

CASES = {
    "llama": ("llama", {}),
    "llama3_rope_scaling": ("llama", {"rope_scaling": LLAMA3_SCALING, "rope_theta": 500000.0}),
    "llama_tied_embeddings": ("llama", {"tie_word_embeddings": True}),
    "mistral_sliding_window": ("mistral", {"sliding_window": 6, "num_hidden_layers": 3}),
    "qwen2": ("qwen2", {}),
    # Qwen2.5's 128k configs: YaRN with a small original context so positions reach it.
    "qwen2_yarn": ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 16}}),
    "qwen2_sliding_window": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1,
         "num_hidden_layers": 3},
    ),
    "qwen3": ("qwen3", {}),
    # Gemma (tests/fixtures/tiny_model.py GEMMA_CONFIG): tied embeddings, window 6 over
    # 3 layers, query_pre_attn_scalar 24 != head_dim 32; see also test_gemma.py.
    "gemma2": ("gemma2", {}),  # transformers' default caps (50 on scores, 30 on logits)
    "gemma2_small_softcaps": (
        "gemma2", {"attn_logit_softcapping": 3.0, "final_logit_softcapping": 5.0},
    ),
    "gemma3": ("gemma3", {}),  # q/k norms, local rope 1e4 on sliding layers, global 1e6
    "gemma3_untied_global_rope_scaling": (
        "gemma3",
        {"tie_word_embeddings": False, "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    ),
    # Mixture of experts (4 experts, top 2; see also test_moe.py).
    "mixtral": ("mixtral", {}),
    "mixtral_sliding_window": ("mixtral", {"sliding_window": 6}),
    "qwen2_moe": ("qwen2_moe", {}),  # shared expert and its sigmoid gate, no renorm
    "qwen2_moe_dense_layer_renormalised": (
        "qwen2_moe", {"mlp_only_layers": [1], "norm_topk_prob": True},
    ),
    "qwen3_moe": ("qwen3_moe", {"norm_topk_prob": True}),
    "qwen3_moe_sparse_step": ("qwen3_moe", {"decoder_sparse_step": 2, "num_hidden_layers": 3}),
    # Phi-3: fused qkv_proj / gate_up_proj; LongRoPE short factors (the test's sequences
    # stay within original_max_position_embeddings) and long ones (they pass it at 8).
    "phi3": ("phi3", {"sliding_window": 6}),
    "phi3_longrope_short": ("phi3", {"rope_scaling": PHI3_LONGROPE}),
    "phi3_longrope_long": ("phi3", {"rope_scaling": PHI3_LONGROPE,
                                    "original_max_position_embeddings": 8}),
    "phi3_partial_rotary": ("phi3", {"partial_rotary_factor": 0.5}),  # Phi-4-mini's kind
    # Interleaved rope pairs; ERNIE 4.5 MoE adds the expert-choice bias, shared experts
    # and a dense first layer; GLM-4 rotates half of each head, sandwich norms.
    "ernie4_5": ("ernie4_5", {}),
    "ernie4_5_moe": ("ernie4_5_moe", {}),
    "glm4": ("glm4", {}),
    # Sigmoid router with choice bias and grouped top-k, shared expert, dense layer 0,
    # rope over half of each head; with and without q/k norms.
    "glm4_moe": ("glm4_moe", {}),
    "exaone4": ("exaone4", {}),  # post-norm blocks, q/k norms
    # EXAONE 4.0 32B's kind: three sliding layers, then a global one without rope.
    "exaone4_sliding": ("exaone4", {"sliding_window": 6, "num_hidden_layers": 4}),
    "olmo2": ("olmo2", {}),  # post-norm blocks, q/k norms over all heads
    "olmo3": ("olmo3", {}),  # and sliding layers
    "smollm3": ("smollm3", {}),  # a layer without rope
    # LayerNorm, parallel block, interleaved rope, logit scale; q/k LayerNorms; Cohere2's
    # sliding layers and rope-less global layer.
    "cohere": ("cohere", {}),
    "cohere_qk_norm": ("cohere", {"use_qk_norm": True}),
    "cohere2": ("cohere2", {}),
    "glm4_moe_qk_norm": ("glm4_moe", {"use_qk_norm": True}),
    # Attention sinks, biases everywhere, sliding/full layers alternating, YaRN; experts
    # stored fused (gate/up interleaved), router with bias over top-k logits, clamped
    # SwiGLU (limit 1.5 so the clamps bite).
    "gpt_oss": ("gpt_oss", {}),
    # YaRN and a query scale growing with the position; Mistral 3's image-text wrapper
    # (text model under language_model., tied head, vision tower not loaded).
    "ministral3": ("ministral3", {}),
    "mistral3": ("mistral3", {}),
    # Multi-head latent attention (query latent, v heads narrower than k heads, YaRN
    # mscale in the score scale), interleaved and half-split rope pairs, no query latent.
    "deepseek_v3": ("deepseek_v3", {}),
    # Qwen2.5-VL's language model in its image-text wrapper, text only (M-RoPE with the
    # same position on all three axes is 1-D rope); tied like the 3B.
    "qwen2_5_vl": ("qwen2_5_vl", {}),
    "qwen2_5_vl_tied": ("qwen2_5_vl", {"tie_word_embeddings": True}),
    "deepseek_v3_plain_rope_no_q_latent": ("deepseek_v3", {"rope_interleave": False,
                                                           "q_lora_rank": None}),
}


def reference_logits(arch: str, overrides: dict, ids: torch.Tensor) -> torch.Tensor:
    model = tiny_reference_model(arch, **dict(overrides))
    with torch.no_grad():
        return model(ids).logits.float()


def greedy_decode(model, prompt: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(all token ids, logits of every position) decoding over the paged cache one token a
    step, as the generator does."""
    seqs = PagedSequences(model, prompt.shape[0], prompt.shape[1] + steps)
    logits = [torch.stack(seqs.feed(prompt))]
    tokens = [prompt]
    for _ in range(steps):
        next_token = logits[-1][:, -1].argmax(-1, keepdim=True)
        tokens.append(next_token)
        logits.append(torch.stack(seqs.feed(next_token)))
    assert seqs.lengths == [prompt.shape[1] + steps] * prompt.shape[0]
    return torch.cat(tokens, dim=1)[:, :-1], torch.cat(logits, dim=1)[:, :-1]


@pytest.mark.parametrize("case", sorted(CASES))
def test_prompt_and_greedy_decode_match_transformers(tmp_path, case):
    arch, overrides = CASES[case]
    folder = write_tiny_model(tmp_path / case, arch, **dict(overrides))
    model = load_causal_lm(folder, device="cpu")
    assert model.dtype == torch.float32
    prompt = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(1))

    full = model(prompt)
    expected_prompt = reference_logits(arch, overrides, prompt)
    assert full.dtype == torch.float32 and full.shape == (1, 12, 300)
    assert (full - expected_prompt).abs().max() < TOLERANCE

    ids, decoded_logits = greedy_decode(model, prompt, DECODE_STEPS)
    expected = reference_logits(arch, overrides, ids)
    assert ids.shape[1] == 12 + DECODE_STEPS - 1
    assert (decoded_logits - expected).abs().max() < TOLERANCE
    # The reference picks the same greedy tokens.
    assert torch.equal(expected[:, 11:-1].argmax(-1), ids[:, 12:])


def test_sliding_window_changes_the_result(tmp_path):
    """Guards the sliding-window cases above against testing nothing."""
    ids = torch.randint(3, 300, (1, 24), generator=torch.Generator().manual_seed(2))
    windowed = load_causal_lm(write_tiny_model(tmp_path / "w", "mistral", sliding_window=6), "cpu")
    unwindowed = load_causal_lm(write_tiny_model(tmp_path / "u", "mistral", sliding_window=None), "cpu")
    early, late = slice(0, 6), slice(12, 24)
    assert (windowed(ids)[:, early] - unwindowed(ids)[:, early]).abs().max() < 1e-5
    assert (windowed(ids)[:, late] - unwindowed(ids)[:, late]).abs().max() > 1e-2


def test_sharded_checkpoint_matches_transformers(tmp_path):
    folder = write_tiny_model(tmp_path, "qwen2", shards=True)
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    ids = torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(3))
    logits = load_causal_lm(folder, device="cpu")(ids)
    assert (logits - reference_logits("qwen2", {}, ids)).abs().max() < TOLERANCE


def test_bfloat16_checkpoint_loads_as_bfloat16_and_stays_close(tmp_path):
    folder = write_tiny_model(tmp_path, "llama", dtype="bfloat16")
    model = load_causal_lm(folder, device="cpu")
    assert model.dtype == torch.bfloat16  # the CPU default for bf16 checkpoints
    ids = torch.randint(3, 300, (1, 16), generator=torch.Generator().manual_seed(4))
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = reference.eval()(ids).logits.float()
    ours = model(ids)
    assert ours.dtype == torch.float32
    # bf16 rounding differs in op order; compare against the logit scale.
    assert (ours - expected).abs().max() < 0.05 * expected.abs().max()
    # Loading the same file as float32 is exact against transformers in float32.
    exact = load_causal_lm(folder, device="cpu", dtype=torch.float32)
    upcast = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        expected_fp32 = upcast.eval()(ids).logits
    assert (exact(ids) - expected_fp32).abs().max() < TOLERANCE


def test_batched_prefill_of_different_lengths_matches_single_rows(tmp_path):
    model = load_causal_lm(write_tiny_model(tmp_path, "qwen3"), device="cpu")
    gen = torch.Generator().manual_seed(5)
    long_prompt = torch.randint(3, 300, (1, 11), generator=gen)
    short_prompt = torch.randint(3, 300, (1, 6), generator=gen)

    seqs = PagedSequences(model, 2, 32)
    batched = seqs.feed([long_prompt[0], short_prompt[0]])
    assert seqs.lengths == [11, 6]
    assert (batched[0] - model(long_prompt)[0]).abs().max() < TOLERANCE
    assert (batched[1] - model(short_prompt)[0]).abs().max() < TOLERANCE

    # Decode 5 steps with both rows at different positions; compare with each row alone.
    rows = [long_prompt, short_prompt]
    last = torch.stack([batched[0][-1], batched[1][-1]])
    for _ in range(5):
        next_tokens = last.argmax(-1, keepdim=True)
        rows = [torch.cat([rows[b], next_tokens[b : b + 1]], dim=1) for b in range(2)]
        last = torch.cat(seqs.feed(next_tokens))
        for b in range(2):
            assert (last[b] - model(rows[b])[0, -1]).abs().max() < TOLERANCE
    assert seqs.lengths == [16, 11]


def test_last_logits_only_picks_each_sequences_last_token(tmp_path):
    model = load_causal_lm(write_tiny_model(tmp_path, "llama"), device="cpu")
    ids = torch.randint(3, 300, (2, 8), generator=torch.Generator().manual_seed(6))
    full = model(ids)
    assert (model(ids, last_logits_only=True)[:, 0] - full[:, 7]).abs().max() < TOLERANCE
    last = PagedSequences(model, 2, 8).feed([ids[0], ids[1, :3]], last_only=True)
    assert [row.shape for row in last] == [(1, 300), (1, 300)]
    assert (last[0][0] - full[0, 7]).abs().max() < TOLERANCE
    assert (last[1][0] - full[1, 2]).abs().max() < TOLERANCE


def test_chunked_prefill_matches_one_shot(tmp_path):
    model = load_causal_lm(write_tiny_model(tmp_path, "mistral", sliding_window=4), "cpu")
    ids = torch.randint(3, 300, (2, 15), generator=torch.Generator().manual_seed(7))
    seqs = PagedSequences(model, 2, 15)
    chunks = [torch.stack(seqs.feed(ids[:, a:b])) for a, b in ((0, 5), (5, 12), (12, 15))]
    assert (torch.cat(chunks, dim=1) - model(ids)).abs().max() < TOLERANCE


def test_ernie4_5_under_its_remote_code_class_name_matches_transformers(tmp_path):
    """ERNIE 4.5's first checkpoints, and the EXL3 folders ExLlamaV3 made from them,
    name the class Ernie4_5_ForCausalLM: the same model as transformers' Ernie4_5."""
    import json

    folder = write_tiny_model(tmp_path, "ernie4_5")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config,
                                                    "architectures": ["Ernie4_5_ForCausalLM"]}))
    model = load_causal_lm(folder, device="cpu")
    prompt = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(1))
    ids, decoded_logits = greedy_decode(model, prompt, DECODE_STEPS)
    assert (decoded_logits - reference_logits("ernie4_5", {}, ids)).abs().max() < TOLERANCE
