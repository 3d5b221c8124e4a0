"""Two keys, as in TabbyAPI: an API key for using models, an admin key for changing what
is loaded and stored.

With `EXL3_ADMIN_KEY` set, the admin routes (load/unload a model, pull, create, copy,
delete, push) need the admin key; every other route needs the API key or the admin key
(or nothing, when no API key is set). A key comes as `Authorization: Bearer <key>`,
`x-api-key: <key>` or `x-admin-key: <key>`. The request's permission ("admin" or "api")
is stored under `request[PERMISSION]` (GET /v1/auth/permission answers it).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from aiohttp import web

from exl3cli.errors import Exl3Error
from exl3cli.server.security import OPEN_PATHS, Handler, error_response

# aiohttp >= 3.12 wants typed request keys; older ones take the plain string.
PERMISSION: Any = web.RequestKey("permission", str) if hasattr(web, "RequestKey") \
    else "permission"

ADMIN_ROUTES = {("POST", "/v1/model/load"), ("POST", "/v1/model/unload"),
                ("POST", "/v1/lora/load"), ("POST", "/v1/lora/unload"),
                ("POST", "/api/pull"), ("POST", "/api/create"), ("POST", "/api/copy"),
                ("DELETE", "/api/delete"), ("POST", "/api/push")}


def presented_keys(request: web.Request) -> list[str]:
    """Every key the request carries, in TabbyAPI's order of precedence."""
    keys = [request.headers.get("x-admin-key", ""), request.headers.get("x-api-key", "")]
    authorization = request.headers.get("Authorization", "").strip()
    if authorization.lower().startswith("bearer "):
        keys.append(authorization[7:].strip())
    return [key for key in keys if key]


def _matches(keys: list[str], expected: str | None) -> bool:
    return bool(expected) and any(hmac.compare_digest(k.encode(), expected.encode())
                                  for k in keys)


def admin_key_middleware(admin_key: str, api_key: str | None = None) -> Callable:
    """The middleware enforcing both keys (it replaces the API-key-only one)."""

    @web.middleware
    async def check_keys(request: web.Request, handler: Handler) -> web.StreamResponse:
        keys = presented_keys(request)
        if _matches(keys, admin_key):
            request[PERMISSION] = "admin"
        elif _matches(keys, api_key) or not api_key:
            request[PERMISSION] = "api"
        if request.path not in OPEN_PATHS:
            if (request.method, request.path) in ADMIN_ROUTES:
                if request.get(PERMISSION) != "admin":
                    return _unauthorized(request, "this route needs the admin key "
                                                  "(EXL3_ADMIN_KEY)")
            elif PERMISSION not in request:
                return _unauthorized(request, "unauthorized: a valid API key is required")
        return await handler(request)

    return check_keys


def _unauthorized(request: web.Request, message: str) -> web.Response:
    response = error_response(request, Exl3Error(message), 401)
    response.headers["WWW-Authenticate"] = "Bearer"
    return response
