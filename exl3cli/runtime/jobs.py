"""The two request kinds the in-process runner serves: /api/generate and /api/chat.

A job turns its request dict into prompt token ids (applying the manifest's SYSTEM,
TEMPLATE and MESSAGEs the way Ollama does) and shapes the streamed response objects.
"""

from __future__ import annotations

import threading
from typing import Any

from exl3cli.errors import ContextOverflow, InvalidOption
from exl3cli.runtime.images import (
    check_prompt_ids,
    image_prompt_ids,
    request_has_images,
    with_image_placeholders,
)
from exl3cli.runtime.logprobs import logprob_request
from exl3cli.runtime.options import now_iso, refuse_unsupported
from exl3cli.runtime.tool_arguments import render_messages, with_decoded_arguments
from exl3cli.runtime.tool_calls import ToolCallParser

_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"


class ThinkingSplitter:
    """Routes a reply's leading `<think>...</think>` block to `thinking`, the rest to
    `content`. Tags may arrive split over several deltas, so a possible tag prefix is
    held back until it is decided. Disabled, it passes everything through as content.
    """

    def __init__(self, enabled: bool):
        self._state = "start" if enabled else "content"
        self._pending = ""

    def push(self, text: str) -> list[tuple[str, str]]:
        if self._state == "content":
            return [("content", text)] if text else []
        self._pending += text
        out: list[tuple[str, str]] = []
        if self._state == "start":
            stripped = self._pending.lstrip()
            if _THINK_OPEN.startswith(stripped):
                return out  # still could become "<think>"
            if stripped.startswith(_THINK_OPEN):
                self._state = "thinking"
                self._pending = stripped[len(_THINK_OPEN):].lstrip("\n")
            else:
                self._state = "content"
                text, self._pending = self._pending, ""
                return [("content", text)]
        # thinking: emit all but a tail that could be the start of "</think>"
        end = self._pending.find(_THINK_CLOSE)
        if end >= 0:
            thought = self._pending[:end]
            rest = self._pending[end + len(_THINK_CLOSE):].lstrip("\n")
            self._pending = ""
            self._state = "content"
            if thought:
                out.append(("thinking", thought))
            if rest:
                out.append(("content", rest))
            return out
        keep = _partial_suffix(self._pending, _THINK_CLOSE)
        ready = self._pending[:len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep:]
        if ready:
            out.append(("thinking", ready))
        return out

    def flush(self) -> list[tuple[str, str]]:
        text, self._pending = self._pending, ""
        if not text:
            return []
        return [("thinking" if self._state == "thinking" else "content", text)]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def _think_enabled(value: Any) -> bool:
    if isinstance(value, str):
        return value.lower() not in ("", "false", "0", "no", "off")
    return bool(value)


class _Job:
    """What generate and chat share: model name, streaming flag, thinking, metrics."""

    response_key = ""

    def __init__(self, req: dict):
        if not isinstance(req, dict):
            raise InvalidOption("request must be a JSON object")
        model = req.get("model") or req.get("name")
        if not model or not isinstance(model, str):
            raise InvalidOption("model is required")
        refuse_unsupported(req)
        self.req = req
        self.model = model
        self.max_tokens: int | None = None  # set by the runner: the context to fit
        self.streaming = req.get("stream", True) is not False
        self.think = _think_enabled(req.get("think"))
        self.top_logprobs = logprob_request(req)  # None: no logprobs wanted
        self.recorder: Any = None  # the LogprobRecorder sampling this job, if any
        fmt = req.get("format")
        if fmt not in (None, "", "json") and not isinstance(fmt, dict):
            raise InvalidOption(f"invalid format: {fmt!r} (use \"json\" or a JSON schema)")
        self.has_images = request_has_images(req)

    def thinking_splitter(self) -> ThinkingSplitter:
        return ThinkingSplitter(self.think)

    def tool_parser(self) -> ToolCallParser:
        """Finds tool calls in the answer (only chat requests that declare tools)."""
        return ToolCallParser(None)

    def _base(self) -> dict[str, Any]:
        return {"model": self.model, "created_at": now_iso()}

    def final(self, pieces: list[tuple[str, str]] | None, done_reason: str,
              metrics: dict[str, int], warnings: list[str],
              context: list[int] | None) -> dict[str, Any]:
        content = "".join(p for kind, p in pieces or [] if kind == "content")
        thinking = "".join(p for kind, p in pieces or [] if kind == "thinking")
        calls = [call for kind, p in pieces or [] if kind == "tool_calls" for call in p]
        body = self._base()
        body.update(self._final_payload(content, thinking))
        if calls:
            body["message"]["tool_calls"] = calls
        body["done"] = True
        body["done_reason"] = done_reason
        body.update(metrics)
        if warnings:
            body["warnings"] = warnings
        if context is not None:
            self._attach_context(body, context)
        return body

    def _attach_context(self, body: dict[str, Any], context: list[int]) -> None:
        pass

    def _final_payload(self, content: str, thinking: str) -> dict[str, Any]:
        raise NotImplementedError


class PromptTooLong(ContextOverflow):
    """A prompt whose text alone proves it cannot fit: it was not tokenized."""

    def __init__(self, at_least: int, limit: int):
        super().__init__(f"the prompt is at least {at_least} tokens, which does not fit the "
                         f"context window of {limit} tokens (raise num_ctx)")
        self.at_least = at_least


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one vocabulary entry spells (byte-level pieces spell one
    character per byte), so a text of n characters holds at least n / this tokens."""
    cached = getattr(tokenizer, "_exl3_longest_token", None)
    if cached is None:
        backend = getattr(tokenizer, "backend", None)
        vocab = backend.get_vocab(with_added_tokens=True) if backend is not None else {}
        cached = max((len(piece) for piece in vocab), default=0) or 64
        try:
            tokenizer._exl3_longest_token = cached
        except AttributeError:
            pass
    return cached


def encode_prompt(tokenizer: Any, text: str, max_tokens: int | None) -> list[int]:
    """Token ids of `text`; PromptTooLong, without tokenizing, when its length alone
    shows that it has `max_tokens` tokens or more (a 20 MB body is refused at once)."""
    if max_tokens is not None:
        at_least = len(text) // (2 * longest_token_chars(tokenizer))  # 2: normalizer slack
        if at_least >= max_tokens:
            raise PromptTooLong(at_least, max_tokens)
    return list(tokenizer.encode(text))


def render_prompt_ids(text_model: Any, messages: list[dict], tools: Any,
                      template: str | None, think: bool | None,
                      max_tokens: int | None = None) -> list[int]:
    """Token ids of `messages` rendered with the model's chat template, or with
    `template` (a Modelfile/request TEMPLATE) in its place. `think` reaches the template
    as `enable_thinking`, the switch thinking models' templates read. With `max_tokens`
    a text too long to fit is refused before tokenizing (PromptTooLong)."""
    from exl3cli.engine.text.chat_template import ChatTemplate

    chat_template = (ChatTemplate.from_folder(text_model.folder, template=template)
                     if template else text_model.chat_template)
    if think and not supports_thinking(chat_template.source):
        raise InvalidOption("this model does not support thinking (its chat template has no "
                            "thinking switch); leave think unset or false")
    extra = {} if think is None else {"enable_thinking": think}
    messages, images = with_image_placeholders(text_model, messages)
    text = render_messages(chat_template, messages, tools, **extra)  # tool_arguments.py
    if images:
        return image_prompt_ids(text_model, text, images,
                                lambda t: encode_prompt(text_model.tokenizer, t, max_tokens))
    return encode_prompt(text_model.tokenizer, text, max_tokens)


def supports_thinking(template_source: str) -> bool:
    """Whether a chat template knows thinking: it reads `enable_thinking` or writes
    `<think>` (Qwen3, DeepSeek-R1 style)."""
    return "enable_thinking" in template_source or _THINK_OPEN in template_source


# Fill-in-the-middle token spellings: StarCoder/SmolLM, then Qwen2.5-Coder.
FIM_TOKENS = (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
              ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))


def fill_in_middle_ids(tokenizer: Any, prefix: str, suffix: str) -> list[int]:
    """Prompt ids asking the model for the text between `prefix` and `suffix`
    (prefix-suffix-middle order); InvalidOption when the tokenizer has no FIM tokens."""
    for names in FIM_TOKENS:
        ids = [tokenizer.token_to_id(name) for name in names]
        if all(i is not None for i in ids):
            start, hole, middle = ids
            return ([start] + list(tokenizer.encode(prefix, add_bos=False)) + [hole]
                    + list(tokenizer.encode(suffix, add_bos=False)) + [middle])
    raise InvalidOption("suffix needs a fill-in-the-middle model (its tokenizer has no "
                        "<fim_prefix>/<fim_suffix>/<fim_middle> tokens)")


def _message_list(value: Any) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise InvalidOption("messages must be a list of objects")
    for message in value:
        if message.get("role") not in ("system", "user", "assistant", "tool"):
            raise InvalidOption(f"invalid message role: {message.get('role')!r}")
    return [with_decoded_arguments(dict(m)) for m in value]


def _explicit_think(req: dict) -> bool | None:
    return None if req.get("think") is None else _think_enabled(req.get("think"))


def _drop_oldest(messages: list[dict], count: int) -> list[dict]:
    """`messages` without its `count` oldest non-system ones (never the last one)."""
    droppable = [i for i, m in enumerate(messages[:-1]) if m.get("role") != "system"]
    gone = set(droppable[:count])
    return [m for i, m in enumerate(messages) if i not in gone]


class GenerateJob(_Job):
    """/api/generate: one prompt, optional system/template/raw/context."""

    def droppable(self, manifest: dict[str, Any]) -> int:
        return 0

    def is_load_only(self) -> bool:
        return not self.req.get("prompt") and not self.req.get("images")

    def prompt_ids(self, text_model: Any, manifest: dict[str, Any]) -> list[int]:
        prompt = self.req.get("prompt") or ""
        if not isinstance(prompt, str):
            raise InvalidOption("prompt must be a string")
        suffix = self.req.get("suffix")
        if suffix:
            return fill_in_middle_ids(text_model.tokenizer, prompt, str(suffix))
        if self.req.get("raw"):
            raw = {"role": "user", "content": prompt, "images": self.req.get("images")}
            [raw], images = with_image_placeholders(text_model, [raw])
            if images:
                return image_prompt_ids(
                    text_model, raw["content"], images,
                    lambda t: encode_prompt(text_model.tokenizer, t, self.max_tokens))
            return encode_prompt(text_model.tokenizer, prompt, self.max_tokens)
        context = check_prompt_ids(text_model, self.req.get("context") or [], "context token")
        messages: list[dict] = []
        system = self.req.get("system") or manifest.get("system")
        if system:
            messages.append({"role": "system", "content": system})
        if not context:  # a continued conversation already holds the model's MESSAGEs
            messages.extend(_message_list(manifest.get("messages")))
        messages.append({"role": "user", "content": prompt, "images": self.req.get("images")})
        template = self.req.get("template") or manifest.get("template")
        limit = None if self.max_tokens is None else max(1, self.max_tokens - len(context))
        ids = render_prompt_ids(text_model, messages, None, template,
                                _explicit_think(self.req), limit)
        return context + ids

    def chunk(self, text: str, kind: str) -> dict[str, Any]:
        body = self._base()
        if kind == "thinking":
            body.update({"response": "", "thinking": text})
        else:
            body["response"] = text
        body["done"] = False
        return body

    def _final_payload(self, content: str, thinking: str) -> dict[str, Any]:
        payload: dict[str, Any] = {"response": content}
        if thinking:
            payload["thinking"] = thinking
        return payload

    def _attach_context(self, body: dict[str, Any], context: list[int]) -> None:
        body["context"] = context


class ChatJob(_Job):
    """/api/chat: a message list, optional tools. A conversation too long for the
    context loses its oldest turns (system messages stay), as in Ollama."""

    def droppable(self, manifest: dict[str, Any]) -> int:
        count = len(_message_list(manifest.get("messages"))) + len(self.req.get("messages") or [])
        return max(0, count - 1)

    def is_load_only(self) -> bool:
        return not self.req.get("messages")

    def prompt_ids(self, text_model: Any, manifest: dict[str, Any], drop: int = 0) -> list[int]:
        request_messages = _message_list(self.req.get("messages"))
        messages = _message_list(manifest.get("messages")) + request_messages
        system = manifest.get("system")
        if system and (not messages or messages[0].get("role") != "system"):
            messages.insert(0, {"role": "system", "content": system})
        messages = _drop_oldest(messages, drop)
        template = self.req.get("template") or manifest.get("template")
        return render_prompt_ids(text_model, messages, self.req.get("tools"), template,
                                 _explicit_think(self.req), self.max_tokens)

    def tool_parser(self) -> ToolCallParser:
        return ToolCallParser(self.req.get("tools"))

    def chunk(self, text: Any, kind: str) -> dict[str, Any]:
        body = self._base()
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        if kind == "tool_calls":
            message["tool_calls"] = text
        else:
            message["thinking" if kind == "thinking" else "content"] = text
        body["message"] = message
        body["done"] = False
        return body

    def _final_payload(self, content: str, thinking: str) -> dict[str, Any]:
        message = {"role": "assistant", "content": content}
        if thinking:
            message["thinking"] = thinking
        return {"message": message}


def fit_prompt(job: Any, text_model: Any, manifest: dict[str, Any], num_ctx: int,
               cancel: threading.Event | None = None) -> list[int]:
    """The job's prompt ids, dropping the fewest old chat turns that make it fit in
    `num_ctx` (a binary search: about log2(turns) renders, not one per dropped turn).
    `cancel` is checked between renders. When nothing makes it
    fit, the shortest prompt is returned (or PromptTooLong raised) for the caller."""
    def render(drop: int) -> list[int] | None:
        if cancel is not None and cancel.is_set():
            raise ContextOverflow("request cancelled while its prompt was built")
        try:
            return job.prompt_ids(text_model, manifest, drop=drop) if drop else \
                job.prompt_ids(text_model, manifest)
        except PromptTooLong:
            if drop >= most:
                raise
            return None  # certainly too long; dropping more may help

    most = job.droppable(manifest)
    ids = render(0)
    if ids is not None and len(ids) < num_ctx or most == 0:
        return ids if ids is not None else render(most)
    shortest = render(most)
    if shortest is None or len(shortest) >= num_ctx:
        return shortest
    low, high, best = 1, most - 1, shortest  # invariant: dropping high + 1 fits
    while low <= high:
        middle = (low + high) // 2
        candidate = render(middle)
        if candidate is not None and len(candidate) < num_ctx:
            best, high = candidate, middle - 1
        else:
            low = middle + 1
    return best
