"""The one interface every CLI command talks to, in-process or over HTTP.

Requests and responses are plain dicts shaped exactly like the Ollama REST API bodies,
so the HTTP implementation passes them through unchanged. Streaming calls return
iterators of the NDJSON objects the daemon would send, one per line.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

Body = dict[str, Any]


class Client(Protocol):
    """What `exl3` commands may ask of a model service."""

    def list(self) -> Body:
        """GET /api/tags: {"models": [{name, model, modified_at, size, digest, details}]}."""

    def show(self, req: Body) -> Body:
        """POST /api/show {model}: {modelfile, parameters, template, system, license,
        details, model_info, messages, modified_at}."""

    def copy(self, req: Body) -> Body:
        """POST /api/copy {source, destination}."""

    def delete(self, req: Body) -> Body:
        """DELETE /api/delete {model}."""

    def create(self, req: Body) -> Iterator[Body]:
        """POST /api/create {model, modelfile, base_dir?}: {"status": ...} lines."""

    def pull(self, req: Body) -> Iterator[Body]:
        """POST /api/pull {model}: {status, digest?, total?, completed?} lines."""

    def ps(self) -> Body:
        """GET /api/ps: {"models": [...]} of the loaded models."""

    def generate(self, req: Body) -> Iterator[Body]:
        """POST /api/generate: response chunks, the last with done: true."""

    def chat(self, req: Body) -> Iterator[Body]:
        """POST /api/chat: message chunks, the last with done: true."""
