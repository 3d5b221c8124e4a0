"""TabbyAPI's model and token routes, for clients written against TabbyAPI/ExLlama:

- `GET /health` -> `{"status": "healthy"}` (no key needed);
- `GET /v1/model`: the current (most recently used) loaded model as a model card; 400
  when none is loaded;
- `POST /v1/model/load` `{name | model_name}`: load a store model and keep it loaded
  until unloaded; answers TabbyAPI's SSE progress (one `finished` event);
- `POST /v1/model/unload`: unload the loaded models (those no request is using);
- `POST /v1/token/encode` `{text | messages, add_bos_token}` -> `{tokens, length}`;
- `POST /v1/token/decode` `{tokens, decode_special_tokens}` -> `{text}`;
- `GET /v1/auth/permission` -> `{"permission": "admin" | "api"}`.

Token routes use the model named in `model` (an exl3 extension) or else the current one.
Load and unload need the admin key when `EXL3_ADMIN_KEY` is set (server/admin_keys.py).
"""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

from exl3cli.errors import Exl3Error
from exl3cli.server.admin_keys import PERMISSION
from exl3cli.server.ollama_routes import MANAGER
from exl3cli.server.validation import (
    BOOL,
    INT,
    LIST,
    STR,
    BadRequest,
    check_fields,
    check_list_of,
    read_json,
)

routes = web.RouteTableDef()

LOAD_FIELDS = {"name": (STR,), "model_name": (STR,)}
TOKEN_FIELDS = {"model": (STR,), "add_bos_token": (BOOL,), "encode_special_tokens": (BOOL,),
                "decode_special_tokens": (BOOL,)}


class NoModelLoaded(Exl3Error):
    def __init__(self) -> None:
        super().__init__("No models are currently loaded (POST /v1/model/load first, or "
                         "name one in `model`)")


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "healthy"})


@routes.get("/v1/auth/permission")
async def permission(request: web.Request) -> web.Response:
    # without EXL3_ADMIN_KEY every caller may do everything
    return web.json_response({"permission": request.get(PERMISSION, "admin")})


def model_card(loaded: Any) -> dict[str, Any]:
    generator = loaded.generator
    cache = getattr(generator, "cache_type", None) if generator is not None else None
    return {
        "id": loaded.name, "object": "model", "created": int(time.time()), "owned_by": "exl3",
        "parameters": {
            "max_seq_len": loaded.context_length or loaded.text_model.context_length({}),
            "cache_mode": str(getattr(cache, "name", cache) or "fp16").upper(),
        },
    }


@routes.get("/v1/model")
async def current_model(request: web.Request) -> web.Response:
    manager = request.app[MANAGER]
    loaded = await manager.blocking(manager.runner.current)
    if loaded is None:
        raise NoModelLoaded()
    return web.json_response(model_card(loaded))


@routes.post("/v1/model/load")
async def load_model(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    extra = sorted(set(body) - set(LOAD_FIELDS))
    if extra:
        raise BadRequest(f"/v1/model/load: {', '.join(extra)} not supported here (set num_ctx, "
                         "kv_cache_type or DRAFT in a Modelfile, or per request)")
    check_fields(body, LOAD_FIELDS)
    name = body.get("name") or body.get("model_name")
    if not name:
        raise BadRequest("A model name was not provided for load.")
    manager = request.app[MANAGER]
    load = {"model": name, "prompt": "", "keep_alive": -1}  # loaded until unloaded
    await manager.blocking(lambda: list(manager.runner.generate(load)))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    event = {"model_type": "model", "module": 1, "modules": 1, "status": "finished"}
    await response.write(f"data: {json.dumps(event)}\n\n".encode())
    await response.write_eof()
    return response


@routes.post("/v1/model/unload")
async def unload_model(request: web.Request) -> web.Response:
    manager = request.app[MANAGER]
    if await manager.blocking(manager.runner.current) is None:
        raise NoModelLoaded()
    await manager.blocking(manager.runner.unload_all)
    return web.json_response(None)


async def _text_model(request: web.Request, body: dict[str, Any]) -> Any:
    manager = request.app[MANAGER]
    if body.get("model"):
        loaded = await manager.blocking(manager.runner.loaded_model, body["model"])
    else:
        loaded = await manager.blocking(manager.runner.current)
        if loaded is None:
            raise NoModelLoaded()
    return loaded.text_model


@routes.post("/v1/token/encode")
async def encode_tokens(request: web.Request) -> web.Response:
    body = await read_json(request)
    check_fields(body, {**TOKEN_FIELDS, "text": (STR, LIST)}, required=("text",))
    text_model = await _text_model(request, body)
    add_bos = body.get("add_bos_token", True) is not False
    text = body["text"]
    if isinstance(text, list):
        if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in text):
            raise BadRequest("text: a string, or a list of messages {role, content}")
        text = text_model.chat_template.render(text, add_generation_prompt=False)
        add_bos = False  # a chat template writes its own BOS
    tokens = [int(t) for t in text_model.tokenizer.encode(text, add_bos=add_bos)]
    return web.json_response({"tokens": tokens, "length": len(tokens)})


@routes.post("/v1/token/decode")
async def decode_tokens(request: web.Request) -> web.Response:
    body = await read_json(request)
    check_fields(body, {**TOKEN_FIELDS, "tokens": (LIST,)}, required=("tokens",))
    check_list_of(body, "tokens", (INT,))
    text_model = await _text_model(request, body)
    vocab = text_model.tokenizer.vocab_size
    if any(not 0 <= int(t) < vocab for t in body["tokens"]):
        raise BadRequest(f"tokens: ids must be in 0..{vocab - 1}")
    skip = body.get("decode_special_tokens", True) is False
    text = text_model.tokenizer.decode([int(t) for t in body["tokens"]],
                                       skip_special_tokens=skip)
    return web.json_response({"text": text})
