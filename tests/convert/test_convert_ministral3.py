"""`exl3 convert` of tiny random Ministral 3 models at 4.0 bpw (CPU): the text-only
checkpoint (Ministral3ForCausalLM) and the image-text one (Mistral3ForConditionalGeneration,
text model under language_model.). Calibration runs 24-token rows over an original
context of 8, so YaRN and the query scale 1 + beta * log(1 + floor(pos / 8)) are in
play; the folders load with their specs and their logits track the original's."""

from __future__ import annotations

import json

import pytest

from exl3cli.convert.pipeline import ConvertOptions, convert_model
from exl3cli.engine.layers.cpu_exl3 import CpuExl3Linear
from exl3cli.engine.layers.linear import Exl3Linear
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.models.weights import WeightReader
from tests.fixtures.convert_checks import eval_ids, logit_corr
from tests.fixtures.tiny_store import write_tiny_chat_model

FAST = ConvertOptions(bits=4.0, head_bits=16, rows=8, cols=128, scale_search_tiles=4,
                      device="cpu")
PREFIX = {"ministral3": "model.", "mistral3": "language_model.model."}


@pytest.fixture(scope="module", params=sorted(PREFIX))
def converted(request, tmp_path_factory) -> dict:
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    src = write_tiny_chat_model(root / "src", arch, num_hidden_layers=2)
    convert_model(src, root / "out", FAST, root / "work")
    return {"arch": arch, "src": src, "out": root / "out"}



def test_text_layers_are_quantized_under_the_checkpoints_names(converted):
    reader = WeightReader(converted["out"])
    prefix = PREFIX[converted["arch"]]
    for i in range(2):
        for module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                       "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            assert reader.has(f"{prefix}layers.{i}.{module}.trellis"), module
    config = json.loads((converted["out"] / "config.json").read_text())
    text = config.get("text_config", config)
    # The query scale's parameters survive into the EXL3 folder's config.
    assert text["rope_parameters"]["llama_4_scaling_beta"] == 0.1


def test_the_folder_loads_and_tracks_the_original(converted):
    src = converted["src"]
    ids = eval_ids(src)
    original = load_causal_lm(src, device="cpu")
    quantized = load_causal_lm(converted["out"], device="cpu")
    assert isinstance(quantized.layers[1].attention.o, (Exl3Linear, CpuExl3Linear))
    expected = original(ids)
    corr = logit_corr(quantized(ids), expected)
    # Measured at 4.0 bpw: Ministral 3 0.9926, Mistral 3 (image-text) 0.9935.
    assert corr > 0.99, f"{converted['arch']}: correlation {corr:.4f}"
    # The comparison can fail: other text correlates far less.
    assert logit_corr(original(ids.flip(1)), expected) < 0.9
