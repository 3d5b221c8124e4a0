"""OpenAI request bodies translated into Ollama ones (the /v1 routes: openai_routes.py).

`chat_request` (/v1/chat/completions -> an /api/chat body) and `completion_request`
(/v1/completions -> a raw /api/generate body) check the fields, refuse what exl3 cannot
honour (n > 1, forced tool calls, remote image URLs, prompt batches) with BadRequest,
and map the sampling fields: `sampling_options` takes Ollama's option names plus
TabbyAPI / ExLlama spellings (`OPTION_ALIASES`), max_tokens as num_predict, and
response_format as Ollama's format.
"""

from __future__ import annotations

from typing import Any

from exl3cli.runtime.options import known_option_names
from exl3cli.server.ollama_routes import check_keep_alive
from exl3cli.server.validation import (
    BOOL,
    INT,
    LIST,
    NUM,
    OBJ,
    STR,
    BadRequest,
    check_fields,
    check_list_of,
    check_options,
    check_tools,
    data_url_image,
)

_SAMPLING = {"model": (STR,), "stream": (BOOL,), "stream_options": (OBJ,),
             "logprobs": (BOOL, INT), "top_logprobs": (INT,),
             "max_tokens": (INT,), "max_completion_tokens": (INT,), "temperature": (NUM,),
             "top_p": (NUM,), "stop": (STR, LIST), "seed": (INT,), "n": (INT,),
             "presence_penalty": (NUM,), "frequency_penalty": (NUM,),
             "response_format": (OBJ,), "user": (STR,), "keep_alive": (STR, NUM)}
CHAT_FIELDS = {**_SAMPLING, "messages": (LIST,), "tools": (LIST,)}
COMPLETION_FIELDS = {**_SAMPLING, "prompt": (STR, LIST), "suffix": (STR,), "echo": (BOOL,)}
# TabbyAPI / ExLlama spellings of options we know under Ollama's names.
OPTION_ALIASES = {"repetition_penalty": "repeat_penalty", "typical": "typical_p",
                  "penalty_range": "repeat_last_n", "repetition_range": "repeat_last_n"}
_ROLES = {"system": "system", "developer": "system", "user": "user",
          "assistant": "assistant", "tool": "tool"}


def sampling_options(body: dict[str, Any]) -> dict[str, Any]:
    """Ollama options from OpenAI fields plus any extra sampler fields."""
    options: dict[str, Any] = {}
    known = known_option_names()
    for name, value in body.items():
        target = OPTION_ALIASES.get(name, name)
        if target in known and value is not None:
            options[target] = value
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None:
        if limit < 1:
            raise BadRequest("max_tokens must be at least 1")
        options["num_predict"] = int(limit)
    if isinstance(options.get("stop"), str):
        options["stop"] = [options["stop"]]
    check_options(options, where="")
    return options


def _format(body: dict[str, Any]) -> Any:
    spec = body.get("response_format")
    if not spec:
        return None
    kind = spec.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        wrapper = spec.get("json_schema")
        schema = wrapper.get("schema") if isinstance(wrapper, dict) else None
        if not isinstance(schema, dict):
            raise BadRequest("response_format.json_schema.schema must be an object")
        return schema
    raise BadRequest(f"response_format.type must be text, json_object or json_schema, "
                     f"got {kind!r}")


def _common(body: dict[str, Any], fields: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    check_fields(body, fields, required=("model",))
    if body.get("n") not in (None, 1):
        raise BadRequest("n: only one choice per request is supported")
    logprobs = body.get("logprobs")
    if logprobs:
        # chat: logprobs true + top_logprobs N; completions: logprobs N (alternatives)
        top = body.get("top_logprobs") if isinstance(logprobs, bool) else logprobs
        if not isinstance(top, (int, type(None))) or isinstance(top, bool):
            raise BadRequest("top_logprobs must be an integer")
        req_logprobs = {"logprobs": True, "top_logprobs": top or 0}
    elif body.get("top_logprobs"):
        raise BadRequest("top_logprobs needs logprobs: true")
    else:
        req_logprobs = {}
    include = (body.get("stream_options") or {}).get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise BadRequest("stream_options.include_usage must be a boolean")
    req: dict[str, Any] = {"model": body["model"], "stream": True,
                           "options": sampling_options(body), **req_logprobs}
    fmt = _format(body)
    if fmt is not None:
        req["format"] = fmt
    if body.get("keep_alive") is not None:
        check_keep_alive(body)
        req["keep_alive"] = body["keep_alive"]
    return req


def _message_parts(content: Any, where: str) -> tuple[str, list[str]]:
    """OpenAI content: a string, or a list of parts: text parts joined, image_url parts
    as base64 images (data URLs; remote URLs are refused: exl3 does not fetch)."""
    if content is None or isinstance(content, str):
        return content or "", []
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of parts")
    texts, images = [], []
    for index, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "image_url":
            images.append(data_url_image(part.get("image_url"), f"{where}.content[{index}]"))
            continue
        if not isinstance(part, dict) or part.get("type") != "text" \
                or not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}.content: only text and image_url parts are supported")
        texts.append(part["text"])
    return "".join(texts), images


def chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """The /api/chat body for a /v1/chat/completions body."""
    req = _common(body, CHAT_FIELDS)
    check_list_of(body, "messages", (OBJ,))
    check_tools(body.get("tools"))
    if not body.get("messages"):
        raise BadRequest("messages is required")
    messages = []
    for index, message in enumerate(body["messages"]):
        where = f"messages[{index}]"
        role = message.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise BadRequest(f"{where}.role must be one of {', '.join(_ROLES)}")
        text, images = _message_parts(message.get("content"), where)
        converted: dict[str, Any] = {"role": _ROLES[role], "content": text}
        if images:
            converted["images"] = images
        if isinstance(message.get("tool_calls"), list):
            converted["tool_calls"] = message["tool_calls"]
        if role == "tool" and isinstance(message.get("name"), str):
            converted["tool_name"] = message["name"]
        messages.append(converted)
    req["messages"] = messages
    choice = _tool_choice(body.get("tool_choice"))
    if body.get("tools") and choice == "auto":
        req["tools"] = body["tools"]
    return req


def _tool_choice(choice: Any) -> str:
    """"auto" (the model decides) or "none" (tools are not offered); a forced call
    ("required", a named function) is refused rather than answered with prose."""
    if choice in (None, "auto", "none"):
        return choice or "auto"
    raise BadRequest('tool_choice: only "auto" and "none" are supported (the model cannot '
                     'be forced to call a tool yet)')


def completion_request(body: dict[str, Any]) -> dict[str, Any]:
    """The /api/generate body (raw: the prompt is completed as written)."""
    req = _common(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise BadRequest("prompt: give one string (batches are not supported)")
        prompt = prompt[0]
    if not prompt:
        raise BadRequest("prompt is required")
    req.update(prompt=prompt, raw=True)
    if body.get("suffix"):
        req["suffix"] = body["suffix"]  # fill-in-the-middle, or a 400 for other models
    return req
