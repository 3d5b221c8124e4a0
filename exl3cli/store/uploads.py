"""Blobs uploaded over HTTP (POST /api/blobs/<digest>) for a later /api/create `files`.

An upload is hashed while it is written and kept only if its digest is the one named.
A pin file (`uploads/sha256-<hex>`) keeps it from garbage collection for
UPLOAD_GRACE_SECONDS, so that the create naming it can come; stale pins are dropped.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from exl3cli.errors import Exl3Error
from exl3cli.store.atomic import atomic_write_bytes, write_hashed
from exl3cli.store.store_lock import LEFTOVER_PREFIXES

UPLOAD_GRACE_SECONDS = 3600.0


def add_uploaded_blob(store: Any, chunks: Iterator[bytes], expected: str) -> str:
    """Write `chunks` as the blob `expected` of `store` (a ModelStore); Exl3Error when
    the content's digest differs (nothing is kept then)."""
    target = store.blob_path(expected)
    store.blobs_dir.mkdir(parents=True, exist_ok=True)
    def check_and_pin(digest: str) -> None:
        if digest != expected:
            raise Exl3Error(f"digest mismatch: the body's digest is {digest}")
        atomic_write_bytes(store.uploads_dir / target.name, b"")  # the pin

    with store.writing():
        write_hashed(store.blobs_dir, chunks, store.blob_path, check_and_pin)
    return expected


def pinned_uploads(uploads_dir: Path) -> set[str]:
    """Blob file names still within their upload grace; stale pins are deleted."""
    if not uploads_dir.is_dir():
        return set()
    pinned, now = set(), time.time()
    for pin in uploads_dir.iterdir():
        try:
            fresh = now - pin.stat().st_mtime < UPLOAD_GRACE_SECONDS
        except OSError:
            continue
        if fresh:
            pinned.add(pin.name)
        elif not pin.name.startswith(LEFTOVER_PREFIXES):
            pin.unlink(missing_ok=True)
    return pinned
