"""bench/real_models/pad_hidden.py: the zero-padded copy ExLlamaV3 converts is the same
function as the original (tiny Llama, hidden 64 -> 128, tied and untied heads)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from exl3cli.engine.models.loader import load_causal_lm
from tests.fixtures.tiny_model import write_tiny_model

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "real_models" / "pad_hidden.py"


def _pad_module():
    spec = importlib.util.spec_from_file_location("pad_hidden", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("tied", [True, False])
def test_padded_copy_gives_the_same_logits(tmp_path, tied):
    src = write_tiny_model(tmp_path / "src", "llama", tie_word_embeddings=tied)
    config = _pad_module().pad_folder(src, tmp_path / "padded", 128)
    assert config["hidden_size"] == 128
    original = load_causal_lm(src, device="cpu", dtype=torch.float32)
    padded = load_causal_lm(tmp_path / "padded", device="cpu", dtype=torch.float32)
    assert padded.config.hidden_size == 128
    assert padded.config.head_dim == original.config.head_dim
    ids = torch.randint(0, original.config.vocab_size, (2, 17),
                        generator=torch.Generator().manual_seed(1))
    want = original(ids)
    assert (padded(ids) - want).abs().max() < 1e-4 * max(1.0, want.abs().max().item())
    # not vacuous: without the norm correction the copy is another function
    module = _pad_module()
    plain = module.pad_tensor
    module.pad_tensor = lambda name, t, old, new: (
        torch.nn.functional.pad(t, (0, new - old)) if name.endswith("norm.weight")
        else plain(name, t, old, new))
    module.pad_folder(src, tmp_path / "unscaled", 128)
    wrong = load_causal_lm(tmp_path / "unscaled", device="cpu", dtype=torch.float32)
    assert (wrong(ids) - want).abs().max() > 1e-3
