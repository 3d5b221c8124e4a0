"""`exl3 convert` of the dense families (and Qwen2-MoE) that have no conversion test of
their own, on tiny random checkpoints at 4.0 bpw: every layer's linears quantized
under the names EXL3 folders store them by (ExLlamaV3's: the checkpoint's module names),
the norms kept as they are, and the folder's logits tracking the original's."""

from __future__ import annotations

import pytest

from exl3cli.convert.moe_layer import stored_name
from exl3cli.convert.pipeline import ConvertOptions, convert_model
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.models.weights import WeightReader
from exl3cli.engine.spec.architecture import get_architecture, load_family_config
from tests.fixtures.convert_checks import eval_ids, logit_corr
from tests.fixtures.tiny_store import write_tiny_chat_model

FAST = ConvertOptions(bits=4.0, head_bits=16, rows=8, cols=128, scale_search_tiles=4,
                      device="cpu")
# Cohere: one LayerNorm for the parallel attention and MLP, per-head LayerNorm q/k
# norms; Cohere2: sliding layers and a rope-less global one; EXAONE 4 and OLMo 2/3:
# post-norm blocks; SmolLM3: a layer without rope; ERNIE 4.5: interleaved rope;
# Qwen2-MoE: a shared expert wider than the routed ones, behind a sigmoid gate; ERNIE
# 4.5 MoE: a dense layer 0, shared experts, the choice bias moved next to the router.
CASES = {
    "cohere": {"use_qk_norm": True},
    "cohere2": {},
    "ernie4_5": {},
    "exaone4": {},
    "olmo2": {},
    "olmo3": {},
    "smollm3": {},
    "qwen2_moe": {},
    "ernie4_5_moe": {},
}
# Measured at 4.0 bpw (rows 8 x 128): Cohere (q/k norms) 0.9985, Cohere2 0.9954,
# ERNIE 4.5 0.9943, EXAONE 4 0.9972, OLMo 2 0.9971, OLMo 3 0.9959, SmolLM3 0.9930,
# Qwen2-MoE 0.9965, ERNIE 4.5 MoE 0.9928.
MIN_CORRELATION = 0.99
# Norm tensors each family's layers keep at 16 bits (layer 0).
NORMS = {
    "cohere": ("input_layernorm", "self_attn.q_norm", "self_attn.k_norm"),
    "cohere2": ("input_layernorm",),
    "ernie4_5": ("input_layernorm", "post_attention_layernorm"),
    "exaone4": ("post_attention_layernorm", "post_feedforward_layernorm",
                "self_attn.q_norm", "self_attn.k_norm"),
    "olmo2": ("post_attention_layernorm", "post_feedforward_layernorm",
              "self_attn.q_norm", "self_attn.k_norm"),
    "olmo3": ("post_attention_layernorm", "post_feedforward_layernorm",
              "self_attn.q_norm", "self_attn.k_norm"),
    "smollm3": ("input_layernorm", "post_attention_layernorm"),
    "qwen2_moe": ("input_layernorm", "post_attention_layernorm"),
    "ernie4_5_moe": ("input_layernorm", "post_attention_layernorm"),
}
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
DENSE_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
QWEN2_MOE = ("mlp.experts.3.gate_proj", "mlp.experts.3.down_proj",
             "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj")
MLP = {  # by layer, where it is not the dense MLP
    "qwen2_moe": {0: QWEN2_MOE, 1: QWEN2_MOE},
    "ernie4_5_moe": {1: ("mlp.experts.3.up_proj", "mlp.experts.3.down_proj",
                         "mlp.shared_experts.gate_proj", "mlp.shared_experts.down_proj")},
}


pytestmark = pytest.mark.slow  # nine conversions


@pytest.fixture(scope="module", params=sorted(CASES))
def converted(request, tmp_path_factory) -> dict:
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    src = write_tiny_chat_model(root / "src", arch, **CASES[arch])
    summary = convert_model(src, root / "out", FAST, root / "work")
    return {"arch": arch, "src": src, "out": root / "out", "summary": summary}


def test_logits_correlate_with_original(converted):
    ids = eval_ids(converted["src"])
    original = load_causal_lm(converted["src"], device="cpu")
    expected = original(ids)
    corr = logit_corr(load_causal_lm(converted["out"], device="cpu")(ids), expected)
    assert corr > MIN_CORRELATION, f"{converted['arch']}: correlation {corr:.4f}"
    assert logit_corr(original(ids.flip(1)), expected) < 0.9  # the check can fail


def test_linears_are_quantized_and_norms_kept_under_the_checkpoint_names(converted):
    arch = converted["arch"]
    source, reader = WeightReader(converted["src"]), WeightReader(converted["out"])
    for i in range(2):
        for module in ATTENTION + MLP.get(arch, {}).get(i, DENSE_MLP):
            name = f"model.layers.{i}.{module}"
            assert reader.has(name + ".trellis") and not reader.has(name + ".weight"), name
        for norm in NORMS[arch]:
            name = f"model.layers.{i}.{norm}.weight"
            assert reader.get(name).shape == source.get(name).shape, name
    # Nothing of the checkpoint's layers is left out: every tensor the source has is in
    # the folder, as a quantized linear or as itself (a choice bias where ExLlamaV3
    # reads it, moe_layer.stored_name).
    stored, spec = set(reader.keys()), get_architecture(load_family_config(converted["src"])
                                                        .architecture)
    for key in source.keys():
        module = key.rsplit(".", 1)[0]
        layer = int(key.split(".")[2]) if key.startswith("model.layers.") else -1
        assert stored_name(spec, layer, key) in stored or module + ".trellis" in stored, key
    if arch == "ernie4_5_moe":
        bias = reader.get("model.layers.1.mlp.gate.e_score_correction_bias")
        assert bias.abs().max() > 0
    if arch.startswith("cohere"):  # one norm feeds both halves of the parallel block
        assert not any("post_attention_layernorm" in k for k in stored)
