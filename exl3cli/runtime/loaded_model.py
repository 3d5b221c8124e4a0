"""A model resident in the runner (`LoadedModel`: what /api/ps reports, its generator,
keep-alive deadline and use count) and the key loaded models are cached by
(`weights_key`: names and aliases of one set of weight files share one loaded model).
`InferenceRunner` (residency.py) owns the loaded models; this is their record.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any


@dataclass
class LoadedModel:
    """A model resident in this process, with the facts /api/ps reports."""

    key: str
    name: str
    text_model: Any
    size: int
    details: dict[str, Any]
    on_gpu: bool
    context_length: int = 0
    expires_at: float | None = None  # monotonic deadline; None = forever
    expires_wall: datetime | None = None
    in_use: int = 0
    generator: Any = None  # engine.generator.Generator, built by the first request
    generator_thread: Any = None  # its GeneratorThread
    rebuilds_waiting: int = 0  # requests waiting for the generator to go idle
    submitting: int = 0  # requests being handed to the generator (not rebuilt meanwhile)
    digest: str = ""  # the manifest digest /api/tags shows for `name`
    # The adapter requests without one of their own run with (TabbyAPI's /v1/lora/load).
    default_adapter: str | None = None
    default_loras: list[dict[str, Any]] | None = None  # what /v1/lora lists for it
    placement: Any = None  # engine.placement.Placement: layers on the GPU / offloaded

    @property
    def size_vram(self) -> int:
        """The part of `size` on the GPU (all of it, none, or the offload split's share)."""
        if not self.on_gpu:
            return 0
        share = self.placement
        if share is None or share.gpu_bytes + share.cpu_bytes <= 0:
            return self.size
        return round(self.size * share.gpu_bytes / (share.gpu_bytes + share.cpu_bytes))

    def stop_generator(self) -> None:
        """Stop stepping the generator on its thread (handles still in flight then
        step it themselves, so none of them hangs)."""
        if self.generator_thread is not None:
            self.generator_thread.stop()
            self.generator_thread = None


def weights_key(manifest: dict[str, Any]) -> str:
    """One id for a set of weight files: every name and alias of them shares it (a
    LoRA adapter's files are left out: models differing only in ADAPTER share a base)."""
    from exl3cli.runtime.adapters import base_files

    files = base_files(manifest.get("files") or {})
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def folder_size(folder: Path) -> int:
    """Bytes of every file under `folder` (what /api/ps reports as a model's size)."""
    total = 0
    for path in folder.rglob("*"):
        try:
            if path.is_file():
                total += path.stat().st_size
        except OSError:
            continue
    return total
