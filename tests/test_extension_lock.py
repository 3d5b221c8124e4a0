"""A kernel build killed half-way leaves torch's lock file behind; the next build must
not wait on it forever (extension_loader.clear_stale_lock)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from exl3cli.extension_loader import OWNER_FILE, clear_stale_lock


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_lock_of_a_killed_build_is_removed(tmp_path, capsys):
    (tmp_path / "lock").write_text("")
    (tmp_path / OWNER_FILE).write_text(str(_dead_pid()))
    assert clear_stale_lock(tmp_path)
    assert not (tmp_path / "lock").exists()
    assert "stale kernel build lock" in capsys.readouterr().err


def test_lock_of_a_running_build_is_kept(tmp_path):
    (tmp_path / "lock").write_text("")
    (tmp_path / OWNER_FILE).write_text(str(os.getpid()))
    assert not clear_stale_lock(tmp_path)
    assert (tmp_path / "lock").exists()


def test_an_old_lock_goes_even_without_an_owner(tmp_path):
    lock = tmp_path / "lock"
    lock.write_text("")
    assert not clear_stale_lock(tmp_path, max_age=60)  # fresh, owner unknown: wait
    old = time.time() - 3600
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path, max_age=60)
    assert not clear_stale_lock(tmp_path)  # nothing left to remove
