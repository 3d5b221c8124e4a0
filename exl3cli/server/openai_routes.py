"""The OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/models.

Requests are translated into Ollama chat/generate bodies (openai_requests.py) and run
through the same model manager; the answers are translated back here (SSE chunks
ending `data: [DONE]`, usage from Ollama's counters). TabbyAPI-style sampler fields
are accepted as extra body fields and passed on as options.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

from aiohttp import web

from exl3cli.errors import Exl3Error, ModelNotFound
from exl3cli.runtime.logprobs import completion_logprobs
from exl3cli.server.batched_stream import BatchedJob
from exl3cli.server.limits import request_limits
from exl3cli.server.model_manager import StreamJob
from exl3cli.server.ollama_routes import MANAGER, client_gone, watch_disconnect
from exl3cli.server.openai_requests import chat_request, completion_request
from exl3cli.server.validation import BadRequest, openai_error_body, read_json

log = logging.getLogger(__name__)
routes = web.RouteTableDef()


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


async def _write_sse(request: web.Request, job: StreamJob | BatchedJob, shape: _Shape,
                     include_usage: bool) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    pending: list[bytes] = []  # the events of one batch of objects, written at once

    def send(payload: Any) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        pending.append(f"data: {data}\n\n".encode())

    async def flush() -> None:
        if pending:
            data = b"".join(pending)
            pending.clear()
            await response.write(data)

    try:
        await response.prepare(request)
        state = {"first": True, "called": 0}
        ended = False
        async for batch in job.batches():
            for item in batch:
                if _send_item(item, shape, include_usage, state, send):
                    ended = True
                    break
            await flush()
            if ended:
                break
        if job.stopped_by_shutdown:
            send(openai_error_body(
                Exl3Error("the server shut down before the answer was complete"), 503))
        send("[DONE]")
        await flush()
    except ConnectionError:
        return response
    except Exception as error:
        if not isinstance(error, Exl3Error):
            log.exception("job failed mid-stream")
        try:
            await flush()
            send(openai_error_body(error, getattr(error, "http_status", 500)))
            await flush()
        except ConnectionError:
            return response
    try:
        await response.write_eof()
    except ConnectionError:
        pass  # the client left after the last chunk
    return response


def _send_item(item: dict[str, Any], shape: _Shape, include_usage: bool,
               state: dict[str, Any], send: Callable[[Any], None]) -> bool:
    """Queue the SSE chunks of one response object; True at the final one."""
    text, thinking = shape.text_of(item)
    calls = shape.calls_of(item)
    logprobs = item.get("logprobs")  # present when the request asked for them
    if calls:
        send(_with_usage(shape.chunk("", "", state["first"], None, openai_tool_calls(
            calls, start=state["called"], streaming=True)), include_usage))
        state["first"] = False
        state["called"] += len(calls)
    if item.get("done"):
        if text or thinking or logprobs:
            send(_with_usage(shape.chunk(text, thinking, state["first"], None,
                                         logprobs=logprobs), include_usage))
            state["first"] = False
        send(_with_usage(shape.chunk("", "", state["first"],
                                     _finish_reason(item, state["called"] > 0)),
                         include_usage))
        if include_usage:
            usage_chunk = shape.envelope(shape.object + (".chunk" if shape.chat else ""), [])
            usage_chunk["usage"] = _usage(item)
            send(usage_chunk)
        return True
    if text or thinking:
        send(_with_usage(shape.chunk(text, thinking, state["first"], None,
                                     logprobs=logprobs), include_usage))
        state["first"] = False
    return False


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
