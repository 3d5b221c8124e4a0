"""What exl3 does not implement is refused where it is given (400 naming it), never
accepted and ignored: images on a text model, think on a model without thinking, suffix
without fill-in-the-middle tokens, a nonzero mirostat, a forced tool call."""

from __future__ import annotations

import ollama
import openai
import pytest

from exl3cli.engine.text.tokenizer import Tokenizer
from exl3cli.errors import InvalidOption
from exl3cli.runtime.jobs import FIM_TOKENS, fill_in_middle_ids
from tests.fixtures.tiny_tokenizer import train_byte_level_bpe

HELLO = [{"role": "user", "content": "hello"}]
GREEDY = {"temperature": 0, "num_predict": 3}


@pytest.fixture(scope="module")
def client(daemon):
    return ollama.Client(host=daemon.url)


@pytest.fixture(scope="module")
def oai(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)


def refused(call) -> str:
    with pytest.raises(ollama.ResponseError) as error:
        call()
    assert error.value.status_code == 400
    return error.value.error


def test_images_on_a_text_model_are_refused(client):
    image = "iVBORw0KGgo="  # any base64: the model cannot look at it
    assert "does not support images" in refused(
        lambda: client.generate(model="tiny", prompt="what is this?", images=[image]))
    assert "does not support images" in refused(lambda: client.chat(
        model="tiny", messages=[{"role": "user", "content": "what?", "images": [image]}]))


def test_think_on_a_model_without_thinking_is_refused_false_is_fine(client):
    assert "does not support thinking" in refused(
        lambda: client.chat(model="tiny", messages=HELLO, think=True, options=GREEDY))
    answer = client.chat(model="tiny", messages=HELLO, think=False, options=GREEDY)
    assert answer.done


def test_suffix_without_fim_tokens_is_refused(client, oai):
    assert "fill-in-the-middle" in refused(
        lambda: client.generate(model="tiny", prompt="def f(", suffix="return x", options=GREEDY))
    with pytest.raises(openai.BadRequestError, match="fill-in-the-middle"):
        oai.completions.create(model="tiny", prompt="def f(", suffix="return x", max_tokens=3)


def test_fill_in_the_middle_prompt_uses_the_fim_tokens():
    backend = train_byte_level_bpe()
    backend.add_special_tokens(list(FIM_TOKENS[0]))
    tokenizer = Tokenizer(backend)
    ids = fill_in_middle_ids(tokenizer, "def f(x):", "return y")
    start, hole, middle = (tokenizer.token_to_id(t) for t in FIM_TOKENS[0])
    assert ids[0] == start and ids[-1] == middle and ids.count(hole) == 1
    cut = ids.index(hole)
    assert tokenizer.decode(ids[1:cut]) == "def f(x):"
    assert tokenizer.decode(ids[cut + 1:-1]) == "return y"
    with pytest.raises(InvalidOption):
        fill_in_middle_ids(Tokenizer(train_byte_level_bpe()), "a", "b")


def test_a_per_request_num_gpu_is_refused(client):
    # Layers are placed at load from PARAMETER num_gpu: a request's value would be ignored.
    assert "num_gpu" in refused(lambda: client.generate(
        model="tiny", prompt="hi", options={**GREEDY, "num_gpu": 0}))
    assert client.generate(model="tiny", prompt="hi", options=GREEDY).done


def test_mirostat_is_refused_unless_off(client):
    assert "mirostat" in refused(lambda: client.generate(
        model="tiny", prompt="hi", options={**GREEDY, "mirostat": 2}))
    assert client.generate(model="tiny", prompt="hi", options={**GREEDY, "mirostat": 0}).done


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def test_tool_choice_required_is_refused_none_drops_the_tools(oai):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            oai.chat.completions.create(model="tiny", messages=HELLO, tools=TOOLS,
                                        tool_choice=choice, max_tokens=2)
    answer = oai.chat.completions.create(model="tiny", messages=HELLO, tools=TOOLS,
                                         tool_choice="none", max_tokens=2, temperature=0)
    assert answer.choices[0].message.tool_calls is None
