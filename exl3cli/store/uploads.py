"""Blobs uploaded over HTTP (POST /api/blobs/<digest>) for a later /api/create `files`.

An upload is hashed while it is written and kept only if its digest is the one named.
A pin file (`uploads/sha256-<hex>`) keeps it from garbage collection for
UPLOAD_GRACE_SECONDS, so that the create naming it can come; stale pins are dropped.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from exl3cli.errors import Exl3Error
from exl3cli.store.atomic import FILE_MODE, atomic_write_bytes, fsync_dir
from exl3cli.store.store_lock import LEFTOVER_PREFIXES

UPLOAD_GRACE_SECONDS = 3600.0


def add_uploaded_blob(store: Any, chunks: Iterator[bytes], expected: str) -> str:
    """Write `chunks` as the blob `expected` of `store` (a ModelStore); Exl3Error when
    the content's digest differs (nothing is kept then)."""
    target = store.blob_path(expected)
    store.blobs_dir.mkdir(parents=True, exist_ok=True)
    with store.writing():
        hasher = hashlib.sha256()
        fd, tmp = tempfile.mkstemp(dir=store.blobs_dir, prefix=".tmp-")
        try:
            os.chmod(tmp, FILE_MODE)
            with os.fdopen(fd, "wb") as handle:
                for chunk in chunks:
                    hasher.update(chunk)
                    handle.write(chunk)
                handle.flush()
                os.fsync(handle.fileno())
            digest = f"sha256:{hasher.hexdigest()}"
            if digest != expected:
                raise Exl3Error(f"digest mismatch: the body's digest is {digest}")
            atomic_write_bytes(store.uploads_dir / target.name, b"")  # the pin
            if target.is_file():
                Path(tmp).unlink()
            else:
                os.replace(tmp, target)
                fsync_dir(store.blobs_dir)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
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
