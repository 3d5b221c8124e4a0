"""Writes that readers see whole or not at all: temp file, fsync, rename, fsync of the
folder. Shared by the store and its uploads."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

FILE_MODE = 0o644


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write a file so that readers see either the old or the complete new content."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        os.chmod(tmp, FILE_MODE)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_hashed(folder: Path, chunks: Iterable[bytes], target_of: Callable[[str], Path],
                 before_commit: Callable[[str], None] | None = None) -> str:
    """Stream `chunks` into a temp file in `folder` while hashing them; then (after
    `before_commit(digest)`, which may refuse by raising) move it to `target_of(digest)`
    unless that file is already there. Returns `sha256:<hex>`; on any failure nothing
    is left behind."""
    folder.mkdir(parents=True, exist_ok=True)
    hasher = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        os.chmod(tmp, FILE_MODE)
        with os.fdopen(fd, "wb") as handle:
            for chunk in chunks:
                hasher.update(chunk)
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        digest = f"sha256:{hasher.hexdigest()}"
        if before_commit is not None:
            before_commit(digest)
        target = target_of(digest)
        if target.is_file():
            Path(tmp).unlink()
        else:
            os.replace(tmp, target)
            fsync_dir(folder)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return digest
