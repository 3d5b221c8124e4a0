"""Embeddings in-process: mean-pooled final hidden states, checked against transformers
running the very same tiny checkpoint."""

from __future__ import annotations

import math

import pytest
import torch

from exl3cli.errors import ContextOverflow, InvalidOption, ModelNotFound
from exl3cli.runtime.embeddings import embedding_inputs
from exl3cli.runtime.residency import InferenceRunner
from tests.fixtures.tiny_model import tiny_reference_model
from tests.fixtures.tiny_store import TINY_VOCAB, make_tiny_store


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return InferenceRunner(make_tiny_store(tmp_path_factory.mktemp("embed")))


def reference(runner, text: str, normalize: bool = True) -> torch.Tensor:
    reference_model = tiny_reference_model("llama", vocab_size=TINY_VOCAB)
    tokenizer = runner._loaded[next(iter(runner._loaded))].text_model.tokenizer
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        hidden = reference_model.model(ids).last_hidden_state[0].mean(dim=0)
    return torch.nn.functional.normalize(hidden, dim=0) if normalize else hidden


def test_embeddings_match_transformers_and_are_normalised(runner):
    texts = ["The sky is blue.", "Hello world! Hello there"]
    answer = runner.embed({"model": "tiny", "input": texts})
    assert len(answer["embeddings"]) == 2 and answer["prompt_eval_count"] > 4
    for text, vector in zip(texts, answer["embeddings"], strict=True):
        assert math.isclose(sum(x * x for x in vector), 1.0, rel_tol=1e-4)
        expected = reference(runner, text)
        assert torch.allclose(torch.tensor(vector), expected, atol=1e-4)
    assert answer["embeddings"][0] != answer["embeddings"][1]
    raw = runner.embed({"model": "tiny", "input": texts[0]}, normalize=False)
    assert torch.allclose(torch.tensor(raw["embeddings"][0]),
                          reference(runner, texts[0], normalize=False), atol=1e-4)


def test_truncate_dimensions_and_errors(runner):
    long_text = "the quick brown fox " * 200
    cut = runner.embed({"model": "tiny", "input": long_text, "options": {"num_ctx": 16}})
    assert cut["prompt_eval_count"] == 16
    with pytest.raises(ContextOverflow):
        runner.embed({"model": "tiny", "input": long_text, "truncate": False,
                      "options": {"num_ctx": 16}})
    small = runner.embed({"model": "tiny", "input": "hi", "dimensions": 8})["embeddings"][0]
    assert len(small) == 8 and math.isclose(sum(x * x for x in small), 1.0, rel_tol=1e-4)
    assert runner.embed({"model": "tiny", "input": []})["embeddings"] == []
    with pytest.raises(ModelNotFound):
        runner.embed({"model": "nope", "input": "x"})
    with pytest.raises(InvalidOption):
        embedding_inputs([1, 2])
