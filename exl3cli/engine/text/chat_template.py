"""Render chat messages into a prompt with the model's Jinja2 chat template.

The environment matches what transformers gives templates (sandboxed, trim_blocks,
lstrip_blocks, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII,
the `{% generation %}` marker), so templates written for Hugging Face render the same.
Messages are handed over the way transformers' `apply_chat_template` hands them:
keys whose value is None dropped, the reasoning under all its names (`thinking`,
`reasoning_content`), `documents` None, and the tokenizer's special tokens (bos, eos,
unk, pad) as variables.
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from exl3cli.errors import ChatTemplateError

# Used when a model ships no template (base models): a single prompt passes through
# unchanged, as Ollama's default "{{ .Prompt }}" does; a conversation becomes a
# plain "Role: text" transcript that ends with "Assistant:".
FALLBACK_TEMPLATE = (
    "{%- if messages | length == 1 and messages[0]['role'] == 'user' -%}"
    "{{ messages[0]['content'] }}"
    "{%- else -%}"
    "{%- for message in messages -%}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}{{ '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}Assistant:{%- endif -%}"
    "{%- endif -%}"
)


class _GenerationMarker(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    for rendering it is transparent."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters and ASCII-fies text; HF's does neither.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


DEFAULT_TEMPLATE_TIMEOUT = 5.0  # seconds one render may take
DEFAULT_TEMPLATE_MAX_BYTES = 32 * 1024 * 1024  # characters one render may produce


def template_limits() -> tuple[float, int]:
    """(seconds, characters) a render may take: EXL3_TEMPLATE_TIMEOUT and
    EXL3_TEMPLATE_MAX_BYTES, else the defaults."""
    def read(name: str, default: float) -> float:
        text = os.environ.get(name, "").strip()
        try:
            return float(text) if text else default
        except ValueError:
            raise ChatTemplateError(f"{name} must be a number, got {text!r}") from None
    return (read("EXL3_TEMPLATE_TIMEOUT", DEFAULT_TEMPLATE_TIMEOUT),
            int(read("EXL3_TEMPLATE_MAX_BYTES", DEFAULT_TEMPLATE_MAX_BYTES)))


class _RenderBudget(threading.local):
    """The running render's deadline and size limit (one render per thread at a time)."""

    deadline: float = float("inf")
    max_chars: int = DEFAULT_TEMPLATE_MAX_BYTES

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError("chat template took too long to render "
                                    "(EXL3_TEMPLATE_TIMEOUT)")

    def check_size(self, size: int) -> None:
        if size > self.max_chars:
            raise ChatTemplateError(f"chat template rendered more than {self.max_chars} "
                                    "characters (EXL3_TEMPLATE_MAX_BYTES)")


_BUDGET = _RenderBudget()


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, plus a clock checked at every call and attribute read, and `*`/`**`
    that refuse to build huge strings, lists or numbers: a template (a request may send
    its own) cannot pin a worker or fill memory."""

    intercepted_binops = frozenset(["*", "**"])

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _BUDGET.check_time()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _BUDGET.check_time()
        return super().getattr(obj, attribute)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _BUDGET.check_time()
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 1024 \
                and isinstance(left, (int, float)) and abs(left) > 1:
            raise ChatTemplateError("chat template: exponent too large")
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
                    _BUDGET.check_size(len(seq) * count)
        return super().call_binop(context, operator, left, right)


def _new_environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[loopcontrols, _GenerationMarker],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _pick_named_template(entries: list[Any]) -> str | None:
    """tokenizer_config.json may hold [{"name": ..., "template": ...}]: take "default"."""
    templates = {
        entry.get("name"): entry.get("template")
        for entry in entries
        if isinstance(entry, dict) and isinstance(entry.get("template"), str)
    }
    if "default" in templates:
        return templates["default"]
    return next(iter(templates.values()), None)


def _read_template_source(folder: Path) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    for name in ("tokenizer_config.json", "chat_template.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, list):
            value = _pick_named_template(value)
        if isinstance(value, str) and value.strip():
            return value
    return None


def _special_token(folder: Path, key: str) -> str:
    path = folder / "tokenizer_config.json"
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError, AttributeError):
        return ""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def template_message(message: Any) -> Any:
    """`message` as a template sees it (as in transformers): None values dropped, and
    its reasoning, under whichever name it came, also as `thinking` (gpt-oss templates)
    and `reasoning_content` (Qwen3, GLM-4.5, DeepSeek)."""
    if not isinstance(message, dict):
        return message
    kept = {key: value for key, value in message.items() if value is not None}
    reasoning = next((kept[key] for key in _REASONING_KEYS if key in kept), None)
    if reasoning is not None:
        kept = {"thinking": reasoning, **kept, "reasoning_content": reasoning}
    return kept


class ChatTemplate:
    """A compiled chat template plus the special tokens it may refer to."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "",
                 other_tokens: dict[str, str] | None = None):
        self.is_fallback = source is None
        self.other_tokens = dict(other_tokens or {})  # unk_token, pad_token when named
        self.source = FALLBACK_TEMPLATE if source is None else source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _new_environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"chat template syntax error on line {exc.lineno}: {exc.message}"
            ) from exc

    @classmethod
    def from_folder(cls, folder: str | Path, template: str | None = None) -> ChatTemplate:
        """The template given (a Modelfile TEMPLATE), else chat_template.jinja, else the
        `chat_template` of tokenizer_config.json / chat_template.json, else the fallback."""
        folder = Path(folder)
        source = template if template is not None else _read_template_source(folder)
        return cls(
            source,
            bos_token=_special_token(folder, "bos_token"),
            eos_token=_special_token(folder, "eos_token"),
            other_tokens={key: value for key in ("unk_token", "pad_token")
                          if (value := _special_token(folder, key))},
        )

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages`; extra keyword arguments become template variables."""
        variables = {
            **self.other_tokens,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "documents": None,
            **extra,
            "messages": [template_message(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
        }
        timeout, max_chars = template_limits()
        _BUDGET.deadline, _BUDGET.max_chars = time.monotonic() + timeout, max_chars
        try:
            pieces: list[str] = []
            size = 0
            for piece in self._template.generate(**variables):
                pieces.append(piece)
                size += len(piece)
                _BUDGET.check_size(size)
                _BUDGET.check_time()
            return "".join(pieces)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError,
                ZeroDivisionError, RecursionError, MemoryError) as exc:
            raise ChatTemplateError(f"chat template failed: {exc!r}") from exc
        finally:
            _BUDGET.deadline = float("inf")
