"""The chat templates of the supported families render exactly as transformers renders
them: each template of tests/data/chat_templates (written for these tests in the
families' styles) over conversations with system prompts, several turns, tools and tool
calls, tool results, reasoning under its different names, None fields, non-ASCII text
and template switches (enable_thinking, reasoning_effort), through exl3's ChatTemplate
and through transformers' `apply_chat_template` on the same tokenizer folder."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
import transformers

from exl3cli.engine.text.chat_template import ChatTemplate
from exl3cli.errors import ChatTemplateError
from tests.fixtures.tiny_tokenizer import write_tiny_tokenizer

TEMPLATES = Path(__file__).parent.parent / "data" / "chat_templates"
FAMILIES = sorted(p.stem for p in TEMPLATES.glob("*.jinja"))

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "array", "items": {"type": "integer"}},
            },
            "required": ["city"],
        },
    },
}
CALL = {"type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": [1, 2]}}}

CONVERSATIONS = {
    "one_user_turn": ([{"role": "user", "content": "Hello!"}], None, {}),
    "system_and_turns": ([
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And times 3? 日本語 ok"},
    ], None, {}),
    "tools_call_and_result": ([
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "name": "get_weather", "content": "{\"temp\": 21}"},
    ], [WEATHER_TOOL], {}),
    # Ollama's `thinking` field; OpenAI-style `reasoning_content`; think tags in content.
    "reasoning_fields": ([
        {"role": "user", "content": "Think, then answer."},
        {"role": "assistant", "content": "Yes.", "thinking": "Short plan."},
        {"role": "user", "content": "Again?"},
        {"role": "assistant", "content": "<think>\nsecond plan\n</think>\n\nSure."},
        {"role": "user", "content": "Last one."},
        {"role": "assistant", "content": "Done.", "reasoning_content": "third plan"},
    ], None, {}),
    "switches": ([
        {"role": "user", "content": "Quick answer please."},
    ], None, {"enable_thinking": False, "reasoning_effort": "high"}),
    "tool_role_first": ([{"role": "tool", "content": "orphan"}], None, {}),
}


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> Path:
    folder = write_tiny_tokenizer(tmp_path_factory.mktemp("tok"), bos_token="<|endoftext|>")
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    config_path.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_folder):
    return transformers.AutoTokenizer.from_pretrained(str(tokenizer_folder))


def _transformers_render(tokenizer, source: str, messages: list, tools, extra: dict,
                         generation: bool) -> str | Exception:
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=source, tokenize=False,
            add_generation_prompt=generation, **extra)
    except (jinja2.TemplateError, ValueError, TypeError) as exc:
        return exc


@pytest.mark.parametrize("generation", [True, False])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("family", FAMILIES)
def test_renders_as_transformers_does(tokenizer_folder, hf_tokenizer, family, conversation,
                                      generation):
    source = (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")
    messages, tools, extra = CONVERSATIONS[conversation]
    expected = _transformers_render(hf_tokenizer, source, messages, tools, extra, generation)
    ours = ChatTemplate.from_folder(tokenizer_folder, template=source)
    if isinstance(expected, Exception):  # the template refuses: so must we, in one line
        with pytest.raises(ChatTemplateError):
            ours.render(messages, add_generation_prompt=generation, tools=tools, **extra)
        return
    got = ours.render(messages, add_generation_prompt=generation, tools=tools, **extra)
    assert got == expected


def test_the_fixtures_render_real_conversations():
    """Most pairs render (the comparison above is not all refusals), and a template sees
    the reasoning whichever name it came under: the test can fail."""
    tokenizer_free = ChatTemplate(
        (TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8"), "<s>", "</s>")
    messages, _, _ = CONVERSATIONS["reasoning_fields"]
    text = tokenizer_free.render(messages[:2], add_generation_prompt=False)
    assert "<think>\nShort plan.\n</think>\n\nYes." in text  # `thinking` read as reasoning
    gpt_oss = ChatTemplate((TEMPLATES / "gpt_oss.jinja").read_text(encoding="utf-8"))
    text = gpt_oss.render(messages, add_generation_prompt=True)
    assert "<|channel|>analysis<|message|>third plan<|end|>" in text  # reasoning_content
