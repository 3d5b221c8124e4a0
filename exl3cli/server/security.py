"""Request guards: API key, Host-header check (DNS rebinding), and error shaping.

Each guard is an aiohttp middleware. Errors are answered in the shape the route's
clients expect: Ollama's `{"error": "..."}`, or OpenAI's nested object under `/v1/`.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from exl3cli.errors import Exl3Error
from exl3cli.hostaddr import is_loopback_name
from exl3cli.server.validation import BadRequest, openai_error_body

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Paths anyone may ask, so a client can tell that a daemon is there at all.
OPEN_PATHS = ("/", "/api/version", "/health")


def error_response(request: web.Request, error: Exception, status: int) -> web.Response:
    """A JSON error in the shape the route's clients parse."""
    if request.path.startswith("/v1/"):
        return web.json_response(openai_error_body(error, status), status=status)
    return web.json_response({"error": str(error)}, status=status)


def _host_allowed(host_header: str, bind_host: str) -> bool:
    """Loopback names, and the exact name the daemon was bound to, are allowed."""
    if not host_header:
        return True  # HTTP/1.0 clients; browsers always send Host
    host = host_header.strip()
    if host.startswith("["):
        host = host[1:host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    return is_loopback_name(host) or host.lower() == bind_host.lower()


def host_check_middleware(bind_host: str) -> Callable:
    """Refuse requests whose Host is not local while bound to loopback: a web page on
    an attacker's domain that resolves to 127.0.0.1 must not reach the daemon."""

    @web.middleware
    async def check_host(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not _host_allowed(request.headers.get("Host", ""), bind_host):
            return error_response(request, Exl3Error("host not allowed"), 403)
        return await handler(request)

    return check_host


def api_key_middleware(api_key: str) -> Callable:
    """Every request (but the liveness paths) needs `Authorization: Bearer <key>`."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "").strip().encode()
            if not hmac.compare_digest(given, expected):
                response = error_response(
                    request, Exl3Error("unauthorized: a valid API key is required"), 401)
                response.headers["WWW-Authenticate"] = "Bearer"
                return response
        return await handler(request)

    return check_key


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Library errors become their status; anything unexpected a logged 500."""
    try:
        return await handler(request)
    except Exl3Error as error:
        return error_response(request, error, getattr(error, "http_status", 400))
    except web.HTTPRequestEntityTooLarge:
        return error_response(request, BadRequest("request body too large", 413), 413)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        reason = error.reason.lower() if error.reason else "error"
        if error.status == 404:
            reason = f"{request.method} {request.path}: no such route"
        response = error_response(request, Exl3Error(reason), error.status)
        if error.status == 405:
            response.headers["Allow"] = error.headers.get("Allow", "")
        return response
    except (ConnectionError, TimeoutError):
        raise  # the client is gone; nothing to answer
    except Exception as error:  # a bug: answer, log, and keep serving
        log.exception("internal error on %s %s", request.method, request.path)
        return error_response(request, Exl3Error(f"internal error: {error}"), 500)
