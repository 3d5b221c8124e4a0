"""JSON mode and JSON-schema output through a real daemon, with the official `ollama`
and `openai` clients. The tiny model has random weights, so only the constraint can make
its answers parse."""

from __future__ import annotations

import json

import ollama
import openai
import pydantic
import pytest

SAMPLED = {"temperature": 1.0, "num_predict": 48}


class Pet(pydantic.BaseModel):
    kind: str
    legs: int


class Person(pydantic.BaseModel):
    name: str
    age: int
    likes_tea: bool
    pets: list[Pet]


@pytest.fixture(scope="module")
def ollama_client(daemon):
    return ollama.Client(host=daemon.url)


@pytest.fixture(scope="module")
def openai_client(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)


def test_ollama_generate_json_mode_streaming_and_not(ollama_client):
    for seed in (1, 2):
        whole = ollama_client.generate(model="tiny", prompt="Give me JSON", format="json",
                                       options={**SAMPLED, "seed": seed})
        assert isinstance(json.loads(whole.response), dict)
        chunks = list(ollama_client.generate(model="tiny", prompt="Give me JSON",
                                             format="json", stream=True,
                                             options={**SAMPLED, "seed": seed}))
        assert "".join(c.response for c in chunks) == whole.response  # seeded: same text


def test_ollama_chat_with_a_pydantic_schema(ollama_client):
    for seed in (3, 4):
        reply = ollama_client.chat(model="tiny", format=Person.model_json_schema(),
                                   messages=[{"role": "user", "content": "Who are you?"}],
                                   options={"temperature": 1.0, "num_predict": 80,
                                            "seed": seed})
        person = Person.model_validate_json(reply.message.content)
        assert isinstance(person.pets, list)


def test_ollama_unsupported_schema_keyword_is_a_400(ollama_client):
    schema = {"type": "object", "properties": {"when": {"type": "string",
                                                        "pattern": "^[0-9]+$"}}}
    with pytest.raises(ollama.ResponseError) as caught:
        ollama_client.generate(model="tiny", prompt="x", format=schema)
    assert caught.value.status_code == 400 and "pattern" in caught.value.error


def test_openai_json_object_mode(openai_client):
    reply = openai_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "json please"}],
        response_format={"type": "json_object"}, temperature=1.0, seed=5, max_tokens=48)
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_openai_json_schema_streaming(openai_client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                               "rank": {"enum": [1, 2, 3]}},
              "required": ["city", "rank"], "additionalProperties": False}
    stream = openai_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "A city"}], stream=True,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": schema, "strict": True}},
        temperature=1.0, seed=6, max_tokens=40)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    value = json.loads(text)
    assert set(value) == {"city", "rank"} and value["rank"] in (1, 2, 3)
    assert isinstance(value["city"], str) and len(value["city"]) <= 8


def test_openai_parse_helper_with_pydantic(openai_client):
    completion = openai_client.chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": "Who?"}], response_format=Person,
        temperature=1.0, seed=7, max_tokens=80)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person)


def test_openai_bad_response_format_is_a_400(openai_client):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"not": {}}}})
    assert "not" in str(caught.value)
