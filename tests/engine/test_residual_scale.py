"""The scaled residual stream of float16 Gemma models (engine/models/residual_scale.py).

Gemma 3's residual stream outgrows float16 (65,504) in real checkpoints (270M: ~104,000);
the loader then carries x / 64. In float32 the fold is exact (same bits); in float16 a
tiny Gemma whose stream is pushed past float16's range gives NaN without it and tracks
transformers' float32 logits with it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exl3cli.engine.models import loader
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.models.residual_scale import scale_residual_stream, wants_residual_scale
from exl3cli.engine.spec.architecture import get_architecture
from tests.fixtures.tiny_model import tiny_reference_model

# Untied, so the pushed-up embedding does not also push up the logits.
CONFIG = {"tie_word_embeddings": False, "num_hidden_layers": 3}
PEAK = 2.0e5  # the stream's largest value after the embedding: past float16's 65,504


def _ids() -> torch.Tensor:
    return torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def loud_gemma(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """A tiny Gemma 3 whose embeddings times sqrt(hidden) reach PEAK, and its
    float32 transformers logits."""
    model = tiny_reference_model("gemma3", **CONFIG)
    embed = model.model.embed_tokens.weight
    with torch.no_grad():
        embed.mul_(PEAK / (float(embed.abs().max()) * model.config.hidden_size**0.5))
        expected = model(_ids()).logits.float()
    folder = tmp_path_factory.mktemp("loud-gemma")
    model.save_pretrained(folder, safe_serialization=True)
    return folder, expected


def test_only_float16_gemma_with_pre_norms_wants_it():
    gemma3, llama, exaone4 = (get_architecture(name) for name in
                              ("Gemma3ForCausalLM", "LlamaForCausalLM", "Exaone4ForCausalLM"))
    assert wants_residual_scale(gemma3, torch.float16)
    assert not wants_residual_scale(gemma3, torch.bfloat16)
    assert not wants_residual_scale(gemma3, torch.float32)
    assert not wants_residual_scale(llama, torch.float16)
    assert not wants_residual_scale(exaone4, torch.float16)  # no pre-norms: reads the stream


def test_the_fold_gives_the_same_bits_in_float32(loud_gemma):
    folder, _ = loud_gemma
    plain, scaled = (load_causal_lm(folder, device="cpu") for _ in range(2))
    assert plain.residual_scale is None
    assert scale_residual_stream(scaled)
    assert scaled.residual_scale == 2.0 ** -6
    with torch.no_grad():
        assert torch.equal(plain(_ids()), scaled(_ids()))


def test_float16_gemma_past_the_range_stays_finite(loud_gemma, monkeypatch):
    folder, expected = loud_gemma
    model = load_causal_lm(folder, device="cpu", dtype=torch.float16)
    assert model.residual_scale == 2.0 ** -6
    with torch.no_grad():
        got = model(_ids()).float()
    assert torch.isfinite(got).all()
    assert (got - expected).abs().max() < 0.02 * expected.abs().max()
    # Without the fold the same load overflows: the test can tell.
    monkeypatch.setattr(loader, "wants_residual_scale", lambda spec, dtype: False)
    bare = load_causal_lm(folder, device="cpu", dtype=torch.float16)
    assert bare.residual_scale is None
    with torch.no_grad():
        assert not torch.isfinite(bare(_ids())).all()


def test_a_layer_of_another_shape_is_left_alone(loud_gemma):
    folder, _ = loud_gemma
    model = load_causal_lm(folder, device="cpu")
    model.layers[1].mlp_out_norm = None
    eps = model.final_norm.eps
    assert not scale_residual_stream(model)
    assert model.residual_scale is None and model.final_norm.eps == eps
