"""TabbyAPI's LoRA routes, on the current model (the one `/v1/model` shows):

- `GET /v1/loras`: the LoRAs that can be loaded, as TabbyAPI's LoraList
  (`{"object": "list", "data": [{"id", "object": "lora", "created", "owned_by"}]}`):
  PEFT folders in `EXL3_LORA_DIR` (default `~/.exl3/loras`) and stored models made
  with `ADAPTER`;
- `GET /v1/lora`: the LoRAs loaded on the current model, with their `scaling`;
- `POST /v1/lora/load` `{"loras": [{"name", "scaling"}]}` -> `{"success": [names],
  "failure": []}`: from then on every request on the current model that has no
  adapter of its own (a model made with ADAPTER keeps its own) runs with these LoRAs
  and those loaded before, summed. All or nothing: one LoRA that cannot be read or does
  not fit the model is a 400 naming it and the mismatch;
- `POST /v1/lora/unload`: requests run without them again.

Load and unload need the admin key when `EXL3_ADMIN_KEY` is set.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from exl3cli.runtime.adapters import available_loras, load_default_loras, unload_default_loras
from exl3cli.server.ollama_routes import MANAGER
from exl3cli.server.tabby_routes import NoModelLoaded
from exl3cli.server.validation import (
    BOOL,
    LIST,
    NUM,
    OBJ,
    STR,
    BadRequest,
    check_fields,
    check_list_of,
    read_json,
)

routes = web.RouteTableDef()


def lora_card(name: str, scaling: float | None = None) -> dict[str, Any]:
    return {"id": name, "object": "lora", "created": int(time.time()), "owned_by": "exl3",
            "scaling": scaling}


@routes.get("/v1/loras")
async def list_loras(request: web.Request) -> web.Response:
    manager = request.app[MANAGER]
    names = await manager.blocking(available_loras, manager.store)
    return web.json_response({"object": "list", "data": [lora_card(n) for n in names]})


@routes.get("/v1/lora")
async def active_loras(request: web.Request) -> web.Response:
    manager = request.app[MANAGER]
    loaded = await manager.blocking(manager.runner.current)
    loras = (loaded.default_loras or []) if loaded is not None else []
    return web.json_response({"object": "list", "data": [
        lora_card(entry["name"], entry.get("scaling")) for entry in loras]})


@routes.post("/v1/lora/load")
async def load_loras(request: web.Request) -> web.Response:
    body = await read_json(request)
    check_fields(body, {"loras": (LIST,), "skip_queue": (BOOL,)}, required=("loras",))
    check_list_of(body, "loras", (OBJ,))
    if not body["loras"]:
        raise BadRequest("loras: name at least one LoRA")
    for index, entry in enumerate(body["loras"]):
        check_fields(entry, {"name": (STR,), "scaling": (NUM,)}, required=("name",),
                     where=f"loras[{index}].")
    manager = request.app[MANAGER]
    runner = manager.runner

    def load() -> list[str]:
        loaded = runner.current()
        if loaded is None:
            raise NoModelLoaded()
        with runner.lock:
            return load_default_loras(manager.store, loaded, body["loras"], loaded.generator)

    names = await manager.blocking(load)
    return web.json_response({"success": names, "failure": []})


@routes.post("/v1/lora/unload")
async def unload_loras(request: web.Request) -> web.Response:
    manager = request.app[MANAGER]
    runner = manager.runner

    def unload() -> None:
        loaded = runner.current()
        if loaded is None:
            raise NoModelLoaded()
        with runner.lock:
            unload_default_loras(loaded, loaded.generator)

    await manager.blocking(unload)
    return web.json_response(None)
