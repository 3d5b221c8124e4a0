"""A kernel build killed half-way leaves torch's lock file behind; the next build must
not wait on it forever (extension_loader.build_guard, clear_stale_lock)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from exl3cli.ops.build import OWNER_FILE, build_guard, clear_stale_lock


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


def test_a_lock_beside_a_live_but_waiting_owner_goes_once_we_hold_the_guard(tmp_path, capsys):
    # The owner file may name a process that only waited (it wrote its pid too); with
    # the flock held nobody else of ours is in torch's build, so the lock is stale.
    (tmp_path / "lock").write_text("")
    (tmp_path / OWNER_FILE).write_text(str(os.getpid()))
    with build_guard(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert "stale kernel build lock" in capsys.readouterr().err


def test_the_guard_of_a_killed_holder_is_released(tmp_path):
    code = ("import sys, time; from pathlib import Path; "
            "from exl3cli.ops.build import build_guard\n"
            "with build_guard(Path(sys.argv[1])):\n"
            "    print('held', flush=True); time.sleep(60)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        (tmp_path / "lock").write_text("")  # what torch's build leaves when killed
        waiter = subprocess.Popen(
            [sys.executable, "-c", "import sys; from pathlib import Path; "
             "from exl3cli.ops.build import build_guard\n"
             "with build_guard(Path(sys.argv[1])): print('got it')", str(tmp_path)],
            stdout=subprocess.PIPE, text=True)
        time.sleep(1.0)
        assert waiter.poll() is None  # blocked while the holder lives
        holder.kill()
        out, _ = waiter.communicate(timeout=60)
        assert out.strip() == "got it"
        assert not (tmp_path / "lock").exists()
    finally:
        holder.kill()
        holder.wait()
