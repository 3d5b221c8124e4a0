"""The daemon's aiohttp application: routes, guards, and the model manager's lifecycle."""

from __future__ import annotations

import os
from typing import Any

from aiohttp import web

from exl3cli.hostaddr import HostAddress, parse_host
from exl3cli.server import embed_routes, lora_routes, ollama_routes, openai_routes, tabby_routes
from exl3cli.server.admin_keys import admin_key_middleware
from exl3cli.server.limits import LIMITS, Limits
from exl3cli.server.model_manager import ModelManager
from exl3cli.server.security import (
    add_cors_headers,
    allowed_origins,
    api_key_middleware,
    error_middleware,
    host_check_middleware,
    origin_middleware,
)


def create_app(store: Any = None, *, host: HostAddress | None = None,
               api_key: str | None = None, num_parallel: int | None = None,
               max_queue: int | None = None, max_body: int | None = None,
               manager: ModelManager | None = None, origins: str | None = None,
               limits: Limits | None = None, shutdown_grace: float = 0.0,
               admin_key: str | None = None) -> web.Application:
    """The daemon for `store` (default: EXL3_MODELS). `host` is where it is bound: when
    that is loopback, requests must carry a local Host header. `api_key` defaults to
    EXL3_API_KEY; when set, requests need `Authorization: Bearer <key>`. `origins`
    (default EXL3_ORIGINS) adds browser origins to the local ones allowed; `limits`
    (default: from the environment, see server/limits.py) bound each request.
    On shutdown, running jobs get `shutdown_grace` seconds to finish. `admin_key`
    (EXL3_ADMIN_KEY) guards loading and the store's writes (server/admin_keys.py)."""
    if store is None:
        from exl3cli.store.store import ModelStore

        store = ModelStore()
    host = host or parse_host()
    if api_key is None:
        api_key = os.environ.get("EXL3_API_KEY") or None
    limits = limits or Limits.from_env()
    if max_body is not None:
        limits = Limits(max_body=max_body, max_messages=limits.max_messages,
                        max_client_jobs=limits.max_client_jobs)
    middlewares = [error_middleware]
    if host.is_loopback:
        middlewares.append(host_check_middleware(host.host))
    middlewares.append(origin_middleware(allowed_origins(origins)))
    admin_key = admin_key or os.environ.get("EXL3_ADMIN_KEY") or None
    if admin_key:
        middlewares.append(admin_key_middleware(admin_key, api_key))
    elif api_key:
        middlewares.append(api_key_middleware(api_key))
    app = web.Application(middlewares=middlewares, client_max_size=limits.max_body)
    app[LIMITS] = limits
    app.on_response_prepare.append(add_cors_headers)
    manager = manager or ModelManager(store, num_parallel=num_parallel, max_queue=max_queue,
                                      max_client_jobs=limits.max_client_jobs)
    app[ollama_routes.MANAGER] = manager
    app.add_routes(ollama_routes.routes)
    app.add_routes(openai_routes.routes)
    app.add_routes(embed_routes.routes)
    app.add_routes(tabby_routes.routes)
    app.add_routes(lora_routes.routes)

    async def start(_app: web.Application) -> None:
        await manager.start()

    async def stop(_app: web.Application) -> None:
        await manager.shutdown(shutdown_grace)

    async def cleanup(_app: web.Application) -> None:
        manager.close()

    app.on_startup.append(start)
    app.on_shutdown.append(stop)
    app.on_cleanup.append(cleanup)
    return app
