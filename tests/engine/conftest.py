"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest

from exl3cli.engine.generation.textmodel import TextModel
from tests.fixtures.tiny_model import write_tiny_model
from tests.fixtures.tiny_tokenizer import write_tiny_tokenizer


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    """The tiny random Llama with the tiny BPE tokenizer, on CPU, 1280 positions."""
    folder = tmp_path_factory.mktemp("text-model")
    write_tiny_model(folder, "llama", vocab_size=400, max_position_embeddings=1280)
    write_tiny_tokenizer(folder)
    return TextModel.load(folder, device="cpu")
