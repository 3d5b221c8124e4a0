"""Request bodies: parse, check field types, and turn errors into JSON answers.

Checks happen here, before any engine work, so a malformed request gets a 400 that
names the offending field instead of a 500 from deep inside the engine.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from typing import Any

from aiohttp import web

from exl3cli.errors import Exl3Error, ModelNotFound
from exl3cli.runtime.options import check_option_value
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
    check_text(body)
    return body


def check_text(value: Any) -> None:
    """Every string in a decoded body (keys too) is valid Unicode: JSON lets a client
    send a lone surrogate such as "\\ud800", which no tokenizer can encode."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as error:
                raise BadRequest("request body holds text that is not valid Unicode "
                                 f"(a lone surrogate at character {error.start})") from None


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
        check_option_value(name, value, where)


MAX_TOKEN_ID = 2**31 - 1


def check_token_list(body: dict[str, Any], name: str) -> None:
    """`body[name]` (e.g. generate's `context`), when set, is a list of token ids: the
    model's vocabulary is checked later, once the model is known."""
    for index, item in enumerate(body.get(name) or []):
        if not _matches(item, (INT,)) or not 0 <= item <= MAX_TOKEN_ID:
            raise BadRequest(f"{name}[{index}] must be a token id (a non-negative integer), "
                             f"got {item!r}")


def check_tools(tools: Any, where: str = "tools") -> None:
    """Tools in the shape Ollama and OpenAI both use:
    [{"type": "function", "function": {"name", "description"?, "parameters"?}}]."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise BadRequest(f"{where} must be a list of tools")
    for index, tool in enumerate(tools):
        at = f"{where}[{index}]"
        if not isinstance(tool, dict):
            raise BadRequest(f"{at} must be an object")
        if tool.get("type", "function") != "function":
            raise BadRequest(f"{at}.type must be \"function\"")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise BadRequest(f"{at}.function must be an object with a name")
        if not isinstance(function.get("name"), str) or not function["name"].strip():
            raise BadRequest(f"{at}.function.name must be a non-empty string")
        if function.get("description") is not None \
                and not isinstance(function["description"], str):
            raise BadRequest(f"{at}.function.description must be a string")
        if function.get("parameters") is not None \
                and not isinstance(function["parameters"], dict):
            raise BadRequest(f"{at}.function.parameters must be a JSON schema object")


def check_images(images: Any, where: str = "images") -> None:
    """Images must be base64 text. Whether the model reads them is the runner's call:
    a text-only model refuses them with a 400 (runtime/images.py)."""
    if not images:
        return
    for index, image in enumerate(images):
        try:
            base64.b64decode(image, validate=True)
        except (binascii.Error, ValueError, TypeError):
            raise BadRequest(f"{where}[{index}] is not valid base64") from None


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


def data_url_image(image_url: Any, where: str) -> str:
    """The base64 payload of an OpenAI image_url part ({"url": "data:image/...;base64,
    ..."} or the URL as a string). Remote URLs are refused: exl3 does not fetch them."""
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str) or not url:
        raise BadRequest(f"{where}.image_url.url must be a data URL string")
    if not url.startswith("data:"):
        raise BadRequest(f"{where}.image_url: remote image URLs are not fetched; send the "
                         "image inline as a data URL (data:image/png;base64,...)")
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise BadRequest(f"{where}.image_url: a data URL must be base64 "
                         "(data:image/png;base64,...)")
    check_images([payload], where=f"{where}.image_url")
    return payload
