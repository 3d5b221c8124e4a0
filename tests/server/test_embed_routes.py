"""Embedding routes of a real daemon, driven by the official `ollama` and `openai`
clients: /api/embed, the legacy /api/embeddings, /v1/embeddings (float and base64)."""

from __future__ import annotations

import base64
import math
import struct

import ollama
import openai
import pytest

from exl3cli.runtime.residency import InferenceRunner

TEXTS = ["The sky is blue.", "Once upon a time"]


@pytest.fixture(scope="module")
def local(store):
    """The in-process answer, for comparing what comes over HTTP."""
    return InferenceRunner(store).embed({"model": "tiny", "input": TEXTS})["embeddings"]


def close(a, b) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, abs_tol=1e-5) for x, y in zip(a, b,
                                                                                      strict=True))


def test_ollama_embed(daemon, local):
    client = ollama.Client(host=daemon.url)
    answer = client.embed(model="tiny", input=TEXTS)
    assert len(answer.embeddings) == 2
    assert all(close(got, want) for got, want in zip(answer.embeddings, local, strict=True))
    assert answer.prompt_eval_count > 0 and answer.total_duration > 0
    single = client.embed(model="tiny", input=TEXTS[1])
    assert close(single.embeddings[0], local[1])
    ps = client.ps()
    assert [m.model.split(":")[0] for m in ps.models] == ["tiny"]  # embedding loaded it


def test_ollama_legacy_embeddings_are_not_normalised(daemon, local):
    client = ollama.Client(host=daemon.url)
    vector = client.embeddings(model="tiny", prompt=TEXTS[0]).embedding
    norm = math.sqrt(sum(x * x for x in vector))
    assert not math.isclose(norm, 1.0, rel_tol=1e-3)
    assert close([x / norm for x in vector], local[0])


def test_ollama_embed_errors(daemon):
    client = ollama.Client(host=daemon.url)
    with pytest.raises(ollama.ResponseError) as caught:
        client.embed(model="missing", input="x")
    assert caught.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as caught:
        client.embed(model="tiny", input="word " * 400, truncate=False,
                     options={"num_ctx": 32})
    assert caught.value.status_code == 400


@pytest.mark.parametrize("encoding", ["float", "base64", None])
def test_openai_embeddings(daemon, local, encoding):
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
    extra = {} if encoding is None else {"encoding_format": encoding}
    answer = client.embeddings.create(model="tiny", input=TEXTS, **extra)
    assert [item.index for item in answer.data] == [0, 1]
    vectors = [item.embedding for item in answer.data]
    if encoding == "base64":  # asked for explicitly, the client hands the text over as is
        vectors = [list(struct.unpack(f"<{len(local[0])}f", base64.b64decode(v)))
                   for v in vectors]
    assert all(close(got, want) for got, want in zip(vectors, local, strict=True))
    assert answer.usage.prompt_tokens == answer.usage.total_tokens > 0
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="tiny", input=[[1, 2, 3]])
