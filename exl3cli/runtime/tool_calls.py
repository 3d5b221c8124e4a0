"""Tool calls in a chat answer: find them in the streamed text, turn them into objects.

When a chat request declares `tools`, the model may answer with Hermes/Qwen-style
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (anywhere in its text)
or with a bare JSON object (or list of them) of that shape as its whole answer. The
parser routes the text around them to `content` and each call to `tool_calls`, in the
Ollama shape `{"function": {"name": str, "arguments": dict}}`. Text that only looks
like a call (unknown tool name, bad JSON) stays content. Tags split over several
deltas are held back until decided, as the thinking splitter does.
"""

from __future__ import annotations

import json
from typing import Any

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def tool_names(tools: Any) -> set[str]:
    """Names declared by a request's `tools` ({"type": "function", "function": {...}})."""
    names: set[str] = set()
    for tool in tools or []:
        if isinstance(tool, dict):
            function = tool.get("function") if isinstance(tool.get("function"), dict) else tool
            if isinstance(function.get("name"), str):
                names.add(function["name"])
    return names


def as_tool_call(value: Any, names: set[str]) -> dict[str, Any] | None:
    """The Ollama-shaped call for a decoded `{"name", "arguments"|"parameters"}` object."""
    if not isinstance(value, dict):
        return None
    if isinstance(value.get("function"), dict):  # already {"function": {...}}
        value = value["function"]
    name = value.get("name")
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or name not in names or not isinstance(arguments, dict):
        return None
    return {"function": {"name": name, "arguments": arguments}}


def parse_calls(text: str, names: set[str]) -> list[dict[str, Any]] | None:
    """Calls in a JSON text holding one call object or a list of them; None otherwise."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [as_tool_call(item, names) for item in items]
    if not calls or any(call is None for call in calls):
        return None
    return calls  # type: ignore[return-value]


def _partial_suffix(text: str, tag: str) -> int:
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class ToolCallParser:
    """`push(text)` / `flush()` -> [(kind, value)] with kind "content" (a str) or
    "tool_calls" (a list of calls). Disabled, everything is content."""

    def __init__(self, tools: Any):
        self.names = tool_names(tools)
        self._state = "start" if self.names else "off"
        self._buffer = ""
        self._had_calls = False
        self._wrote_text = False  # blanks after real text are content, between calls not

    def push(self, text: str) -> list[tuple[str, Any]]:
        if self._state == "off":
            return [("content", text)] if text else []
        self._buffer += text
        out: list[tuple[str, Any]] = []
        while True:
            progressed = self._step(out)
            if not progressed:
                return out

    def _step(self, out: list[tuple[str, Any]]) -> bool:
        """One state transition on the buffer; False when more text is needed."""
        if self._state == "start":
            stripped = self._buffer.lstrip()
            if not stripped:
                return False
            if stripped.startswith("{") or stripped.startswith("["):
                self._state = "json"  # decided at the end: a call, or plain JSON content
                return False
            if OPEN.startswith(stripped[:len(OPEN)]) and len(stripped) < len(OPEN):
                return False
            self._state = "text"
            return True
        if self._state == "text":
            if not self._buffer.strip():
                return False  # blanks between calls: emitted at the end only if no call
            index = self._buffer.find(OPEN)
            if index >= 0:
                before, self._buffer = self._buffer[:index], self._buffer[index + len(OPEN):]
                if before.strip() or (before and self._wrote_text):
                    out.append(("content", before))
                self._state = "block"
                return True
            keep = _partial_suffix(self._buffer, OPEN)
            ready = self._buffer[:len(self._buffer) - keep]
            if not ready.strip() and not self._wrote_text:
                return False  # blanks after a call: wait to see what follows
            self._buffer = self._buffer[len(self._buffer) - keep:]
            if ready:
                out.append(("content", ready))
                self._wrote_text = True
            return False
        if self._state == "block":
            index = self._buffer.find(CLOSE)
            if index < 0:
                return False
            inside, self._buffer = self._buffer[:index], self._buffer[index + len(CLOSE):]
            self._emit_block(inside, out)
            self._state = "text"
            return True
        return False  # "json": wait for the end

    def _emit_block(self, inside: str, out: list[tuple[str, Any]]) -> None:
        calls = parse_calls(inside.strip(), self.names)
        if calls:
            self._had_calls = True
            self._wrote_text = False
            out.append(("tool_calls", calls))
        else:
            out.append(("content", OPEN + inside + CLOSE))

    def flush(self) -> list[tuple[str, Any]]:
        if self._state == "off":
            return []
        text, self._buffer = self._buffer, ""
        out: list[tuple[str, Any]] = []
        if self._state == "json":
            calls = parse_calls(text.strip(), self.names)
            out.append(("tool_calls", calls) if calls else ("content", text))
        elif self._state == "block":  # no closing tag before the end of the answer
            calls = parse_calls(text.strip(), self.names)
            out.append(("tool_calls", calls) if calls else ("content", OPEN + text))
        elif text.strip() or (text and not self._had_calls):
            out.append(("content", text))
        self._state = "start"
        return [item for item in out if item[1]]
