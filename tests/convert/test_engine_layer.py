"""The quantizer calibrates every family through the engine's own decoder layers
(convert/engine_layer.py): layer by layer it computes the engine's forward, and the
Hessians it quantizes on are those of the inputs the engine's modules receive."""

from __future__ import annotations

import pytest
import torch

from exl3cli.convert import pipeline
from exl3cli.convert.calibration import calibration_tokens, default_calibration_text
from exl3cli.convert.hessian import HessianAccumulator
from exl3cli.convert.quantize_layer import QuantizedLinear
from exl3cli.engine.layers.attention import Attention
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.text.tokenizer import Tokenizer
from tests.fixtures.tiny_store import write_tiny_chat_model

OPTIONS = pipeline.ConvertOptions(bits=4.0, device="cpu")
# Gemma's options (scaled embeddings, sandwich and 1 + w norms, caps, windows, both
# ropes), Phi-3's partial rotary, GLM-4's interleaved rope, Qwen3's q/k norms.
CASES = {
    "llama": {},
    "qwen3": {},
    "phi3": {"partial_rotary_factor": 0.5},
    "glm4": {},
    "gemma2": {"num_hidden_layers": 2, "attn_logit_softcapping": 3.0,
               "final_logit_softcapping": 5.0},
    "gemma3": {"num_hidden_layers": 2, "sliding_window_pattern": 2},
}


def _tokens(src, rows: int = 8, cols: int = 40) -> torch.Tensor:
    """Held-out rows of the calibration text, past the fixtures' 6-token windows."""
    ids = calibration_tokens(Tokenizer.from_folder(src), default_calibration_text(), 3 * rows,
                             cols)
    return ids[1::3]


def _source_dense(conv: pipeline._Converter, i: int) -> dict:
    modules = [m for ms in conv.layer_modules(i).values() for m in ms]
    return {m: (conv.weight(m), conv.bias(m)) for m in modules} | conv.kept_dense(i)


@pytest.mark.parametrize("arch", sorted(CASES))
def test_layer_by_layer_equals_the_engines_forward(tmp_path, arch):
    src = write_tiny_chat_model(tmp_path / "src", arch, **CASES[arch])
    conv = pipeline._Converter(src, OPTIONS, tmp_path / "work", lambda _event: None)
    conv.engine_layers.row_chunk = 3  # 8 rows: three chunks, the last one short
    ids = _tokens(src)
    with torch.inference_mode():
        hidden = conv.embeddings(ids)
        for i in range(conv.config.num_layers):
            hidden = conv.run_layer(i, hidden, _source_dense(conv, i))
        got = conv.engine_layers.final_norm(hidden, conv.tensor(conv.names.final_norm))
    expected = load_causal_lm(src, device="cpu").hidden_states(ids)
    assert (got - expected).abs().max() < 1e-5


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_a_replayed_attention_gives_what_recomputing_it_gives(tmp_path, arch):
    """The MLP's groups are captured with the attention replayed from o's input."""
    src = write_tiny_chat_model(tmp_path / "src", arch, **CASES[arch])
    conv = pipeline._Converter(src, OPTIONS, tmp_path / "work", lambda _event: None)
    engine = conv.engine_layers
    engine.row_chunk = 3
    with torch.inference_mode():
        hidden = conv.embeddings(_tokens(src))
        layer = engine.build(0, _source_dense(conv, 0), conv.tensor)
        attended = engine.linear_input(layer, hidden, "o")
        for slot in ("gate_up", "down"):
            assert torch.equal(engine.linear_input(layer, hidden, slot, attended),
                               engine.linear_input(layer, hidden, slot)), slot
        assert torch.equal(engine.run(layer, hidden, attended), engine.run(layer, hidden))
        # A wrong `attended` is what the layer then uses: the replay is real.
        assert not torch.equal(engine.run(layer, hidden, attended.flip(0)),
                               engine.run(layer, hidden))
        with pytest.raises(ValueError, match="before the attention"):
            engine.linear_input(layer, hidden, "o", attended)


def _converter_hessians(src, tokens: torch.Tensor, work, monkeypatch) -> dict:
    """(layer, group) -> the Hessian the converter quantizes that group on, with every
    quantization replaced by the unquantized weights (so that later groups and layers
    see the source model's activations)."""
    seen: dict[str, torch.Tensor] = {}

    def keep(names, weights, _biases, hessian, _settings, _k_bits, *_rest, **_options):
        seen[names[0]] = hessian
        return [QuantizedLinear(n, {}, w, 0.0) for n, w in zip(names, weights, strict=True)]

    monkeypatch.setattr(pipeline, "quantize_mixed", keep)
    conv = pipeline._Converter(src, OPTIONS, work, lambda _event: None)
    found = {}
    with torch.inference_mode():
        hidden = conv.embeddings(tokens)
        for i in range(conv.config.num_layers):
            groups = conv.layer_modules(i)
            conv.quantize_layer(i, hidden, {m: 4 for ms in groups.values() for m in ms})
            found |= {(i, g): seen.pop(ms[0]) for g, ms in groups.items()}
            hidden = conv.run_layer(i, hidden, _source_dense(conv, i))
    return found


def _engine_hessians(src, tokens: torch.Tensor) -> dict:
    """(layer, group) -> the Hessian of what the loaded model's own modules receive."""
    model = load_causal_lm(src, device="cpu", dtype=torch.float32)
    found: dict = {}
    handles = []
    for i, layer in enumerate(model.layers):
        modules = {"qkv": layer.attention.qkv, "o": layer.attention.o,
                   "gate_up": layer.mlp.gate_up, "down": layer.mlp.down}
        for group, module in modules.items():
            def add(_module, args, key=(i, group)):
                acc = found.setdefault(key, HessianAccumulator(args[0].shape[-1]))
                acc.add(args[0])
            handles.append(module.register_forward_pre_hook(add))
    model(tokens)
    for handle in handles:
        handle.remove()
    return {key: acc.hessian() for key, acc in found.items()}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_llama_is_calibrated_on_what_the_engines_modules_receive(tmp_path, monkeypatch):
    """A change to the engine's attention (here: sin(3 x) on its output) changes the
    Hessians of o_proj and of everything after it exactly as the engine computes them:
    a converter with a forward of its own would not follow."""
    src = write_tiny_chat_model(tmp_path / "src", "llama")
    tokens = _tokens(src, rows=4, cols=64)
    plain_attend = Attention.attend
    with monkeypatch.context() as patch:
        patch.setattr(Attention, "attend", lambda self, qk, value, step: torch.sin(
            3 * plain_attend(self, qk, value, step)))
        got = _converter_hessians(src, tokens, tmp_path / "work", patch)
        expected = _engine_hessians(src, tokens)
    plain = _engine_hessians(src, tokens)
    assert sorted(got) == sorted(expected) == [(i, g) for i in range(2)
                                                for g in ("down", "gate_up", "o", "qkv")]
    for key, hessian in expected.items():
        assert _relative(got[key], hessian) < 1e-5, key
    # The change reaches o_proj's input and all that follows, not layer 0's q/k/v.
    assert _relative(plain[(0, "qkv")], expected[(0, "qkv")]) < 1e-6
    for key in [(0, "o"), (0, "gate_up"), (0, "down"), (1, "qkv")]:
        assert _relative(plain[key], expected[key]) > 0.05, key
