"""`exl3 convert` of a tiny random DeepSeek-V3 at 4.0 bpw (CPU): multi-head latent
attention quantized in two stages (q_a / kv_a on the hidden state, then q_b on the
query latent q_a gives; convert/mla_layer.py) with kv_b_proj at 16 bits, a dense first
layer, then a sparse one whose router keeps its choice bias (e_score_correction_bias);
the folder holds the tensors as ExLlamaV3 stores them and tracks the original."""

from __future__ import annotations

import pytest
import torch

from exl3cli.convert.engine_layer import EngineLayerForward
from exl3cli.convert.mla_layer import latent_modules
from exl3cli.convert.pipeline import ConvertOptions, convert_model
from exl3cli.engine.layers.moe import MoEMLP
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.models.weights import WeightReader
from exl3cli.engine.spec.architecture import get_architecture, load_family_config
from tests.fixtures.convert_checks import eval_ids, logit_corr
from tests.fixtures.tiny_store import write_tiny_chat_model

FAST = ConvertOptions(bits=4.0, head_bits=16, rows=8, cols=128, scale_search_tiles=4,
                      device="cpu")
ATTN = "model.layers.{i}.self_attn."
MLA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("deepseek_v3")
    src = write_tiny_chat_model(root / "src", "deepseek_v3", num_hidden_layers=2)
    events: list = []
    summary = convert_model(src, root / "out", FAST, root / "work", progress=events.append)
    return {"src": src, "out": root / "out", "summary": summary, "events": events}



def test_latent_attention_and_router_are_written_under_their_names(converted):
    source, reader = WeightReader(converted["src"]), WeightReader(converted["out"])
    for i in range(2):
        for module in MLA:
            assert reader.has(ATTN.format(i=i) + module + ".trellis"), (i, module)
        # kv_b_proj dense, as ExLlamaV3 reads it (it folds it into queries and outputs).
        kv_b = ATTN.format(i=i) + "kv_b_proj"
        assert not reader.has(kv_b + ".trellis")
        assert torch.equal(reader.get(kv_b + ".weight").float(),
                           source.get(kv_b + ".weight").half().float())
        for norm in ("q_a_layernorm.weight", "kv_a_layernorm.weight"):
            name = ATTN.format(i=i) + norm
            assert torch.equal(reader.get(name).float(), source.get(name).half().float())
    assert reader.has("model.layers.0.mlp.gate_proj.trellis")  # first_k_dense_replace
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.allclose(reader.get(bias).float(), source.get(bias).float(), atol=1e-3)
    assert reader.get("model.layers.1.mlp.gate.weight").dtype == torch.float16
    for e in range(4):
        assert reader.has(f"model.layers.1.mlp.experts.{e}.down_proj.trellis")
    assert reader.has("model.layers.1.mlp.shared_experts.up_proj.trellis")
    # The sparse layer reports the calibration tokens each expert received.
    assert sum(converted["summary"].layers[1].expert_tokens) == 8 * 128 * 2


def test_the_folder_loads_and_tracks_the_original(converted):
    src = converted["src"]
    ids = eval_ids(src)
    original = load_causal_lm(src, device="cpu")
    quantized = load_causal_lm(converted["out"], device="cpu")
    assert isinstance(quantized.layers[1].mlp, MoEMLP)
    expected = original(ids)
    corr = logit_corr(quantized(ids), expected)
    # Measured at 4.0 bpw: 0.982. The fixed order's MoE bonus gives attention 6-7 bits
    # and the experts pay with 3; in this tiny model attention is a large share of the
    # weights, so the experts pay a lot (in DeepSeek-V3 itself about 0.03 bits).
    assert corr > 0.975, f"{corr:.4f}"
    assert logit_corr(original(ids.flip(1)), expected) < 0.9


def test_the_second_stage_reads_the_normed_latents(tmp_path):
    """q_b_proj is quantized on what it receives, the RMS-normed latent of q_a_proj; the
    engine's hooks read kv_b_proj's input too (kv_a_proj_with_mqa's latent, normed,
    without its rope part)."""
    src = write_tiny_chat_model(tmp_path / "src", "deepseek_v3", num_hidden_layers=1)
    config = load_family_config(src)
    spec = get_architecture(config.architecture)
    names, reader = spec.tensor_names(WeightReader(src).has), WeightReader(src)
    modules = latent_modules(names, config, 0)
    assert modules[2:] == [ATTN.format(i=0) + "q_b_proj"]
    engine = EngineLayerForward(config, spec, names, torch.device("cpu"))

    def tensor(name: str) -> torch.Tensor:
        return reader.get(name, dtype=torch.float32)

    dense = {m: (tensor(m + ".weight").T, None) for m in modules + [
             ATTN.format(i=0) + "kv_b_proj", ATTN.format(i=0) + "o_proj",
             "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
             "model.layers.0.mlp.down_proj"]}
    layer = engine.build(0, dense, tensor)
    hidden = torch.randn(2, 10, config.hidden_size, generator=torch.Generator().manual_seed(0))
    latent = layer.attention.qkv
    normed = engine.linear_input(layer, hidden, "qkv")
    rank = config.raw["kv_lora_rank"]
    kv_in = engine.module_input(layer, hidden, latent.kv_b)
    expected = latent.kv_norm((normed @ dense[modules[1]][0])[..., :rank])
    assert kv_in.shape[-1] == rank and torch.allclose(kv_in, expected, atol=1e-5)
    q_in = engine.module_input(layer, hidden, latent.q_b)
    assert torch.allclose(q_in, latent.q_norm(normed @ dense[modules[0]][0]), atol=1e-5)
    # Without a query latent the first stage is q_proj.
    plain = load_family_config(write_tiny_chat_model(tmp_path / "plain", "deepseek_v3",
                                                     q_lora_rank=None, num_hidden_layers=1))
    assert latent_modules(names, plain, 0) == [
        ATTN.format(i=0) + m for m in ("q_proj", "kv_a_proj_with_mqa")]
