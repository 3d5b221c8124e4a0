"""Limits a host can set on what one request may ask of the daemon, read once from
the environment when the app is made. Each has a default that keeps one careless or
hostile client from pinning the server; each is named in the README and `serve --help`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from aiohttp import web

from exl3cli.errors import Exl3Error

DEFAULT_MAX_BODY = 16 * 1024 * 1024
DEFAULT_MAX_MESSAGES = 4096
DEFAULT_MAX_CLIENT_JOBS = 0  # 0: no per-client bound (the per-model queue still applies)

# (variable, meaning) for `exl3 serve --help`; the README lists the same.
LIMIT_VARIABLES = (
    ("EXL3_MAX_BODY", f"largest request body in bytes (default {DEFAULT_MAX_BODY})"),
    ("EXL3_MAX_MESSAGES", f"most chat messages in one request (default {DEFAULT_MAX_MESSAGES})"),
    ("EXL3_MAX_CLIENT_JOBS", "most generate/chat jobs one client address may have running "
                             "or queued (default 0: no bound)"),
)


def env_int(name: str, default: int, minimum: int = 0) -> int:
    """An integer setting from the environment; Exl3Error naming it when malformed."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return max(minimum, int(text))
    except ValueError:
        raise Exl3Error(f"{name} must be an integer, got {text!r}") from None


@dataclass(frozen=True)
class Limits:
    """What one request may ask: body bytes, chat messages, jobs per client address."""

    max_body: int = DEFAULT_MAX_BODY
    max_messages: int = DEFAULT_MAX_MESSAGES
    max_client_jobs: int = DEFAULT_MAX_CLIENT_JOBS

    @classmethod
    def from_env(cls) -> Limits:
        return cls(max_body=env_int("EXL3_MAX_BODY", DEFAULT_MAX_BODY, 1024),
                   max_messages=env_int("EXL3_MAX_MESSAGES", DEFAULT_MAX_MESSAGES, 1),
                   max_client_jobs=env_int("EXL3_MAX_CLIENT_JOBS", DEFAULT_MAX_CLIENT_JOBS, 0))


LIMITS: web.AppKey[Limits] = web.AppKey("limits", Limits)


def request_limits(request: web.Request) -> Limits:
    """The limits of the app serving `request` (defaults for an app made elsewhere)."""
    return request.app.get(LIMITS) or Limits()
