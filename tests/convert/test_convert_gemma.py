"""`exl3 convert` on tiny random Gemma 2, Gemma 3 and Gemma 3 image-text models (CPU):
the written folder loads with the engine's Gemma spec and its logits track the
original's (that the calibration forward is the engine's: test_engine_layer.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers

from exl3cli.convert.pipeline import ConvertOptions, convert_model
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.models.vision.gemma3 import exllamav3_name
from exl3cli.engine.models.weights import WeightReader
from exl3cli.engine.spec.architecture import get_architecture
from tests.fixtures.convert_checks import eval_ids, logit_corr
from tests.fixtures.tiny_model import tiny_reference_model
from tests.fixtures.tiny_store import TINY_VOCAB, write_tiny_chat_model
from tests.fixtures.tiny_tokenizer import write_tiny_tokenizer

# FAST_ARGS of test_pipeline.py: 4.0 bpw, 6-bit head, small calibration.
FAST = ConvertOptions(bits=4.0, head_bits=6, rows=8, cols=128, scale_search_tiles=4,
                      device="cpu")
# Two layers: the first slides (Gemma 3: with the local rope), the second is global.
# Caps small enough that the tiny model's scores and logits reach them.
CASES = {
    "gemma2": {"num_hidden_layers": 2, "attn_logit_softcapping": 3.0,
               "final_logit_softcapping": 5.0},
    "gemma3": {"num_hidden_layers": 2, "sliding_window_pattern": 2},
}
# Quantizing the 400 x 64 head is a third of a conversion's time: one case does it.
HEAD_BITS = {"gemma2": 6, "gemma3": 16}
SANDWICH = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
            "post_feedforward_layernorm")


@pytest.fixture(scope="module", params=sorted(CASES))
def converted(request, tmp_path_factory) -> dict:
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    src = write_tiny_chat_model(root / "src", arch, **CASES[arch])
    options = replace(FAST, head_bits=HEAD_BITS[arch])
    summary = convert_model(src, root / "out", options, root / "work")
    return {"arch": arch, "src": src, "out": root / "out", "summary": summary}


def _held_out_ids(src: Path) -> torch.Tensor:
    """Text of the calibration distribution (rows the conversion did not see)."""
    return eval_ids(src)



def test_logits_correlate_with_original(converted):
    ids = _held_out_ids(converted["src"])
    original = load_causal_lm(converted["src"], device="cpu")
    expected = original(ids)
    corr = logit_corr(load_causal_lm(converted["out"], device="cpu")(ids), expected)
    # Measured at 4.0 bpw: 0.9966 (Gemma 2, 6-bit head), 0.9967 (Gemma 3, 16-bit head).
    assert corr > 0.99, f"{converted['arch']}: correlation {corr:.4f}"
    # A different input (so different logits) does not correlate: the check can fail.
    assert logit_corr(original(ids.flip(1)), expected) < 0.9


def test_output_folder_loads_with_the_gemma_spec(converted):
    src, out, arch = converted["src"], converted["out"], converted["arch"]
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["quantization_config"]["bits"] == 4.0
    source, reader = WeightReader(src), WeightReader(out)
    assert not source.has("lm_head.weight")  # tied in the source: the head is the embedding
    if HEAD_BITS[arch] == 6:  # hidden 64 padded to 128, vocab 400 to 512, K = 6
        assert tuple(reader.get("lm_head.trellis").shape) == (128 // 16, 512 // 16, 96)
    else:  # a 16-bit head is the embedding, untied
        assert torch.equal(reader.get("lm_head.weight"),
                           source.get("model.embed_tokens.weight").half())
    norms = [f"model.layers.{i}.{n}.weight" for i in range(2) for n in SANDWICH]
    if arch == "gemma3":
        norms += [f"model.layers.{i}.self_attn.{n}.weight" for i in range(2)
                  for n in ("q_norm", "k_norm")]
    for name in [*norms, "model.norm.weight", "model.embed_tokens.weight"]:
        # float32 sources are stored as float16 (EXL3-FORMAT.md section 2).
        assert torch.equal(reader.get(name), source.get(name).half()), name
    assert not reader.has("model.layers.0.mlp.down_proj.weight")
    assert reader.has("model.layers.1.mlp.down_proj.trellis")
    model = load_causal_lm(out, device="cpu")
    assert model.spec is get_architecture(config["architectures"][0])
    assert model.spec.sandwich_norm and model.embed_scale == 8.0  # sqrt(64)
    assert model.layers[0].attention.window == 6 and model.layers[1].attention.window is None
    assert model.layers[0].attention.local_rope == (arch == "gemma3")
    assert [r.layer for r in converted["summary"].layers] == [0, 1]


def _image_text_model(folder: Path) -> None:
    """A tiny Gemma3ForConditionalGeneration (old "language_model.model." names, as
    save_pretrained writes them) with the tiny tokenizer."""
    text = tiny_reference_model("gemma3", vocab_size=TINY_VOCAB, num_hidden_layers=1)
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}
    config = transformers.Gemma3Config(
        text_config=text.config.to_dict(), vision_config=vision, mm_tokens_per_image=4,
        image_token_index=TINY_VOCAB - 1, boi_token_index=TINY_VOCAB - 3,
        eoi_token_index=TINY_VOCAB - 2)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.tie_weights()
    model.save_pretrained(folder)
    write_tiny_tokenizer(folder)


def test_image_text_checkpoint_converts_its_text_model(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    _image_text_model(src)
    convert_model(src, out, replace(FAST, head_bits=16), tmp_path / "work")
    source, reader = WeightReader(src), WeightReader(out)
    prefix = get_architecture("Gemma3ForConditionalGeneration").tensor_names(source.has)
    layer = prefix.q_proj.format(i=0)
    assert reader.has(layer + ".trellis") and not reader.has(layer + ".weight")
    assert reader.has(prefix.lm_head)  # 16-bit head, untied
    vision = [k for k in source.keys() if not k.startswith("language_model.")]
    # kept, under ExLlamaV3's names (test_convert_vision.py)
    assert vision and all(reader.has(exllamav3_name(k)) for k in vision)
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"].get("tie_word_embeddings", False) is False
    ids = _held_out_ids(src)
    expected = load_causal_lm(src, device="cpu")(ids)
    quantized = load_causal_lm(out, device="cpu")
    assert quantized.spec.name == "Gemma3ForConditionalGeneration"
    corr = logit_corr(quantized(ids), expected)
    assert corr > 0.99  # measured 0.9984 (one layer, 16-bit head), f"correlation {corr:.4f}"
