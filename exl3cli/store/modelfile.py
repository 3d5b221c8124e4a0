"""Modelfiles: parse the text into a `Modelfile`, and write one back.

Grammar (see INTERFACE.md): one instruction per line, case-insensitive, any order;
`FROM` required. A value runs to the end of the line, unless it starts with `"` (runs
to the next unescaped `"`, may span lines, `\\"` and `\\\\` are escapes) or `\"\"\"`
(runs verbatim to the next `\"\"\"`). `#` starts a comment only at the start of a line.
`to_text()` picks a quoting for each value such that `parse_modelfile(m.to_text()) == m`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from exl3cli.errors import ModelfileError

# Every PARAMETER a Modelfile may set, with the type its value is parsed into.
# `list` means the parameter repeats and its values accumulate (only `stop`).
PARAMETER_TYPES: dict[str, type] = {
    "num_ctx": int,
    "num_predict": int,
    "num_keep": int,
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "typical_p": float,
    "repeat_penalty": float,
    "repeat_last_n": int,
    "presence_penalty": float,
    "frequency_penalty": float,
    "seed": int,
    "stop": list,
    "dry_multiplier": float,
    "dry_base": float,
    "dry_allowed_length": int,
    "xtc_probability": float,
    "xtc_threshold": float,
    "kv_cache_type": str,
    "draft_num_predict": int,
    "num_gpu": int,
    "tensor_parallel": int,
    "gpu_split": str,
    "truncate": bool,
}

# Ollama parameters exl3 does not implement, with what to use instead.
UNSUPPORTED_PARAMETERS = {
    "mirostat": "mirostat sampling is not implemented (use temperature, top_p, min_p, "
                "dry_* or xtc_*)",
    "mirostat_eta": "mirostat sampling is not implemented",
    "mirostat_tau": "mirostat sampling is not implemented",
}

MESSAGE_ROLES = ("system", "user", "assistant")
INSTRUCTIONS = ("from", "parameter", "template", "system", "adapter", "license",
                "message", "draft")
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


@dataclass
class Modelfile:
    """The settings a Modelfile describes; `from_` is the FROM value as written."""

    from_: str
    parameters: dict[str, Any] = field(default_factory=dict)
    template: str | None = None
    system: str | None = None
    adapter: str | None = None
    license: list[str] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    draft: str | None = None
    from_line: int = field(default=0, compare=False)  # for errors about the FROM value
    # Line of each TEMPLATE/SYSTEM/DRAFT instruction, for errors found after parsing.
    lines: dict[str, int] = field(default_factory=dict, compare=False)

    def to_text(self) -> str:
        """Modelfile text that parses back to an equal `Modelfile`."""
        lines = [f"FROM {quote_value(self.from_)}"]
        for name, value in self.parameters.items():
            for item in (value if isinstance(value, list) else [value]):
                lines.append(f"PARAMETER {name} {_format_parameter(item)}")
        if self.template is not None:
            lines.append(f"TEMPLATE {quote_value(self.template)}")
        if self.system is not None:
            lines.append(f"SYSTEM {quote_value(self.system)}")
        if self.adapter is not None:
            lines.append(f"ADAPTER {quote_value(self.adapter)}")
        for text in self.license:
            lines.append(f"LICENSE {quote_value(text)}")
        for message in self.messages:
            lines.append(f"MESSAGE {message['role']} {quote_value(message['content'])}")
        if self.draft is not None:
            lines.append(f"DRAFT {quote_value(self.draft)}")
        return "\n".join(lines) + "\n"


def _format_parameter(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))  # "0", not "0.0", like Ollama writes it
    if isinstance(value, (int, float)):
        return repr(value)
    return quote_value(str(value))


def quote_value(text: str) -> str:
    """The shortest spelling of `text` that the parser reads back exactly."""
    plain = (text and text == text.strip() and "\n" not in text and "\r" not in text
             and not text.startswith('"'))
    if plain:
        return text
    if '"""' not in text and not text.endswith('"'):
        return f'"""{text}"""'
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def parse_parameter(name: str, raw: str) -> Any:
    """Convert a PARAMETER value to its declared type; ValueError names the problem."""
    kind = PARAMETER_TYPES.get(name)
    if kind is None:
        raise ValueError(f"unknown parameter '{name}'")
    if kind in (str, list):
        return raw
    if kind is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ValueError(f"parameter '{name}' needs true or false, got '{raw}'")
    try:
        value = kind(raw)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise ValueError(f"parameter '{name}' needs {noun}, got '{raw}'") from None
    if kind is float and not math.isfinite(value):
        raise ValueError(f"parameter '{name}' needs a finite number, got '{raw}'")
    return value


class _Reader:
    """Walks the text keeping track of the line number for error messages."""

    def __init__(self, text: str):
        self.text = text
        self.pos = 0
        self.line = 1

    def at_end(self) -> bool:
        return self.pos >= len(self.text)

    def advance_to(self, pos: int) -> str:
        chunk = self.text[self.pos:pos]
        self.line += chunk.count("\n")
        self.pos = pos
        return chunk

    def read_line(self) -> str:
        end = self.text.find("\n", self.pos)
        end = len(self.text) if end < 0 else end
        chunk = self.advance_to(end)
        if not self.at_end():
            self.advance_to(self.pos + 1)
        return chunk

    def skip_blanks(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t":
            self.pos += 1

    def read_word(self) -> str:
        self.skip_blanks()
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in " \t\r\n":
            self.pos += 1
        return self.text[start:self.pos]

    def read_value(self, start_line: int) -> tuple[str, bool]:
        """The rest of the instruction; (value, was_quoted)."""
        self.skip_blanks()
        if self.text.startswith('"""', self.pos):
            end = self.text.find('"""', self.pos + 3)
            if end < 0:
                raise ModelfileError(start_line, 'unterminated """ string')
            value = self.advance_to(end)[3:]
            self.advance_to(end + 3)
            self._expect_line_end(start_line)
            return value, True
        if self.text.startswith('"', self.pos):
            return self._read_quoted(start_line), True
        return self.read_line().strip(), False

    def _read_quoted(self, start_line: int) -> str:
        out = []
        i = self.pos + 1
        while i < len(self.text):
            char = self.text[i]
            if char == "\\" and i + 1 < len(self.text) and self.text[i + 1] in '"\\':
                out.append(self.text[i + 1])
                i += 2
                continue
            if char == '"':
                self.advance_to(i + 1)
                self._expect_line_end(start_line)
                return "".join(out)
            out.append(char)
            i += 1
        raise ModelfileError(start_line, 'unterminated " string')

    def _expect_line_end(self, start_line: int) -> None:
        line = self.line
        rest = self.read_line()
        if rest.strip():
            raise ModelfileError(line, f"unexpected text after closing quote: '{rest.strip()}'")


def parse_modelfile(text: str) -> Modelfile:
    """Parse Modelfile text; raises ModelfileError(line, message)."""
    reader = _Reader(text)
    result = Modelfile(from_="")
    seen_from = False
    while not reader.at_end():
        reader.skip_blanks()
        if reader.at_end() or reader.text[reader.pos] in "#\r\n":
            reader.read_line()
            continue
        line = reader.line
        word = reader.read_word()
        instruction = word.lower()
        if instruction not in INSTRUCTIONS:
            raise ModelfileError(line, f"unknown instruction '{word}'")
        if instruction == "parameter":
            _parse_parameter_line(reader, line, result)
            continue
        if instruction == "message":
            role = reader.read_word().lower()
            if role not in MESSAGE_ROLES:
                raise ModelfileError(line, f"MESSAGE role must be one of {', '.join(MESSAGE_ROLES)},"
                                           f" got '{role}'")
            content, _ = reader.read_value(line)
            result.messages.append({"role": role, "content": content})
            continue
        value, quoted = reader.read_value(line)
        if not value and not (quoted and instruction in ("template", "system", "license")):
            raise ModelfileError(line, f"{word.upper()} needs a value")
        result.lines[instruction] = line
        if instruction == "from":
            if seen_from:
                raise ModelfileError(line, "FROM may appear only once")
            seen_from = True
            result.from_, result.from_line = value, line
        elif instruction == "license":
            result.license.append(value)
        else:
            setattr(result, instruction, value)
    if not seen_from:
        raise ModelfileError(1, "missing FROM instruction")
    return result


def _parse_parameter_line(reader: _Reader, line: int, result: Modelfile) -> None:
    name = reader.read_word().lower()
    if not name:
        raise ModelfileError(line, "PARAMETER needs a name and a value")
    if name in UNSUPPORTED_PARAMETERS:
        raise ModelfileError(line, f"parameter '{name}' is not supported: "
                                   f"{UNSUPPORTED_PARAMETERS[name]}")
    if name not in PARAMETER_TYPES:
        raise ModelfileError(line, f"unknown parameter '{name}'")
    raw, quoted = reader.read_value(line)
    if not raw and not quoted:
        raise ModelfileError(line, f"PARAMETER {name} needs a value")
    try:
        value = parse_parameter(name, raw)
    except ValueError as error:
        raise ModelfileError(line, str(error)) from None
    if PARAMETER_TYPES[name] is list:
        result.parameters.setdefault(name, []).append(value)
    else:
        result.parameters[name] = value
