"""Request bodies: parse, check field types, and turn errors into JSON answers.

Checks happen here, before any engine work, so a malformed request gets a 400 that
names the offending field instead of a 500 from deep inside the engine.
"""

from __future__ import annotations

import json
import math
from typing import Any

from aiohttp import web

from exl3cli.errors import Exl3Error, ModelNotFound
from exl3cli.store.modelfile import PARAMETER_TYPES


class BadRequest(Exl3Error):
    """A request body that is not valid JSON or has a field of the wrong type."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.http_status = status


# Readable names for the JSON types a field may have.
STR, BOOL, NUM, INT, OBJ, LIST, NULL = "string", "boolean", "number", "integer", "object", \
    "array", "null"


def json_type(value: Any) -> str:
    """The JSON type name of a decoded value (integers are also numbers)."""
    if value is None:
        return NULL
    if isinstance(value, bool):
        return BOOL
    if isinstance(value, int):
        return INT
    if isinstance(value, float):
        return NUM
    if isinstance(value, str):
        return STR
    if isinstance(value, list):
        return LIST
    if isinstance(value, dict):
        return OBJ
    return type(value).__name__


def _matches(value: Any, allowed: tuple[str, ...]) -> bool:
    kind = json_type(value)
    if kind in allowed:
        return True
    if kind == INT and NUM in allowed:
        return True
    return kind == NUM and INT in allowed and float(value).is_integer()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: web.Request, allow_empty: bool = False) -> dict[str, Any]:
    """The request body as a JSON object; BadRequest (400/413) otherwise."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BadRequest("request body too large", status=413) from None
    if not raw.strip():
        if allow_empty:
            return {}
        raise BadRequest("missing request body")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise BadRequest(f"invalid JSON in request body: {error}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {json_type(body)}")
    return body


def check_fields(body: dict[str, Any], schema: dict[str, tuple[str, ...]],
                 required: tuple[str, ...] = (), where: str = "") -> None:
    """Every field of `schema` present in `body` has one of its allowed JSON types.

    `null` is always allowed for an optional field (clients send it for "unset").
    """
    for name in required:
        if body.get(name) in (None, ""):
            raise BadRequest(f"{where}{name} is required")
    for name, allowed in schema.items():
        if name not in body or (body[name] is None and name not in required):
            continue
        if not _matches(body[name], allowed):
            raise BadRequest(f"invalid type for {where}{name}: expected "
                             f"{' or '.join(allowed)}, got {json_type(body[name])}")


def check_list_of(body: dict[str, Any], name: str, allowed: tuple[str, ...]) -> None:
    """`body[name]`, when set, is a list whose items have the allowed types."""
    items = body.get(name)
    if items is None:
        return
    for index, item in enumerate(items):
        if not _matches(item, allowed):
            raise BadRequest(f"invalid type for {name}[{index}]: expected "
                             f"{' or '.join(allowed)}, got {json_type(item)}")


_OPTION_TYPES = {int: (INT,), float: (NUM,), str: (STR,), list: (LIST, STR), bool: (BOOL,)}


def check_options(options: Any, where: str = "options.") -> None:
    """Known generation options have the right types and finite values (unknown ones
    are ignored later with a warning, as Ollama does)."""
    if options is None:
        return
    if not isinstance(options, dict):
        raise BadRequest(f"invalid type for options: expected object, got {json_type(options)}")
    for name, value in options.items():
        kind = PARAMETER_TYPES.get(name)
        if kind is None or value is None:
            continue
        allowed = _OPTION_TYPES.get(kind, (STR,))
        if not _matches(value, allowed):
            raise BadRequest(f"invalid type for {where}{name}: expected "
                             f"{' or '.join(allowed)}, got {json_type(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise BadRequest(f"{where}{name} must be a finite number")
        if isinstance(value, (int, float)) and abs(value) > 2**63 - 1:
            raise BadRequest(f"{where}{name} is out of range")
        if isinstance(value, list) and not all(isinstance(s, str) for s in value):
            raise BadRequest(f"{where}{name} must be a list of strings")


def ollama_error(error: Exception) -> web.Response:
    """Ollama's error body: {"error": "..."} with the error's status."""
    status = getattr(error, "http_status", 400)
    return web.json_response({"error": str(error)}, status=status)


_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                 403: "permission_error", 404: "not_found_error", 413: "invalid_request_error",
                 503: "server_busy"}


def openai_error_body(error: Exception, status: int) -> dict[str, Any]:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    code = "model_not_found" if isinstance(error, ModelNotFound) else None
    return {"error": {"message": str(error), "type": _OPENAI_TYPES.get(status, "api_error"),
                      "param": None, "code": code}}


def openai_error(error: Exception) -> web.Response:
    status = getattr(error, "http_status", 400)
    return web.json_response(openai_error_body(error, status), status=status)
