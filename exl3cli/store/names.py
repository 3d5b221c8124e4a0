"""Model names: `[host/][namespace/]model[:tag]`, parsed and validated.

Names double as paths inside the store (`manifests/<host>/<namespace>/<model>/<tag>`),
so every part is checked against a strict character set: nothing that could climb out
of the store (`..`, `/`, `\\`, NUL) gets through. Matching is case-insensitive, like
Ollama's, while the spelling a user typed is kept for display.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from exl3cli.errors import InvalidModelName

DEFAULT_HOST = "exl3"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"

# One name part: starts with a letter, digit or underscore; then letters, digits, `_ - .`.
_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
# A host may also carry a port (`localhost:5000`).
_HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*(:[0-9]{1,5})?")
_MAX_LENGTHS = {"host": 253, "namespace": 80, "model": 80, "tag": 128}


def _check_part(text: str, kind: str, part: str) -> None:
    pattern = _HOST if kind == "host" else _PART
    if not part:
        raise InvalidModelName(f"invalid model name '{text}': empty {kind}")
    if len(part) > _MAX_LENGTHS[kind]:
        raise InvalidModelName(
            f"invalid model name '{text}': {kind} longer than {_MAX_LENGTHS[kind]} characters")
    if ".." in part:
        raise InvalidModelName(f"invalid model name '{text}': '..' is not allowed")
    if not pattern.fullmatch(part):
        raise InvalidModelName(
            f"invalid model name '{text}': {kind} '{part}' may contain only letters, digits,"
            " '_', '-' and '.', and must not start with '-' or '.'")


@dataclass(frozen=True, eq=False)
class ModelName:
    """A validated model name; equal names compare equal whatever their letter case."""

    host: str
    namespace: str
    model: str
    tag: str

    @classmethod
    def parse(cls, text: str) -> ModelName:
        """Parse `[host/][namespace/]model[:tag]`; raises InvalidModelName."""
        if not isinstance(text, str) or not text.strip():
            raise InvalidModelName("invalid model name '': empty name")
        if text != text.strip():
            raise InvalidModelName(f"invalid model name '{text}': surrounding whitespace")
        if "\\" in text or "\x00" in text:
            raise InvalidModelName(f"invalid model name '{text}': bad character")
        if text.startswith("/"):
            raise InvalidModelName(f"invalid model name '{text}': absolute paths are not names")
        path, tag = text, DEFAULT_TAG
        slash = text.rfind("/")
        colon = text.rfind(":")
        if colon > slash:
            path, tag = text[:colon], text[colon + 1:]
            _check_part(text, "tag", tag)
        parts = path.split("/")
        if len(parts) > 3:
            raise InvalidModelName(f"invalid model name '{text}': too many '/' separators")
        host, namespace = DEFAULT_HOST, DEFAULT_NAMESPACE
        if len(parts) == 3:
            host, namespace, model = parts
            _check_part(text, "host", host)
        elif len(parts) == 2:
            namespace, model = parts
        else:
            (model,) = parts
        _check_part(text, "namespace", namespace)
        _check_part(text, "model", model)
        return cls(host, namespace, model, tag)

    @classmethod
    def coerce(cls, name: str | ModelName) -> ModelName:
        """Accept a parsed name or parse a string."""
        return name if isinstance(name, ModelName) else cls.parse(name)

    @property
    def key(self) -> tuple[str, str, str, str]:
        """The case-folded identity used for comparisons and lookups."""
        return (self.host.lower(), self.namespace.lower(), self.model.lower(), self.tag.lower())

    def parts(self) -> tuple[str, str, str, str]:
        """(host, namespace, model, tag) as spelled: the manifest's path in the store."""
        return (self.host, self.namespace, self.model, self.tag)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModelName) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __str__(self) -> str:
        """Canonical display form: default host and namespace elided, tag always shown."""
        if self.host.lower() != DEFAULT_HOST:
            prefix = f"{self.host}/{self.namespace}/"
        elif self.namespace.lower() != DEFAULT_NAMESPACE:
            prefix = f"{self.namespace}/"
        else:
            prefix = ""
        return f"{prefix}{self.model}:{self.tag}"
