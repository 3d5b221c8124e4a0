"""`exl3 serve` as a real process (graceful SIGTERM), `exl3 ps`, `exl3 stop`, and
`exl3 run` giving the same answer with and without a daemon."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import redirect_stdout
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from click.testing import CliRunner

from exl3cli.cli.run import run_one_shot
from exl3cli.cli.serve import processor_text, ps, stop, until_text
from exl3cli.client.http import HttpClient, daemon_url
from exl3cli.errors import Exl3Error
from exl3cli.store.manifest import Manifest
from tests.fixtures.daemon import Daemon
from tests.fixtures.tiny_store import make_tiny_store

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    store = make_tiny_store(tmp_path_factory.mktemp("serve-cli"))
    base = store.read_manifest("tiny")
    store.write_manifest("tiny", Manifest(files=dict(base.files), source=dict(base.source),
                                          parameters={"temperature": 0, "num_predict": 8}))
    return store


def test_serve_answers_then_exits_0_on_sigterm_mid_stream(store):
    port = free_port()
    env = {**os.environ, "EXL3_HOST": f"127.0.0.1:{port}", "EXL3_MODELS": str(store.root),
           "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-c", "from exl3cli.cli.serve import serve; serve()"],
        env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not _up(port):
            assert time.monotonic() < deadline and process.poll() is None, "serve did not start"
            time.sleep(0.2)
        client = HttpClient(f"http://127.0.0.1:{port}", timeout=30)
        assert [m["name"] for m in client.list()["models"]] == ["tiny:latest"]
        stream = client.chat({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "options": {"num_predict": 200}})
        assert next(stream)["done"] is False
        process.send_signal(signal.SIGTERM)
        rest = []
        try:  # it gets the grace period: it ends with its final object, or (on a slow
            for item in stream:  # machine) with an error line once the grace ran out
                rest.append(item)
            assert rest and rest[-1]["done"] is True
        except Exl3Error as error:
            assert "shut down before the answer was complete" in str(error)
        assert process.wait(30) == 0
        assert f"listening on http://127.0.0.1:{port}" in process.stderr.read().decode()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _up(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def test_serve_reports_a_busy_port(store):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "EXL3_HOST": f"127.0.0.1:{port}", "EXL3_MODELS": str(store.root),
               "PYTHONPATH": str(ROOT)}
        result = subprocess.run(
            [sys.executable, "-c", "from exl3cli.cli.serve import serve; serve()"],
            env=env, capture_output=True, timeout=60)
    assert result.returncode != 0
    assert f"could not listen on http://127.0.0.1:{port}" in result.stderr.decode()


def test_ps_and_stop_through_the_daemon(store, monkeypatch):
    with Daemon(store) as daemon:
        monkeypatch.setenv("EXL3_HOST", daemon.url)
        assert daemon_url() == daemon.url
        runner = CliRunner()
        result = runner.invoke(ps, [])
        assert result.exit_code == 0
        assert result.stdout.split() == ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]
        list(HttpClient(daemon.url).generate({"model": "tiny", "prompt": "hi",
                                              "keep_alive": "10m"}))
        header, row = runner.invoke(ps, []).stdout.splitlines()
        assert header.split()[:3] == ["NAME", "ID", "SIZE"]
        assert row.startswith("tiny:latest ") and "100% CPU" in row  # as `exl3 list` names it
        assert row.rstrip().endswith("minutes from now")
        assert runner.invoke(stop, ["tiny:latest"]).exit_code == 0
        assert HttpClient(daemon.url).ps()["models"] == []
        missing = runner.invoke(stop, ["tiny"])
        assert missing.exit_code != 0 and "to stop" in str(missing.exception)


def test_ps_columns_wording():
    now = datetime(2025, 1, 1, tzinfo=timezone.utc)
    assert until_text((now + timedelta(minutes=4, seconds=30)).isoformat(), now) == \
        "4 minutes from now"
    assert until_text((now + timedelta(days=365 * 100)).isoformat(), now) == "Forever"
    assert until_text((now - timedelta(seconds=1)).isoformat(), now) == "Stopping..."
    assert processor_text({"size": 100, "size_vram": 0}) == "100% CPU"
    assert processor_text({"size": 100, "size_vram": 100}) == "100% GPU"
    assert processor_text({"size": 100, "size_vram": 25}) == "75%/25% CPU/GPU"


def test_run_gives_the_same_answer_with_and_without_a_daemon(store):
    """`exl3 run tiny hi` in a process of its own, once with no daemon at EXL3_HOST and
    once with one; and the daemon's HTTP client prints the same through run's code."""
    def exl3_run(host: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "EXL3_HOST": host, "EXL3_MODELS": str(store.root),
               "PYTHONPATH": str(ROOT)}
        return subprocess.run([sys.executable, "-m", "exl3cli", "run", "tiny", "hi"],
                              env=env, capture_output=True, timeout=120, stdin=subprocess.DEVNULL)

    alone = exl3_run(f"127.0.0.1:{free_port()}")
    assert alone.returncode == 0, alone.stderr
    assert alone.stdout.strip()
    with Daemon(store) as daemon:
        served = exl3_run(daemon.url)
        assert served.returncode == 0, served.stderr
        assert served.stdout == alone.stdout
        printed = io.StringIO()
        with redirect_stdout(printed):
            run_one_shot(HttpClient(daemon.url), "tiny", "hi", system=None, format_=None,
                         keepalive=None, think=None, hide_thinking=False, verbose=False,
                         wordwrap=False)
        assert printed.getvalue() == alone.stdout.decode()
        deadline = time.monotonic() + 10  # the counters update once the worker exits
        while daemon.manager.stats()["completed"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert daemon.manager.stats()["completed"] >= 1


def test_serve_help_lists_every_environment_variable_the_daemon_reads():
    import re
    from pathlib import Path

    from click.testing import CliRunner

    from exl3cli.cli import main

    shown = CliRunner().invoke(main, ["serve", "--help"]).output
    server = Path(__file__).parents[2] / "exl3cli"
    read = set()
    for folder in ("server", "client", "runtime", "cli/serve.py"):
        for path in ([server / folder] if folder.endswith(".py")
                     else sorted((server / folder).glob("*.py"))):
            read |= set(re.findall(r"\"(EXL3_[A-Z_]+)\"", path.read_text()))
    assert read and {"EXL3_API_KEY", "EXL3_ADMIN_KEY", "EXL3_MAX_QUEUE"} <= read
    missing = sorted(name for name in read if name not in shown)
    assert not missing, f"serve --help does not mention {missing}"


def _refused_serve(store, **env: str) -> str:
    """`exl3 serve` with `env` added: it must exit non-zero without a traceback; its stderr."""
    env = {**os.environ, "EXL3_HOST": "127.0.0.1:1", "EXL3_MODELS": str(store.root),
           "PYTHONPATH": str(ROOT), **env}
    result = subprocess.run(
        [sys.executable, "-m", "exl3cli", "serve"], env=env, capture_output=True, timeout=60)
    stderr = result.stderr.decode()
    assert result.returncode != 0 and "Traceback" not in stderr
    return stderr


def test_serve_refuses_a_bad_batch_invariant_value_clearly(store):
    stderr = _refused_serve(store, EXL3_BATCH_INVARIANT="sometimes")
    assert "EXL3_BATCH_INVARIANT must be 1 or 0" in stderr


def test_gil_switch_interval_is_parsed_or_refused_clearly(store):
    from exl3cli.cli.serve import gil_switch_seconds

    assert gil_switch_seconds("") is None
    assert gil_switch_seconds(" 0.5 ") == 0.0005
    stderr = _refused_serve(store, EXL3_GIL_SWITCH_MS="fast")
    assert "EXL3_GIL_SWITCH_MS must be milliseconds" in stderr


def test_serve_help_shows_the_batch_invariant_switch():
    from click.testing import CliRunner

    from exl3cli.cli import main

    shown = CliRunner().invoke(main, ["serve", "--help"]).output
    assert "--batch-invariant" in shown and "EXL3_BATCH_INVARIANT" in shown
