"""`logprobs` / `top_logprobs` on both APIs: each generated token's log-probability under
the model (checked against the model's own logits), its top alternatives, streamed with
the text or all at the end."""

from __future__ import annotations

import json
import math
import urllib.request

import openai
import pytest
import torch

from exl3cli.runtime.residency import InferenceRunner

PROMPT = "Once upon a time"
GREEDY = {"temperature": 0, "num_predict": 5}


def generate(daemon, stream: bool, **body) -> list[dict]:
    data = json.dumps({"model": "tiny", "prompt": PROMPT, "raw": True, "stream": stream,
                       "options": GREEDY, **body}).encode()
    request = urllib.request.Request(daemon.url + "/api/generate", data=data, method="POST")
    with urllib.request.urlopen(request) as response:
        return [json.loads(line) for line in response.read().splitlines() if line.strip()]


def first_token_logprobs(store) -> torch.Tensor:
    """log-softmax of the model's next-token logits after PROMPT, computed directly."""
    runner = InferenceRunner(store)
    text_model = runner.loaded_model("tiny").text_model
    ids = text_model.tokenizer.encode(PROMPT)
    with torch.inference_mode():
        logits = text_model.model.forward(torch.tensor([ids]))[0, -1]
    runner.close()
    return torch.log_softmax(logits.float(), dim=-1)


def test_ollama_logprobs_match_the_models_distribution(daemon, store):
    (final,) = generate(daemon, stream=False, logprobs=True, top_logprobs=3)
    entries = final["logprobs"]
    assert len(entries) == final["eval_count"] == 5
    assert "".join(e["token"] for e in entries) == final["response"]
    for entry in entries:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3
        best = entry["top_logprobs"][0]  # greedy: the chosen token is the likeliest
        assert (best["token"], best["logprob"]) == (entry["token"], entry["logprob"])
        assert entry["bytes"] == list(entry["token"].encode())
        assert sum(math.exp(t["logprob"]) for t in entry["top_logprobs"]) <= 1 + 1e-5
    expected = first_token_logprobs(store)
    assert entries[0]["logprob"] == pytest.approx(float(expected.max()), abs=1e-4)
    second = sorted(expected.tolist(), reverse=True)[1]
    assert entries[0]["top_logprobs"][1]["logprob"] == pytest.approx(second, abs=1e-4)


def test_streamed_logprobs_ride_with_their_text_and_none_without_asking(daemon):
    chunks = generate(daemon, stream=True, logprobs=True)
    entries = [e for c in chunks for e in c.get("logprobs") or []]
    assert len(entries) == chunks[-1]["eval_count"]
    assert all(e["top_logprobs"] == [] for e in entries)
    assert "".join(e["token"] for e in entries) == "".join(c["response"] for c in chunks)
    assert all("logprobs" not in c for c in generate(daemon, stream=True))


def test_openai_chat_and_completions_logprobs(daemon):
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    streamed = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, logprobs=True, stream=True)
    tokens = [t.token for c in streamed if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.content]
    assert tokens == [t.token for t in content]
    text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4,
                                     temperature=0, logprobs=2)
    legacy = text.choices[0].logprobs
    assert "".join(legacy.tokens) == text.choices[0].text and len(legacy.tokens) == 4
    # a dict per token (two alternatives that decode alike, e.g. to "\ufffd", share a key)
    assert legacy.text_offset[0] == 0 and all(1 <= len(t) <= 2 for t in legacy.top_logprobs)
    assert client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        temperature=0).choices[0].logprobs is None
