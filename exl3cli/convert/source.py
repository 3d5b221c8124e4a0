"""Resolve the SRC of ``exl3 convert`` into a Hugging Face folder.

SRC may be an HF folder (has config.json), a GGUF file (converted into the work
folder), a model name in the store, or a hub/catalog name (pulled into the store).

Public API:
- ``resolve_source(src, store, work_dir, progress=None) -> Path``
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from exl3cli.errors import ModelNotFound
from exl3cli.store.store import ModelStore


def resolve_source(
    src: str,
    store: ModelStore,
    work_dir: Path,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    path = Path(src).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} is not a Hugging Face model folder (no config.json)")
        return path
    if path.is_file():
        from exl3cli.gguf.convert import gguf_to_hf_folder

        return gguf_to_hf_folder(path, work_dir / "source")
    if not store.exists(src):
        from exl3cli.store.pull import pull_model

        pull_model(store, src, progress)
    return store.model_folder(src)
