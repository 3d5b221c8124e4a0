"""Request guards: API key, Host-header check (DNS rebinding), and error shaping.

Each guard is an aiohttp middleware. Errors are answered in the shape the route's
clients expect: Ollama's `{"error": "..."}`, or OpenAI's nested object under `/v1/`.
"""

from __future__ import annotations

import fnmatch
import hmac
import logging
import os
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

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


# Origins a browser page may call from without EXL3_ORIGINS, as Ollama allows: pages
# served from this machine, and desktop-app / editor webviews.
DEFAULT_ORIGINS = ("http://localhost", "https://localhost", "http://localhost:*",
                   "https://localhost:*", "http://127.0.0.1", "https://127.0.0.1",
                   "http://127.0.0.1:*", "https://127.0.0.1:*", "http://[::1]", "https://[::1]",
                   "http://[::1]:*", "https://[::1]:*", "http://0.0.0.0", "https://0.0.0.0",
                   "http://0.0.0.0:*", "https://0.0.0.0:*", "app://*", "file://*",
                   "tauri://*", "vscode-webview://*", "vscode-file://*")


def allowed_origins(value: str | None = None) -> tuple[str, ...]:
    """The defaults plus EXL3_ORIGINS (comma-separated; `*` wildcards, e.g.
    `https://*.example.com`, or `*` for any origin)."""
    if value is None:
        value = os.environ.get("EXL3_ORIGINS", "")
    extra = tuple(item.strip().rstrip("/") for item in value.split(",") if item.strip())
    return DEFAULT_ORIGINS + extra


def origin_allowed(origin: str, patterns: tuple[str, ...]) -> bool:
    """Whether a browser's Origin header matches one of `patterns` (case-insensitive)."""
    origin = origin.strip().rstrip("/").lower()
    if origin == "null":  # sandboxed frames, redirects: no page we can trust
        return "null" in patterns
    parts = urlsplit(origin)
    if not parts.scheme or (parts.scheme in ("http", "https") and not parts.hostname):
        return False
    return any(fnmatch.fnmatchcase(origin, pattern.lower()) for pattern in patterns)


CORS_HEADERS: web.RequestKey[dict[str, str]] = web.RequestKey("cors_headers", dict)


def origin_middleware(patterns: tuple[str, ...]) -> Callable:
    """Refuse (403) a request whose Origin is not allowed: a web page on another site
    must not write to the store or run models, even with a `text/plain` body that
    needs no CORS preflight. Requests without Origin (curl, SDKs) pass. Allowed origins
    get the CORS headers, and their preflight (OPTIONS) an answer."""

    @web.middleware
    async def check_origin(request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if origin is None:
            return await handler(request)
        if not origin_allowed(origin, patterns):
            return error_response(request, Exl3Error("origin not allowed"), 403)
        cors = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            return web.Response(status=204, headers={
                **cors, "Access-Control-Allow-Methods": "GET, POST, PUT, DELETE, HEAD, OPTIONS",
                "Access-Control-Allow-Headers": request.headers.get(
                    "Access-Control-Request-Headers", "Authorization, Content-Type"),
                "Access-Control-Max-Age": "600"})
        request[CORS_HEADERS] = cors
        return await handler(request)

    return check_origin


async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: CORS headers for an allowed Origin, streams included."""
    cors = request.get(CORS_HEADERS)
    if cors:
        response.headers.update(cors)


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
    except ConnectionError as error:  # the client left: one line, no traceback
        log.info("client went away during %s %s (%s)", request.method, request.path,
                 type(error).__name__)
        return web.Response(status=499, reason="Client Closed Request")  # nobody reads it
    except TimeoutError:
        raise
    except Exception as error:  # a bug: answer, log, and keep serving
        log.exception("internal error on %s %s", request.method, request.path)
        return error_response(request, Exl3Error(f"internal error: {error}"), 500)
