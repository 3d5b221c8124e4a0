"""The OpenAI API of a real daemon, driven by the official `openai` client."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from exl3cli.server.openai_requests import chat_request, sampling_options
from exl3cli.server.validation import BadRequest
from tests.fixtures.daemon import Daemon
from tests.fixtures.tiny_store import make_tiny_store

HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)


def ollama_chat(daemon, **body):
    request = urllib.request.Request(daemon.url + "/api/chat", method="POST",
                                     data=json.dumps({"stream": False, **body}).encode())
    with urllib.request.urlopen(request) as response:
        return json.loads(response.read())


def test_chat_completion_matches_the_ollama_route_and_counts_usage(client, daemon):
    answer = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=5,
                                            temperature=0)
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    (choice,) = answer.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    native = ollama_chat(daemon, model="tiny", messages=HELLO,
                         options={"num_predict": 5, "temperature": 0})
    assert choice.message.content == native["message"]["content"]
    assert answer.usage.completion_tokens == 5
    assert answer.usage.prompt_tokens == native["prompt_eval_count"]
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 5


def test_streamed_chat_has_role_first_finish_last_and_usage_when_asked(client):
    whole = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4,
                                           temperature=0).choices[0].message.content
    chunks = list(client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finishing] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    plain = list(client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2,
                                                stream=True))
    assert all(c.usage is None for c in plain)


def test_raw_sse_ends_with_done(daemon):
    request = urllib.request.Request(daemon.url + "/v1/completions", method="POST", data=json.dumps(
        {"model": "tiny", "prompt": "abc", "max_tokens": 2, "stream": True}).encode())
    with urllib.request.urlopen(request) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [e for e in response.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_completions_continue_the_raw_prompt(client, daemon):
    answer = client.completions.create(model="tiny", prompt="The cat", max_tokens=5,
                                       temperature=0)
    assert answer.object == "text_completion"
    request = urllib.request.Request(daemon.url + "/api/generate", method="POST", data=json.dumps(
        {"model": "tiny", "prompt": "The cat", "raw": True, "stream": False,
         "options": {"num_predict": 5, "temperature": 0}}).encode())
    with urllib.request.urlopen(request) as response:
        native = json.loads(response.read())
    assert answer.choices[0].text == native["response"]
    assert answer.usage.prompt_tokens == native["prompt_eval_count"]


def test_seed_makes_sampling_repeatable_and_stop_cuts(client):
    def sample(seed):
        return client.chat.completions.create(
            model="tiny", messages=HELLO, max_tokens=8, temperature=1.5, top_p=0.95,
            seed=seed, presence_penalty=0.5, frequency_penalty=0.2).choices[0].message.content
    assert sample(7) == sample(7)
    full = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8,
                                          temperature=0).choices[0].message.content
    stop_at = full[2:4]
    cut = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8,
                                         temperature=0, stop=[stop_at])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[:full.index(stop_at)]


def test_extra_exllama_sampler_fields_reach_the_options():
    options = sampling_options({"model": "m", "max_tokens": 3, "min_p": 0.1, "top_k": 5,
                                "dry_multiplier": 0.8, "repetition_penalty": 1.1,
                                "xtc_probability": 0.5, "stop": "x", "unrelated": 1})
    assert options == {"num_predict": 3, "min_p": 0.1, "top_k": 5, "dry_multiplier": 0.8,
                       "repeat_penalty": 1.1, "xtc_probability": 0.5, "stop": ["x"]}
    req = chat_request({"model": "m", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be "},
                                          {"type": "text", "text": "brief"}]},
        {"role": "user", "content": "hi"}]})
    assert req["messages"][0] == {"role": "system", "content": "be brief"}
    with pytest.raises(BadRequest):
        chat_request({"model": "m", "messages": HELLO, "n": 2})


def test_extra_body_sampler_fields_are_accepted(client):
    answer = client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=3,
        extra_body={"top_k": 1, "min_p": 0.05, "dry_multiplier": 0.5, "repetition_penalty": 1.1})
    assert answer.usage.completion_tokens <= 3


def test_models_lists_the_store(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny:latest"]
    assert models.data[0].owned_by == "library"
    assert client.models.retrieve("tiny").id == "tiny:latest"


def test_errors_use_the_openai_shape(client):
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=HELLO)
    assert missing.value.body["type"] == "not_found_error" and "nope" in missing.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=HELLO, temperature="hot")
    assert "temperature" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[])


def test_usage_counts_reused_prompt_tokens_as_cached(tmp_path):
    store = make_tiny_store(tmp_path, max_position_embeddings=2048)
    words = " ".join(f"word{i % 50} and more" for i in range(100))
    messages = [{"role": "user", "content": words}]
    with Daemon(store) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                               temperature=0).usage
        second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                                temperature=0).usage
    assert first.prompt_tokens > 512
    assert second.prompt_tokens == first.prompt_tokens  # the whole prompt, reused or not
    assert second.prompt_tokens_details.cached_tokens >= 256
    assert first.prompt_tokens_details.cached_tokens == 0
