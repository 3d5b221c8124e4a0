"""The store's cross-process lock, the cleanup of killed writers' leftovers, and the
local token that tells the daemon a client is this user's own CLI.

Writers (create, pull, cp, uploads) hold `<root>/.lock` shared; garbage collection
holds it exclusively. A killed process's lock goes with it (flock), so a store whose
lock can be taken exclusively has no live writer, and its `.tmp-*` / `.convert-*`
files are leftovers.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no cross-process lock (single-process use only)
    fcntl = None  # type: ignore[assignment]

LEFTOVER_PREFIXES = (".tmp-", ".convert-")
_LOCK_MODE = 0o644


@contextmanager
def hold_store_lock(root: Path, held: threading.local, exclusive: bool,
                    wait: bool = True) -> Iterator[bool]:
    """Hold `root/.lock` (shared or exclusive); yields False when `wait` is off and
    another holder keeps it. `held.depth` counts the locks this thread holds."""
    if fcntl is None:
        yield True
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, _LOCK_MODE)
    except OSError:  # a read-only store: nobody writes, nothing to guard
        yield True
        return
    depth = getattr(held, "depth", 0)
    try:
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.flock(fd, mode | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        held.depth = depth + 1
        try:
            yield True
        finally:
            held.depth = depth
    finally:
        os.close(fd)  # releases the lock


def remove_leftover_files(places: Iterable[Path]) -> int:
    """Delete `.tmp-*` / `.convert-*` entries directly inside `places` (call with the
    exclusive lock held); returns how many went."""
    removed = 0
    for place in places:
        try:
            entries = list(place.iterdir())
        except OSError:
            continue
        for entry in entries:
            if not entry.name.startswith(LEFTOVER_PREFIXES):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed += 1
    return removed


# The HTTP header in which the local CLI shows this token to the daemon.
LOCAL_TOKEN_HEADER = "X-Exl3-Local-Token"


def read_local_token(root: Path) -> str:
    """A secret only this user's processes can read (`<root>/.local-token`, mode 0600):
    the CLI shows it to the daemon to prove that it runs on this machine as this user,
    which lets `create` name server paths. Made on first use."""
    path = root / ".local-token"
    try:
        token = path.read_text(encoding="ascii").strip()
        if len(token) >= 32:
            return token
    except (OSError, UnicodeDecodeError):
        pass
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w", encoding="ascii") as handle:  # mkstemp: mode 0600
            handle.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)  # the first writer wins; a racing one reads the winner's
        except FileExistsError:
            pass
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path.read_text(encoding="ascii").strip()
