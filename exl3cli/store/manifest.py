"""A model's manifest: what a model name points at (files by digest, Modelfile settings).

`Manifest` is the JSON stored under `manifests/<host>/<namespace>/<model>/<tag>` by the
store (store.py); `StoredModel` is one row of its listing; `check_relpath` refuses a
file name in a manifest that could leave the model's folder.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from exl3cli.errors import Exl3Error
from exl3cli.store.names import ModelName

MANIFEST_SCHEMA = 1


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


@dataclass
class Manifest:
    """What a model name points at: files by digest plus its Modelfile settings."""

    files: dict[str, str]
    source: dict[str, Any] = field(default_factory=dict)
    parameters: dict[str, Any] = field(default_factory=dict)
    template: str | None = None
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    adapter: str | None = None
    license: str | None = None
    draft: str | None = None
    created: str = field(default_factory=_now_iso)
    schema: int = MANIFEST_SCHEMA

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": self.schema, "files": dict(sorted(self.files.items())),
            "source": self.source, "parameters": self.parameters,
            "template": self.template, "system": self.system, "messages": self.messages,
            "adapter": self.adapter, "license": self.license, "draft": self.draft,
            "created": self.created,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)

    # Read access by key too, so code that treats a manifest as its JSON dict works.
    def __getitem__(self, key: str) -> Any:
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self.__dataclass_fields__ else default

    def digest(self) -> str:
        """sha256 hex of the manifest's content, creation time left out (so the same
        files and settings always give the same id)."""
        body = self.to_dict()
        del body["created"]
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass
class StoredModel:
    """One row of `list_models()`."""

    name: ModelName
    digest: str
    size: int
    modified: datetime

    @property
    def id(self) -> str:
        return self.digest[:12]


def check_relpath(relpath: str) -> None:
    """Refuse a manifest file name that is empty, absolute, climbs out (`..`) or uses
    backslashes (Exl3Error)."""
    parts = Path(relpath).parts
    if not parts or Path(relpath).is_absolute() or ".." in parts or "\\" in relpath:
        raise Exl3Error(f"invalid file name in manifest: '{relpath}'")
