"""Tool calls through a real daemon: `tools` reach the chat template, and a model answer
that is a tool call comes back as `message.tool_calls` (Ollama) / `tool_calls` (OpenAI).

The tiny model's weights are random, so the call is forced with a JSON schema (the
structured-output constraint); the answer is then a bare `{"name", "arguments"}` object.
"""

from __future__ import annotations

import json
from pathlib import Path

import ollama
import openai
import pytest

from exl3cli.engine.generation.textmodel import TextModel
from exl3cli.runtime.jobs import _message_list, render_prompt_ids
from exl3cli.store.store import ModelStore
from tests.fixtures.daemon import Daemon
from tests.fixtures.tiny_model import write_tiny_model
from tests.fixtures.tiny_store import TINY_VOCAB
from tests.fixtures.tiny_tokenizer import write_tiny_tokenizer

# A ChatML template with Hermes-style tool support, written for this test.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.tool_calls %}{% for call in message.tool_calls %}"
    "<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}"
    "{%- else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL_SCHEMA = {"type": "object", "properties": {
    "name": {"enum": ["get_weather"]},
    "arguments": {"type": "object", "properties": {"city": {"type": "string",
                                                            "maxLength": 12}},
                  "required": ["city"]}}, "required": ["name", "arguments"]}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
SAMPLED = {"temperature": 1.0, "seed": 3, "num_predict": 60}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools-model")
    write_tiny_model(folder, "llama", vocab_size=TINY_VOCAB)
    write_tiny_tokenizer(folder, chat_template=TOOLS_TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def daemon(folder, tmp_path_factory):
    store = ModelStore(tmp_path_factory.mktemp("tools-store"))
    store.import_folder("toolie", folder, {"type": "folder", "path": str(folder)})
    with Daemon(store) as running:
        yield running


def test_tools_and_past_calls_reach_the_rendered_prompt(folder):
    model = TextModel.load(folder)
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny"}]
    text = model.tokenizer.decode(render_prompt_ids(model, _message_list(history),
                                                    [WEATHER_TOOL], None, None))
    assert "Weather of a city" in text and '"name": "get_weather"' in text
    # OpenAI clients send arguments as JSON text; the template gets an object
    assert '"arguments": {"city": "Paris"}' in text and "sunny" in text


def test_ollama_chat_tools_reach_the_template(daemon, folder):
    client = ollama.Client(host=daemon.url)
    plain = client.chat(model="toolie", messages=ASK, options={"num_predict": 1})
    tooled = client.chat(model="toolie", messages=ASK, tools=[WEATHER_TOOL],
                         options={"num_predict": 1})
    model = TextModel.load(folder)
    expected = render_prompt_ids(model, ASK, [WEATHER_TOOL], None, None)
    assert tooled.prompt_eval_count == len(expected) > plain.prompt_eval_count


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_chat_returns_tool_calls(daemon, stream):
    client = ollama.Client(host=daemon.url)
    kwargs = dict(model="toolie", messages=ASK, tools=[WEATHER_TOOL], format=CALL_SCHEMA,
                  options=SAMPLED)
    if stream:
        chunks = list(client.chat(stream=True, **kwargs))
        calls = [c for chunk in chunks for c in (chunk.message.tool_calls or [])]
        content = "".join(chunk.message.content or "" for chunk in chunks)
    else:
        reply = client.chat(**kwargs)
        calls, content = reply.message.tool_calls or [], reply.message.content
    assert len(calls) == 1 and content == ""
    assert calls[0].function.name == "get_weather"
    assert isinstance(calls[0].function.arguments["city"], str)


def test_without_tools_the_same_answer_is_content(daemon):
    client = ollama.Client(host=daemon.url)
    reply = client.chat(model="toolie", messages=ASK, format=CALL_SCHEMA, options=SAMPLED)
    assert not reply.message.tool_calls
    assert json.loads(reply.message.content)["name"] == "get_weather"


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_returns_tool_calls(daemon, stream):
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
    kwargs = dict(model="toolie", messages=ASK, tools=[WEATHER_TOOL], temperature=1.0,
                  seed=3, max_tokens=60,
                  response_format={"type": "json_schema",
                                   "json_schema": {"name": "call", "schema": CALL_SCHEMA}})
    if stream:
        chunks = [c for c in client.chat.completions.create(stream=True, **kwargs)
                  if c.choices]
        calls = [call for c in chunks for call in (c.choices[0].delta.tool_calls or [])]
        finish = chunks[-1].choices[0].finish_reason
        assert calls[0].index == 0
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls, finish = choice.message.tool_calls, choice.finish_reason
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0].id.startswith("call_") and calls[0].type == "function"
    assert calls[0].function.name == "get_weather"
    assert isinstance(json.loads(calls[0].function.arguments)["city"], str)


REAL_TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates" / "real"
OPENAI_HISTORY = ASK + [
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "content": "sunny"}]


@pytest.mark.parametrize("template, shown", [
    # DeepSeek-V3's published template joins the arguments as text (objects fail there).
    ("deepseekv3", '```json\n{"city": "Paris"}\n```'),
    # GLM-4.5's iterates them as an object (text fails there).
    ("glm4moe", "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>"),
])
def test_past_calls_render_through_published_templates(tmp_path, template, shown):
    folder = tmp_path / template
    write_tiny_model(folder, "llama", vocab_size=TINY_VOCAB)
    write_tiny_tokenizer(folder, chat_template=(REAL_TEMPLATES / f"{template}.jinja")
                         .read_text(encoding="utf-8"))
    model = TextModel.load(folder)
    ids = render_prompt_ids(model, _message_list(OPENAI_HISTORY), [WEATHER_TOOL], None, None)
    text = model.tokenizer.decode(ids)
    assert shown in text and "sunny" in text
