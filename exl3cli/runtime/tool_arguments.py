"""Tool-call arguments in the shape a chat template takes.

OpenAI clients send a past call's `arguments` as JSON text, Ollama's as an object.
Most published templates write them with `arguments | tojson` or iterate them (GLM-4.5's
`arguments.items()`), so requests hand templates objects; DeepSeek-V3's template joins
them into the prompt as text and fails on an object. A render that fails with objects
is tried once more with the arguments as JSON text.

Public API:
- ``with_decoded_arguments(message) -> message``: arguments given as JSON text as objects.
- ``with_encoded_arguments(message) -> message``: arguments given as objects as JSON text.
- ``render_messages(chat_template, messages, tools, **extra) -> str``: the generation
  prompt, objects first, then text if the template refused objects.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from exl3cli.errors import ChatTemplateError


def _map_arguments(message: dict, change: Callable[[Any], Any]) -> dict:
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    changed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and "arguments" in function:
            call = {**call, "function": {**function, "arguments": change(function["arguments"])}}
        changed.append(call)
    return {**message, "tool_calls": changed}


def _decoded(arguments: Any) -> Any:
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _encoded(arguments: Any) -> Any:
    return arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                  ensure_ascii=False)


def with_decoded_arguments(message: dict) -> dict:
    return _map_arguments(message, _decoded)


def with_encoded_arguments(message: dict) -> dict:
    return _map_arguments(message, _encoded)


def render_messages(chat_template: Any, messages: list[dict], tools: Any,
                    **extra: Any) -> str:
    """`chat_template.render` with the generation prompt (module docstring)."""
    try:
        return chat_template.render(messages, add_generation_prompt=True, tools=tools, **extra)
    except ChatTemplateError as refused:
        as_text = [with_encoded_arguments(m) if isinstance(m, dict) else m for m in messages]
        if as_text == messages:
            raise
        try:
            return chat_template.render(as_text, add_generation_prompt=True, tools=tools,
                                        **extra)
        except ChatTemplateError:
            raise refused from None
