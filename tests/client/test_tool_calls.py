"""Tool-call parsing of chat answers: Hermes/Qwen <tool_call> blocks and bare JSON calls,
fed whole and split into deltas at every position (tags may straddle deltas)."""

from __future__ import annotations

import pytest

from exl3cli.runtime.tool_calls import ToolCallParser, parse_calls, tool_names

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "add"}}]
WEATHER = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
ADD = {"function": {"name": "add", "arguments": {"a": 1, "b": 2}}}


def run(text: str, cut: list[int] | None = None, tools=TOOLS):
    """Content text and calls from feeding `text` in pieces cut at `cut` positions."""
    parser = ToolCallParser(tools)
    bounds = [0, *(cut or []), len(text)]
    items = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        items += parser.push(text[start:end])
    items += parser.flush()
    content = "".join(v for k, v in items if k == "content")
    calls = [c for k, v in items if k == "tool_calls" for c in v]
    return content, calls


CASES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "", [WEATHER]),
    ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
     '</tool_call>\n<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}'
     '</tool_call>', "Let me check. ", [WEATHER, ADD]),
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [ADD]),
    ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", '
     '"arguments": {"a": 1, "b": 2}}]', "", [WEATHER, ADD]),
    # not calls: plain JSON, an unknown tool, broken JSON, a lone "<" in text
    ('{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "add", "arguments": {</tool_call>',
     '<tool_call>{"name": "add", "arguments": {</tool_call>', []),
    ("a < b and <tool> tags", "a < b and <tool> tags", []),
    # the end of the answer may come before the closing tag
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}', "", [ADD]),
]


@pytest.mark.parametrize("text, content, calls", CASES)
def test_whole_and_split_answers_give_the_same_calls(text, content, calls):
    assert run(text) == (content, calls)
    for cut in range(1, len(text)):
        assert run(text, [cut]) == (content, calls), cut
    assert run(text, list(range(1, len(text)))) == (content, calls)  # one char at a time


def test_without_tools_everything_is_content():
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    assert run(text, tools=None) == (text, [])
    assert run(text, tools=[]) == (text, [])


def test_helpers():
    assert tool_names(TOOLS) == {"get_weather", "add"}
    assert tool_names([{"name": "bare"}, "junk", {"function": {"description": "x"}}]) == \
        {"bare"}
    assert parse_calls('{"function": {"name": "add", "arguments": {"a": 1, "b": 2}}}',
                       {"add"}) == [ADD]
    assert parse_calls("[]", {"add"}) is None and parse_calls("nope", {"add"}) is None
