"""Embedding routes: Ollama's /api/embed and legacy /api/embeddings, and OpenAI's
/v1/embeddings. The work (mean-pooled final hidden states) runs on a worker thread
through the runner (runtime/embeddings.py)."""

from __future__ import annotations

import base64
import struct
from typing import Any

from aiohttp import web

from exl3cli.server.ollama_routes import MANAGER, check_model
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
    read_json,
)

routes = web.RouteTableDef()


EMBED_FIELDS = {"model": (STR,), "name": (STR,), "input": (STR, LIST), "truncate": (BOOL,),
                "options": (OBJ,), "keep_alive": (STR, NUM), "dimensions": (INT,)}


@routes.post("/api/embed")
async def embed(request: web.Request) -> web.Response:
    body = await read_json(request)
    check_fields(body, EMBED_FIELDS)
    check_model(body)
    check_options(body.get("options"))
    check_list_of(body, "input", (STR,))
    manager = request.app[MANAGER]
    return web.json_response(await manager.blocking(manager.runner.embed, body))


@routes.post("/api/embeddings")
async def embeddings_legacy(request: web.Request) -> web.Response:
    """The older single-prompt endpoint: {prompt} -> {embedding} (not normalised)."""
    body = await read_json(request)
    check_fields(body, {"model": (STR,), "name": (STR,), "prompt": (STR,),
                        "options": (OBJ,), "keep_alive": (STR, NUM)})
    check_model(body)
    check_options(body.get("options"))
    manager = request.app[MANAGER]
    req = {**body, "input": [body.get("prompt") or ""]}
    req.pop("prompt", None)
    answer = await manager.blocking(manager.runner.embed, req, False)
    return web.json_response({"embedding": answer["embeddings"][0]})


EMBEDDING_FIELDS = {"model": (STR,), "input": (STR, LIST), "encoding_format": (STR,),
                    "dimensions": (INT,), "user": (STR,)}


def _embedding_value(vector: list[float], encoding: str) -> Any:
    if encoding == "base64":  # little-endian float32, what the openai client decodes
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


@routes.post("/v1/embeddings")
async def embeddings(request: web.Request) -> web.Response:
    body = await read_json(request)
    check_fields(body, EMBEDDING_FIELDS, required=("model",))
    check_list_of(body, "input", (STR,))
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise BadRequest("encoding_format must be float or base64")
    if body.get("input") in (None, "", []):
        raise BadRequest("input is required")
    req = {"model": body["model"], "input": body["input"]}
    if body.get("dimensions") is not None:
        req["dimensions"] = body["dimensions"]
    manager = request.app[MANAGER]
    answer = await manager.blocking(manager.runner.embed, req)
    data = [{"object": "embedding", "index": index,
             "embedding": _embedding_value(vector, encoding)}
            for index, vector in enumerate(answer["embeddings"])]
    tokens = answer["prompt_eval_count"]
    return web.json_response({"object": "list", "data": data, "model": body["model"],
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
