"""`exl3 convert` of mixtures whose router adds a per-expert choice bias to its scores
(e_score_correction_bias: GLM-4.5, ERNIE 4.5 MoE, DeepSeek-V3): the bias is written to
the EXL3 folder as it is (the engine's router needs it to pick the same experts), and
a tiny random GLM-4.5 at 4.0 bpw loads and tracks the original."""

from __future__ import annotations

import pytest
import torch

from exl3cli.convert.moe_layer import stored_name
from exl3cli.convert.pipeline import ConvertOptions, _Converter, convert_model
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.models.weights import WeightReader
from tests.fixtures.convert_checks import eval_ids
from tests.fixtures.tiny_store import write_tiny_chat_model

FAST = ConvertOptions(bits=4.0, head_bits=16, rows=8, cols=128, scale_search_tiles=4,
                      device="cpu")
BIAS = {"glm4_moe": "model.layers.{i}.mlp.gate.e_score_correction_bias",
        "ernie4_5_moe": "model.layers.{i}.mlp.moe_statics.e_score_correction_bias",
        "deepseek_v3": "model.layers.{i}.mlp.gate.e_score_correction_bias"}


@pytest.mark.parametrize("arch", sorted(BIAS))
def test_the_choice_bias_is_kept_on_sparse_layers_only(tmp_path, arch):
    src = write_tiny_chat_model(tmp_path / "src", arch, num_hidden_layers=2)
    conv = _Converter(src, FAST, tmp_path / "work", lambda _event: None)
    assert BIAS[arch].format(i=1) in conv.norm_names(1)  # layer 1: experts
    assert not any("e_score_correction_bias" in n for n in conv.norm_names(0))  # dense
    # Written where ExLlamaV3 reads it, next to the router (ERNIE's moe_statics moves).
    assert (stored_name(conv.spec, 1, BIAS[arch].format(i=1))
            == "model.layers.1.mlp.gate.e_score_correction_bias")
    assert stored_name(conv.spec, 1, "model.layers.1.input_layernorm.weight") == (
        "model.layers.1.input_layernorm.weight")


def test_glm4_moe_converts_and_tracks_the_original(tmp_path):
    src = write_tiny_chat_model(tmp_path / "src", "glm4_moe", num_hidden_layers=2)
    convert_model(src, tmp_path / "out", FAST, tmp_path / "work")
    source, reader = WeightReader(src), WeightReader(tmp_path / "out")
    bias = BIAS["glm4_moe"].format(i=1)
    assert torch.allclose(reader.get(bias).float(), source.get(bias).float(), atol=1e-3)
    ids = eval_ids(src)
    original = load_causal_lm(src, device="cpu")
    expected = original(ids)
    got = load_causal_lm(tmp_path / "out", device="cpu")(ids)
    corr = torch.corrcoef(torch.stack([got.flatten(), expected.flatten()]))[0, 1].item()
    # Measured at 4.0 bpw: 0.988 (attention at 6-7 bits, the gate/up experts at 3).
    assert corr > 0.98, f"{corr:.4f}"
    flipped = original(ids.flip(1))
    assert torch.corrcoef(torch.stack([flipped.flatten(), expected.flatten()]))[0, 1] < 0.9
