"""The Ollama REST API: /, /api/version, generate, chat, tags, show, pull, create, copy,
delete, ps, embed. Bodies are exactly what `LocalClient` / `InferenceRunner` take and
return, so these handlers only validate, schedule and stream."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from aiohttp import web

from exl3cli import __version__
from exl3cli.errors import Exl3Error, ServerBusy
from exl3cli.runtime.options import parse_keep_alive
from exl3cli.server.batched_stream import BatchedJob
from exl3cli.server.limits import Limits, request_limits
from exl3cli.server.model_manager import ModelManager, StreamJob
from exl3cli.server.validation import (
    BOOL,
    INT,
    LIST,
    NUM,
    OBJ,
    STR,
    BadRequest,
    check_fields,
    check_images,
    check_list_of,
    check_options,
    check_token_list,
    check_tools,
    read_json,
)
from exl3cli.store.modelfile import Modelfile, parse_modelfile
from exl3cli.store.store_lock import LOCAL_TOKEN_HEADER

log = logging.getLogger(__name__)

MANAGER: web.AppKey[ModelManager] = web.AppKey("manager", ModelManager)
routes = web.RouteTableDef()

_COMMON = {"model": (STR,), "name": (STR,), "options": (OBJ,), "stream": (BOOL,),
           "keep_alive": (STR, NUM), "format": (STR, OBJ), "think": (BOOL, STR),
           "template": (STR,), "logprobs": (BOOL,), "top_logprobs": (INT,)}
GENERATE_FIELDS = {**_COMMON, "prompt": (STR,), "suffix": (STR,), "system": (STR,),
                   "raw": (BOOL,), "context": (LIST,), "images": (LIST,)}
CHAT_FIELDS = {**_COMMON, "messages": (LIST,), "tools": (LIST,)}
MESSAGE_FIELDS = {"role": (STR,), "content": (STR,), "images": (LIST,),
                  "tool_calls": (LIST,), "thinking": (STR,), "tool_name": (STR,)}


def client_gone(request: web.Request) -> bool:
    """True once the peer has closed its connection."""
    transport = request.transport
    return transport is None or transport.is_closing()


async def watch_disconnect(request: web.Request, job: StreamJob | BatchedJob) -> None:
    """Cancel `job` as soon as its client goes away, even while nothing is written
    (a long prefill, a non-streaming answer)."""
    while not client_gone(request):
        await asyncio.sleep(0.1)
    job.cancel.set()


def check_model(body: dict[str, Any]) -> None:
    if not (body.get("model") or body.get("name")):
        raise BadRequest("model is required")


def check_keep_alive(body: dict[str, Any]) -> None:
    if body.get("keep_alive") is not None:
        parse_keep_alive(body["keep_alive"])  # InvalidOption (400) when meaningless


def check_generate(body: dict[str, Any]) -> None:
    check_fields(body, GENERATE_FIELDS)
    check_model(body)
    check_options(body.get("options"))
    check_keep_alive(body)
    check_token_list(body, "context")
    check_list_of(body, "images", (STR,))
    check_images(body.get("images"))


def check_chat(body: dict[str, Any], limits: Limits | None = None) -> None:
    check_fields(body, CHAT_FIELDS)
    check_model(body)
    check_options(body.get("options"))
    check_keep_alive(body)
    check_list_of(body, "messages", (OBJ,))
    limit = (limits or Limits()).max_messages
    if len(body.get("messages") or []) > limit:
        raise BadRequest(f"too many messages: {len(body['messages'])} (at most {limit}; "
                         "the server's EXL3_MAX_MESSAGES)")
    check_tools(body.get("tools"))
    for index, message in enumerate(body.get("messages") or []):
        check_fields(message, MESSAGE_FIELDS, required=("role",), where=f"messages[{index}].")
        check_list_of(message, "images", (STR,))
        check_images(message.get("images"), where=f"messages[{index}].images")


async def run_inference(request: web.Request, kind: str,
                        body: dict[str, Any]) -> web.StreamResponse:
    """Queue the job; answer one object (stream: false) or NDJSON lines."""
    manager = request.app[MANAGER]
    job = await manager.inference(kind, body, client_gone=lambda: client_gone(request),
                                  client=request.remote or "")
    watcher = asyncio.get_running_loop().create_task(watch_disconnect(request, job))
    try:
        if body.get("stream") is False:
            items = [item async for item in job]
            if job.stopped_by_shutdown:
                raise ServerBusy("the server shut down before the answer was complete")
            return web.json_response(items[-1] if items else {})
        return await write_ndjson(request, job)
    finally:
        watcher.cancel()
        await job.close()


async def write_ndjson(request: web.Request, job: StreamJob | BatchedJob
                       ) -> web.StreamResponse:
    """Stream a job's objects one per line; a failure mid-stream ends it with an
    {"error": ...} line (the status is already sent)."""
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    try:
        await response.prepare(request)
        async for batch in job.batches():  # all pending lines in one write
            await response.write(b"".join(json.dumps(item).encode() + b"\n"
                                          for item in batch))
        if job.stopped_by_shutdown:
            await response.write(json.dumps(
                {"error": "the server shut down before the answer was complete"}
            ).encode() + b"\n")
    except ConnectionError:
        return response  # the client left; closing the job cancels the engine
    except Exception as error:
        if not isinstance(error, Exl3Error):
            log.exception("job failed mid-stream")
        try:
            await response.write(json.dumps({"error": str(error)}).encode() + b"\n")
        except ConnectionError:
            return response
    try:
        await response.write_eof()
    except ConnectionError:
        pass  # the client left after the last line
    return response


# ---- status --------------------------------------------------------------------------

@routes.get("/")
async def root(request: web.Request) -> web.Response:
    return web.Response(text="exl3 is running")


@routes.get("/api/version")
async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


@routes.get("/api/stats")
async def stats(request: web.Request) -> web.Response:
    """Job counters per model: active, queued, completed, cancelled, failed."""
    return web.json_response(request.app[MANAGER].stats())


# ---- inference -----------------------------------------------------------------------

@routes.post("/api/generate")
async def generate(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    check_generate(body)
    return await run_inference(request, "generate", body)


@routes.post("/api/chat")
async def chat(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    check_chat(body, request_limits(request))
    return await run_inference(request, "chat", body)


@routes.get("/api/ps")
async def ps(request: web.Request) -> web.Response:
    manager = request.app[MANAGER]
    return web.json_response(await manager.blocking(manager.runner.ps))


# ---- store ---------------------------------------------------------------------------

@routes.get("/api/tags")
async def tags(request: web.Request) -> web.Response:
    manager = request.app[MANAGER]
    return web.json_response(await manager.blocking(manager.local.list))


@routes.post("/api/show")
async def show(request: web.Request) -> web.Response:
    body = await read_json(request)
    check_fields(body, {"model": (STR,), "name": (STR,), "verbose": (BOOL,)})
    check_model(body)
    manager = request.app[MANAGER]
    shown = await manager.blocking(manager.local.show, body)
    shown.setdefault("capabilities", ["completion"])
    return web.json_response(shown)


@routes.post("/api/copy")
async def copy(request: web.Request) -> web.Response:
    body = await read_json(request)
    check_fields(body, {"source": (STR,), "destination": (STR,)},
                 required=("source", "destination"))
    manager = request.app[MANAGER]
    await manager.blocking(manager.local.copy, body)
    return web.Response(status=200)


@routes.delete("/api/delete")
async def delete(request: web.Request) -> web.Response:
    body = await read_json(request)
    check_fields(body, {"model": (STR,), "name": (STR,)})
    check_model(body)
    manager = request.app[MANAGER]
    await manager.blocking(manager.local.delete, body)
    return web.Response(status=200)


@routes.post("/api/pull")
async def pull(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    check_fields(body, {"model": (STR,), "name": (STR,), "stream": (BOOL,),
                        "insecure": (BOOL,)})
    check_model(body)
    manager = request.app[MANAGER]
    req = {"model": body.get("model") or body.get("name")}
    return await run_store_stream(request, body, lambda cancel: manager.local.pull(req))


@routes.post("/api/push")
async def push(request: web.Request) -> web.Response:
    raise BadRequest("push is not supported: exl3 has no registry to push to (share the "
                     "model folder, or `exl3 convert --out DIR`, instead)", status=501)


CREATE_FIELDS = {"model": (STR,), "name": (STR,), "modelfile": (STR,), "from": (STR,),
                 "template": (STR,), "system": (STR,), "license": (STR, LIST),
                 "parameters": (OBJ,), "messages": (LIST,), "stream": (BOOL,),
                 "quantize": (STR,), "files": (OBJ,), "adapters": (OBJ,),
                 "base_dir": (STR,)}


def create_request(body: dict[str, Any]) -> dict[str, Any]:
    """Our create body ({model, modelfile, base_dir}) from either Ollama form: Modelfile
    text, or the newer structured fields (`from`, `parameters`, `system`, ...)."""
    check_fields(body, CREATE_FIELDS)
    check_model(body)
    model = body.get("model") or body.get("name")
    req: dict[str, Any] = {"model": model}
    if body.get("base_dir"):
        req["base_dir"] = body["base_dir"]
    if body.get("quantize"):
        raise BadRequest("create: 'quantize' is not supported; name a model in "
                         "'from', or upload the model's files and list them in 'files'")
    if body.get("adapters"):  # a LoRA adapter's uploaded files (runtime/adapters.py)
        adapters = body["adapters"]
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in adapters.items()):
            raise BadRequest("adapters must map file names to blob digests (sha256:<hex>)")
        req["adapters"] = dict(adapters)
    if body.get("files"):
        files = body["files"]
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
            raise BadRequest("files must map file names to blob digests (sha256:<hex>)")
        req["files"] = dict(files)
    if body.get("modelfile"):
        parse_modelfile(body["modelfile"])  # a bad Modelfile is a 400, before streaming
        req["modelfile"] = body["modelfile"]
        return req
    if not body.get("from") and not req.get("files"):
        raise BadRequest("create needs 'from' (a model name), 'files' (uploaded blobs) "
                         "or a 'modelfile'")
    check_options(body.get("parameters"), where="parameters.")
    check_list_of(body, "messages", (OBJ,))
    messages = []
    for index, message in enumerate(body.get("messages") or []):
        check_fields(message, {"role": (STR,), "content": (STR,)}, required=("role",),
                     where=f"messages[{index}].")
        messages.append({"role": message["role"], "content": message.get("content") or ""})
    license_ = body.get("license")
    licenses = [license_] if isinstance(license_, str) else list(license_ or [])
    check_list_of({"license": licenses}, "license", (STR,))
    parameters = {k: v for k, v in (body.get("parameters") or {}).items() if v is not None}
    req["modelfile"] = Modelfile(
        from_=body.get("from") or "files", parameters=parameters, template=body.get("template"),
        system=body.get("system"), license=licenses, messages=messages,
    ).to_text()
    return req


def is_local_cli(request: web.Request, store: Any) -> bool:
    """Whether the request shows the store's local token (store/store_lock.py): only then
    does create read server paths (FROM a folder or GGUF file, base_dir)."""
    given = request.headers.get(LOCAL_TOKEN_HEADER, "")
    return bool(given) and hmac.compare_digest(given.encode(),
                                               store.local_token().encode())


@routes.post("/api/create")
async def create(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    req = create_request(body)
    manager = request.app[MANAGER]
    local = await manager.blocking(is_local_cli, request, manager.store)
    if not local:
        req.pop("base_dir", None)
    return await run_store_stream(
        request, body, lambda cancel: manager.local.create(req, allow_paths=local))


def blob_digest(request: web.Request) -> str:
    """The digest in /api/blobs/{digest} (`sha256:<hex>`, or `sha256-<hex>`)."""
    digest = request.match_info["digest"].replace("sha256-", "sha256:", 1)
    try:
        request.app[MANAGER].store.blob_path(digest)
    except Exl3Error:
        raise BadRequest(f"invalid blob digest {request.match_info['digest']!r} "
                         "(expected sha256:<64 hex digits>)") from None
    return digest


@routes.head("/api/blobs/{digest}")
async def blob_exists(request: web.Request) -> web.Response:
    digest = blob_digest(request)
    store = request.app[MANAGER].store
    return web.Response(status=200 if await request.app[MANAGER].blocking(
        store.has_blob, digest) else 404)


@routes.post("/api/blobs/{digest}")
async def blob_upload(request: web.Request) -> web.Response:
    """Store the body as the blob `digest` (Ollama's upload for /api/create `files`);
    400 when the body's digest differs. The body is streamed to disk, never held."""
    digest = blob_digest(request)
    manager = request.app[MANAGER]
    chunks: queue.Queue = queue.Queue(maxsize=8)
    end = object()

    def pull_chunks() -> Iterator[bytes]:
        while (chunk := chunks.get()) is not end:
            yield chunk

    stopped = threading.Event()

    def write() -> str:
        try:
            return manager.store.add_blob_from_stream(pull_chunks(), digest)
        finally:
            stopped.set()

    def feed(chunk: object) -> None:
        while not stopped.is_set():  # a writer that failed reads no more
            try:
                chunks.put(chunk, timeout=0.2)
                return
            except queue.Full:
                continue

    writer = asyncio.ensure_future(manager.blocking(write))
    loop = asyncio.get_running_loop()
    try:
        async for chunk in request.content.iter_chunked(1 << 20):
            if stopped.is_set():
                break  # it failed; its error is raised below
            await loop.run_in_executor(None, feed, chunk)
    finally:
        await loop.run_in_executor(None, feed, end)
    await writer
    return web.Response(status=201)


async def run_store_stream(request: web.Request, body: dict[str, Any],
                           factory: Callable[[threading.Event], Iterator[dict]]
                           ) -> web.StreamResponse:
    """Pull/create progress: NDJSON lines, or the last line alone (stream: false)."""
    job = request.app[MANAGER].stream(factory)
    try:
        await job.first()  # errors before any progress get a proper status
        if body.get("stream") is False:
            items = [item async for item in job]
            return web.json_response(items[-1] if items else {"status": "success"})
        return await write_ndjson(request, job)
    finally:
        await job.close()
