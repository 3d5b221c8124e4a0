"""API key, Host-header check and body-size limit on a real daemon."""

from __future__ import annotations

import json
from urllib.parse import urlsplit

import ollama
import pytest

from exl3cli.server.security import _host_allowed
from exl3cli.store.store import ModelStore
from tests.fixtures.daemon import Daemon
from tests.fixtures.http_raw import raw_request


def request(url: str, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    return raw_request(url, method, path, body, headers, timeout=10)


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory):
    return ModelStore(tmp_path_factory.mktemp("security") / "store")


def test_api_key_is_required_everywhere_but_the_liveness_paths(empty_store):
    with Daemon(empty_store, api_key="s3cret") as daemon:
        assert request(daemon.url, "GET", "/")[0] == 200
        status, body = request(daemon.url, "GET", "/api/tags")
        assert status == 401 and "API key" in json.loads(body)["error"]
        status, body = request(daemon.url, "GET", "/v1/models",
                               headers={"Authorization": "Bearer wrong"})
        assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
        status, _ = request(daemon.url, "GET", "/api/tags",
                            headers={"Authorization": "Bearer s3cret"})
        assert status == 200
        keyed = ollama.Client(host=daemon.url, headers={"Authorization": "Bearer s3cret"})
        assert keyed.list().models == []


def test_foreign_host_headers_are_refused_on_loopback(empty_store):
    with Daemon(empty_store) as daemon:
        port = urlsplit(daemon.url).port
        for host in (f"127.0.0.1:{port}", "localhost", f"[::1]:{port}", "app.localhost"):
            assert request(daemon.url, "GET", "/api/tags", headers={"Host": host})[0] == 200
        for host in ("evil.example.com", f"attacker.test:{port}", "10.0.0.5"):
            status, body = request(daemon.url, "GET", "/api/tags", headers={"Host": host})
            assert status == 403 and json.loads(body) == {"error": "host not allowed"}


def test_host_check_rules():
    assert _host_allowed("", "127.0.0.1")
    assert _host_allowed("LOCALHOST:11435", "127.0.0.1")
    assert _host_allowed("myname:8080", "myname")
    assert not _host_allowed("127.0.0.1.nip.io", "127.0.0.1")


def test_bodies_over_the_limit_get_a_413(empty_store):
    with Daemon(empty_store, max_body=1024) as daemon:
        big = json.dumps({"model": "x", "prompt": "a" * 5000}).encode()
        status, body = request(daemon.url, "POST", "/api/generate", big,
                               {"Content-Type": "application/json"})
        assert status == 413 and "too large" in json.loads(body)["error"]
        status, body = request(daemon.url, "POST", "/v1/completions", big)
        assert status == 413 and "too large" in json.loads(body)["error"]["message"]
        assert request(daemon.url, "GET", "/")[0] == 200
