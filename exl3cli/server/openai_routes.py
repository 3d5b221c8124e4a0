"""The OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/models.

Requests are translated into Ollama chat/generate bodies and run through the same
model manager; the answers are translated back (SSE chunks ending `data: [DONE]`,
usage from Ollama's counters). TabbyAPI-style sampler fields are accepted as extra
body fields and passed on as options.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from datetime import datetime
from typing import Any

from aiohttp import web

from exl3cli.errors import Exl3Error, ModelNotFound
from exl3cli.runtime.logprobs import completion_logprobs
from exl3cli.runtime.options import known_option_names
from exl3cli.server.limits import request_limits
from exl3cli.server.model_manager import StreamJob
from exl3cli.server.ollama_routes import MANAGER, check_keep_alive, client_gone, watch_disconnect
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
    openai_error_body,
    read_json,
)

log = logging.getLogger(__name__)
routes = web.RouteTableDef()

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


def _usage(final: dict[str, Any]) -> dict[str, Any]:
    # prompt_eval_count counts only evaluated tokens; reused prefix tokens are "cached".
    cached = final.get("prompt_cache_count") or 0
    prompt = (final.get("prompt_eval_count") or 0) + cached
    completion = final.get("eval_count") or 0
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _finish_reason(final: dict[str, Any], called: bool = False) -> str:
    if called:
        return "tool_calls"
    return "length" if final.get("done_reason") == "length" else "stop"


def openai_tool_calls(calls: list[dict[str, Any]], start: int = 0,
                      streaming: bool = False) -> list[dict[str, Any]]:
    """Ollama-shaped calls ({"function": {"name", "arguments": {...}}}) in OpenAI's
    shape: an id, type "function", and the arguments as JSON text."""
    out = []
    for offset, call in enumerate(calls):
        function = call.get("function") or {}
        entry: dict[str, Any] = {
            "id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": function.get("name", ""),
                         "arguments": json.dumps(function.get("arguments") or {})}}
        if streaming:
            entry["index"] = start + offset
        out.append(entry)
    return out


class _Shape:
    """How one endpoint's objects look (chat vs text completion)."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": "fp_exl3", "choices": choices}

    def text_of(self, item: dict[str, Any]) -> tuple[str, str]:
        if self.chat:
            message = item.get("message") or {}
            return message.get("content") or "", message.get("thinking") or ""
        return item.get("response") or "", item.get("thinking") or ""

    def calls_of(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        return list((item.get("message") or {}).get("tool_calls") or []) if self.chat else []

    def logprobs(self, entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        """Ollama-shaped entries as this endpoint shows them (None: not asked for)."""
        if entries is None:
            return None
        return {"content": entries} if self.chat else completion_logprobs(entries)

    def chunk(self, text: str, thinking: str, first: bool, finish: str | None,
              calls: list[dict[str, Any]] | None = None,
              logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if calls:
                delta["tool_calls"] = calls
            elif text or finish is None:
                delta["content"] = text
            if thinking:
                delta["reasoning"] = thinking
            choice = {"index": 0, "delta": delta, "finish_reason": finish,
                      "logprobs": self.logprobs(logprobs)}
            return self.envelope("chat.completion.chunk", [choice])
        return self.envelope("text_completion", [{"index": 0, "text": text,
                                                  "logprobs": self.logprobs(logprobs),
                                                  "finish_reason": finish}])

    def whole(self, text: str, thinking: str, final: dict[str, Any],
              calls: list[dict[str, Any]] | None = None,
              logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["reasoning"] = thinking
            if calls:
                message["tool_calls"] = openai_tool_calls(calls)
                message["content"] = text or None
            choice = {"index": 0, "message": message,
                      "finish_reason": _finish_reason(final, bool(calls)),
                      "logprobs": self.logprobs(logprobs)}
        else:
            choice = {"index": 0, "text": text, "logprobs": self.logprobs(logprobs),
                      "finish_reason": _finish_reason(final)}
        body = self.envelope(self.object, [choice])
        body["usage"] = _usage(final)
        return body


async def _run(request: web.Request, kind: str, req: dict[str, Any],
               body: dict[str, Any]) -> web.StreamResponse:
    manager = request.app[MANAGER]
    job = await manager.inference(kind, req, client_gone=lambda: client_gone(request),
                                  client=request.remote or "")
    watcher = asyncio.get_running_loop().create_task(watch_disconnect(request, job))
    shape = _Shape(kind == "chat", req["model"])
    try:
        if body.get("stream"):
            include = bool((body.get("stream_options") or {}).get("include_usage"))
            return await _write_sse(request, job, shape, include)
        texts, thoughts, calls, final = [], [], [], {}
        logprobs: list[dict[str, Any]] | None = [] if req.get("logprobs") else None
        async for item in job:
            if item.get("done"):
                final = item
            text, thinking = shape.text_of(item)
            texts.append(text)
            thoughts.append(thinking)
            calls.extend(shape.calls_of(item))
            if logprobs is not None:
                logprobs.extend(item.get("logprobs") or [])
        return web.json_response(shape.whole("".join(texts), "".join(thoughts), final,
                                             calls, logprobs))
    finally:
        watcher.cancel()
        await job.close()


async def _write_sse(request: web.Request, job: StreamJob, shape: _Shape,
                     include_usage: bool) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})

    async def send(payload: Any) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        await response.write(f"data: {data}\n\n".encode())

    try:
        await response.prepare(request)
        first = True
        called = 0
        async for item in job:
            text, thinking = shape.text_of(item)
            calls = shape.calls_of(item)
            logprobs = item.get("logprobs")  # present when the request asked for them
            if calls:
                await send(_with_usage(shape.chunk("", "", first, None, openai_tool_calls(
                    calls, start=called, streaming=True)), include_usage))
                first = False
                called += len(calls)
            if item.get("done"):
                if text or thinking or logprobs:
                    await send(_with_usage(shape.chunk(text, thinking, first, None,
                                                       logprobs=logprobs), include_usage))
                    first = False
                await send(_with_usage(shape.chunk("", "", first,
                                                   _finish_reason(item, called > 0)),
                                       include_usage))
                if include_usage:
                    usage_chunk = shape.envelope(shape.object + (".chunk" if shape.chat
                                                                 else ""), [])
                    usage_chunk["usage"] = _usage(item)
                    await send(usage_chunk)
                break
            if text or thinking:
                await send(_with_usage(shape.chunk(text, thinking, first, None,
                                                   logprobs=logprobs), include_usage))
                first = False
        if job.stopped_by_shutdown:
            await send(openai_error_body(
                Exl3Error("the server shut down before the answer was complete"), 503))
        await send("[DONE]")
    except ConnectionError:
        return response
    except Exception as error:
        if not isinstance(error, Exl3Error):
            log.exception("job failed mid-stream")
        try:
            await send(openai_error_body(error, getattr(error, "http_status", 500)))
        except ConnectionError:
            return response
    try:
        await response.write_eof()
    except ConnectionError:
        pass  # the client left after the last chunk
    return response


def _with_usage(chunk: dict[str, Any], include_usage: bool) -> dict[str, Any]:
    if include_usage:
        chunk["usage"] = None  # OpenAI sends null usage on every chunk but the last
    return chunk


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    limit = request_limits(request).max_messages
    if isinstance(body.get("messages"), list) and len(body["messages"]) > limit:
        raise BadRequest(f"too many messages: {len(body['messages'])} (at most {limit}; "
                         "the server's EXL3_MAX_MESSAGES)")
    return await _run(request, "chat", chat_request(body), body)


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    return await _run(request, "generate", completion_request(body), body)


def _model_object(model: dict[str, Any]) -> dict[str, Any]:
    name = model["name"]
    try:
        created = int(datetime.fromisoformat(model["modified_at"].replace("Z", "+00:00"))
                      .timestamp())
    except (KeyError, ValueError):
        created = 0
    owner = name.split("/")[-2] if name.count("/") >= 1 else "library"
    return {"id": name, "object": "model", "created": created, "owned_by": owner}


@routes.get("/v1/models")
async def models(request: web.Request) -> web.Response:
    manager = request.app[MANAGER]
    listed = await manager.blocking(manager.local.list)
    return web.json_response({"object": "list",
                              "data": [_model_object(m) for m in listed["models"]]})


@routes.get("/v1/models/{model:.+}")
async def model(request: web.Request) -> web.Response:
    manager = request.app[MANAGER]
    wanted = request.match_info["model"]
    listed = await manager.blocking(manager.local.list)
    for entry in listed["models"]:
        if wanted in (entry["name"], entry["name"].removesuffix(":latest")):
            return web.json_response(_model_object(entry))
    raise ModelNotFound(f"The model '{wanted}' does not exist")
