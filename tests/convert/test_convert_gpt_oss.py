"""`exl3 convert` of a tiny random gpt-oss at 4.0 bpw (CPU): the experts, which the
Hugging Face checkpoint holds as one fused tensor per layer, are written per expert under
ExLlamaV3's names with their biases; the router (with its bias) stays at 16 bits, the
attention sinks are kept as they are, and the folder's logits track the original's."""

from __future__ import annotations

import pytest
import torch

from exl3cli.convert.pipeline import ConvertOptions, convert_model
from exl3cli.engine.layers.moe import MoEMLP
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.models.weights import WeightReader
from tests.fixtures.convert_checks import eval_ids
from tests.fixtures.tiny_store import write_tiny_chat_model

FAST = ConvertOptions(bits=4.0, head_bits=16, rows=8, cols=128, scale_search_tiles=4,
                      device="cpu")
LAYER = "model.layers.{i}"


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gpt_oss")
    src = write_tiny_chat_model(root / "src", "gpt_oss", num_hidden_layers=2)
    summary = convert_model(src, root / "out", FAST, root / "work")
    return {"src": src, "out": root / "out", "summary": summary}


def test_experts_are_written_one_by_one_under_exllamav3_names(converted):
    source, reader = WeightReader(converted["src"]), WeightReader(converted["out"])
    for i in range(2):
        layer = LAYER.format(i=i)
        assert source.has(f"{layer}.mlp.experts.gate_up_proj")
        assert not reader.has(f"{layer}.mlp.experts.gate_up_proj")
        for e in range(4):
            for part in ("gate_proj", "up_proj", "down_proj"):
                name = f"{layer}.mlp.experts.{e}.{part}"
                assert reader.has(name + ".trellis") and reader.has(name + ".bias")
        # Expert 2's gate bias is the even entries of the fused bias (interleaved).
        fused_bias = source.get(f"{layer}.mlp.experts.gate_up_proj_bias")[2]
        gate_bias = reader.get(f"{layer}.mlp.experts.2.gate_proj.bias").float()
        assert torch.allclose(gate_bias, fused_bias[0::2].half().float())
        router = f"{layer}.mlp.router"
        assert reader.get(router + ".weight").dtype == torch.float16
        assert reader.has(router + ".bias")
        sinks = f"{layer}.self_attn.sinks"
        assert torch.equal(reader.get(sinks).float(), source.get(sinks).half().float())


def test_the_folder_loads_and_tracks_the_original(converted):
    src = converted["src"]
    ids = eval_ids(src)
    original = load_causal_lm(src, device="cpu")
    quantized = load_causal_lm(converted["out"], device="cpu")
    assert isinstance(quantized.layers[0].mlp, MoEMLP)
    assert quantized.layers[0].attention.sinks is not None
    expected = original(ids)
    got = quantized(ids)
    corr = torch.corrcoef(torch.stack([got.flatten(), expected.flatten()]))[0, 1].item()
    assert corr > 0.99, f"{corr:.4f}"
    flipped = original(ids.flip(1))
    assert torch.corrcoef(torch.stack([flipped.flatten(), expected.flatten()]))[0, 1] < 0.9
