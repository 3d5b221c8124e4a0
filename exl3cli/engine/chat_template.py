"""Render chat messages into a prompt with the model's Jinja2 chat template.

The environment matches what transformers gives templates (sandboxed, trim_blocks,
lstrip_blocks, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII,
the `{% generation %}` marker), so templates written for Hugging Face render the same.
"""

from __future__ import annotations

import json
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


def _new_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
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


class ChatTemplate:
    """A compiled chat template plus the special tokens it may refer to."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        self.is_fallback = source is None
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
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **extra,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
        }
        try:
            return self._template.render(**variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template failed: {exc!r}") from exc
