"""What a hostile or careless client sends, against a real daemon on 127.0.0.1: each
request is answered alone with a 4xx and a clear message, and harms nobody else."""

from __future__ import annotations

import base64
import http.client
import json
import threading
from urllib.parse import urlsplit

import pytest

from exl3cli.store.store import ModelStore
from tests.fixtures.daemon import Daemon
from tests.fixtures.http_raw import raw_request
from tests.fixtures.tiny_store import TINY_VOCAB, make_tiny_store


def call(url: str, method: str, path: str, body: object = None, raw: bytes | None = None,
         headers: dict[str, str] | None = None, timeout: float = 180) -> tuple[int, bytes]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    return raw_request(url, method, path, data, headers, timeout)


def lines(raw: bytes) -> list[dict]:
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


def error_of(raw: bytes) -> str:
    return json.loads(raw)["error"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    store = make_tiny_store(tmp_path_factory.mktemp("hostile"))
    store.copy("tiny", "alias")
    return store


def test_ids_outside_the_vocabulary_fail_alone(daemon):
    """Item 1: before, the bad request was a 500 and killed innocent streams."""
    results: list[list[dict]] = []

    def innocent() -> None:
        status, raw = call(daemon.url, "POST", "/api/generate", {
            "model": "tiny", "prompt": "Once upon a time",
            "options": {"temperature": 0, "num_predict": 24}})
        results.append(lines(raw) if status == 200 else [{"status": status}])

    threads = [threading.Thread(target=innocent) for _ in range(3)]
    for thread in threads:
        thread.start()
    for context in ([TINY_VOCAB - 1, 1_000_000], [TINY_VOCAB], [-1], [1.5], ["a"]):
        status, raw = call(daemon.url, "POST", "/api/generate",
                           {"model": "tiny", "prompt": "hi", "context": context})
        assert status == 400, (context, raw)
        assert "context" in error_of(raw)
    for thread in threads:
        thread.join(180)
    assert len(results) == 3
    for stream in results:
        assert stream[-1].get("done") is True and "error" not in stream[-1], stream[-1]
        assert stream[-1]["eval_count"] == 24


@pytest.mark.parametrize("body, words", [
    ({"keep_alive": 1e300}, "keep_alive"),
    ({"keep_alive": "99999999h"}, "keep_alive"),
    ({"prompt": "\ud800"}, "not valid Unicode"),
    ({"system": "ok", "prompt": "x\udfff"}, "not valid Unicode"),
    ({"template": "{% if false %}x{% endif %}"}, "empty"),
    ({"template": "{% for i in range(10**9) %}x{% endfor %}"}, "chat template"),
    ({"template": "{{ 'x' * 10**9 }}"}, "chat template"),
    ({"template": "{{ 1 / 0 }}"}, "chat template"),
    ({"options": {"temperature": -1}}, "temperature"),
    ({"options": {"top_k": -5}}, "top_k"),
    ({"options": {"top_p": 5}}, "top_p"),
    ({"options": {"min_p": 2}}, "min_p"),
    ({"options": {"num_ctx": 0}}, "num_ctx"),
    ({"images": ["not base64!!"]}, "base64"),
    ({"images": [base64.b64encode(b"\x89PNG fake").decode()]}, "images"),
])
def test_generate_refuses_what_it_cannot_honour(daemon, body, words):
    """Item 7: these were 500s, or silently accepted (empty or ignored output)."""
    request = {"model": "tiny", "prompt": "hi", "options": {"num_predict": 2}, **body}
    if "options" in body:
        request["options"] = {"num_predict": 2, **body["options"]}
    status, raw = call(daemon.url, "POST", "/api/generate",
                       raw=json.dumps(request).encode())  # json.dumps keeps the surrogate
    assert status == 400, raw
    assert words in error_of(raw)


@pytest.mark.parametrize("tools", [
    "calculator", [1], [{"type": "function"}], [{"function": {"name": 3}}],
    [{"type": "web", "function": {"name": "x"}}],
    [{"type": "function", "function": {"name": "x", "parameters": "none"}}],
])
def test_chat_refuses_garbage_tools(daemon, tools):
    status, raw = call(daemon.url, "POST", "/api/chat", {
        "model": "tiny", "tools": tools, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "tools" in error_of(raw), raw
    status, raw = call(daemon.url, "POST", "/v1/chat/completions", {
        "model": "tiny", "tools": tools, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "tools" in json.loads(raw)["error"]["message"], raw


def test_chat_images_are_refused_on_a_text_model(daemon):
    image = base64.b64encode(b"GIF89a....").decode()
    status, raw = call(daemon.url, "POST", "/api/chat", {
        "model": "tiny", "messages": [{"role": "user", "content": "hi", "images": [image]}]})
    assert status == 400 and "images" in error_of(raw)


def test_unknown_names_leave_no_stats_and_aliases_share_one_queue(daemon):
    """Item 5: the queue bound was per name; unknown names stayed in /api/stats."""
    for name in ("nope", "nope:1", "also/missing:x"):
        status, raw = call(daemon.url, "POST", "/api/generate", {"model": name, "prompt": "x"})
        assert status == 404, raw
    for name in ("tiny", "alias", "tiny:latest"):
        status, raw = call(daemon.url, "POST", "/api/generate", {
            "model": name, "prompt": "hi", "stream": False, "options": {"num_predict": 2}})
        assert status == 200, raw
    status, raw = call(daemon.url, "GET", "/api/stats")
    models = json.loads(raw)["models"]
    assert len(models) == 1, models
    assert sum(entry["completed"] for entry in models.values()) >= 3


def test_the_queue_bound_counts_every_alias_of_the_same_weights(tmp_path):
    store = make_tiny_store(tmp_path)
    store.copy("tiny", "other")
    with Daemon(store, num_parallel=1, max_queue=0) as daemon:
        started = threading.Event()
        finished: list[int] = []

        def long_stream() -> None:
            parts = urlsplit(daemon.url)
            connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
            connection.request("POST", "/api/generate", body=json.dumps({
                "model": "tiny", "prompt": "hi",
                "options": {"num_predict": 200, "temperature": 0}}).encode())
            response = response_ = connection.getresponse()
            response.readline()
            started.set()
            response_.read()
            finished.append(response.status)
            connection.close()

        thread = threading.Thread(target=long_stream)
        thread.start()
        assert started.wait(60)
        for name in ("other", "tiny:latest"):
            status, raw = call(daemon.url, "POST", "/api/generate", {
                "model": name, "prompt": "x", "options": {"num_predict": 1}})
            assert status == 503, (name, raw)
        thread.join(180)
        assert finished == [200]


def test_too_many_messages_and_too_large_bodies_are_refused_before_work(tmp_path):
    """Item 2: limits a host sets (EXL3_MAX_MESSAGES, EXL3_MAX_BODY)."""
    from exl3cli.server.limits import Limits

    store = make_tiny_store(tmp_path)
    with Daemon(store, limits=Limits(max_body=64 * 1024, max_messages=50)) as daemon:
        messages = [{"role": "user", "content": ""}] * 51
        for path in ("/api/chat", "/v1/chat/completions"):
            status, raw = call(daemon.url, "POST", path, {"model": "tiny", "messages": messages})
            assert status == 400 and b"too many messages" in raw, raw
        status, raw = call(daemon.url, "POST", "/api/generate",
                           raw=b'{"model": "tiny", "prompt": "' + b"a" * 70_000 + b'"}')
        assert status == 413 and b"too large" in raw


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(daemon):
    prompt = "word " * 400_000  # 2 MB: at least tens of thousands of tokens
    status, raw = call(daemon.url, "POST", "/api/generate", {
        "model": "tiny", "prompt": prompt, "raw": True, "options": {"num_ctx": 256}})
    assert status == 400 and "at least" in error_of(raw), raw


def test_a_long_chat_drops_old_turns_and_answers(daemon):
    """Item 2: 3,000 turns fit by dropping the oldest (before: one render per turn)."""
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"}
                for i in range(3000)]
    status, raw = call(daemon.url, "POST", "/api/chat", {
        "model": "tiny", "messages": messages, "stream": False,
        "options": {"num_ctx": 256, "num_predict": 2}})
    assert status == 200, raw
    answer = json.loads(raw)
    assert answer["done"] and 0 < answer["prompt_eval_count"] < 256


def test_cross_origin_writes_are_refused(daemon, store):
    """Item 3: a page on another origin could POST text/plain bodies that took effect."""
    body = json.dumps({"source": "tiny", "destination": "stolen"}).encode()
    for origin in ("https://evil.example.com", "null", "http://localhost.evil.com"):
        status, raw = call(daemon.url, "POST", "/api/copy", raw=body,
                           headers={"Origin": origin, "Content-Type": "text/plain"})
        assert status == 403 and error_of(raw) == "origin not allowed", origin
    assert not store.exists("stolen")
    status, raw = call(daemon.url, "POST", "/v1/chat/completions", raw=b"{}",
                       headers={"Origin": "https://evil.example.com"})
    assert status == 403 and json.loads(raw)["error"]["type"] == "permission_error"
    for origin in ("http://localhost:3000", "http://127.0.0.1", "app://desktop"):
        status, raw = call(daemon.url, "GET", "/api/tags", headers={"Origin": origin})
        assert status == 200, origin


def test_allowed_origins_come_from_exl3_origins(tmp_path):
    store = ModelStore(tmp_path / "store")
    with Daemon(store, origins="https://chat.example.org, https://*.corp.test") as daemon:
        for origin, expected in (("https://chat.example.org", 200), ("https://a.corp.test", 200),
                                 ("https://example.org", 403), ("http://localhost:8080", 200)):
            parts = urlsplit(daemon.url)
            connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
            connection.request("GET", "/api/tags", headers={"Origin": origin})
            response = connection.getresponse()
            response.read()
            assert response.status == expected, origin
            if expected == 200:
                assert response.getheader("Access-Control-Allow-Origin") == origin
            connection.close()
        status, _ = call(daemon.url, "OPTIONS", "/api/chat", headers={
            "Origin": "https://chat.example.org", "Access-Control-Request-Method": "POST"})
        assert status == 204


def open_stream(url: str, path: str, body: dict) -> tuple[http.client.HTTPConnection, object]:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=180)
    connection.request("POST", path, body=json.dumps(body).encode())
    response = connection.getresponse()
    assert response.status == 200
    return connection, response


def test_a_client_that_leaves_is_one_log_line_not_a_traceback(tmp_path, caplog):
    """Item 7: a disconnect logged a traceback (mid-stream, and while queued)."""
    import logging
    import time

    caplog.set_level(logging.INFO)
    with Daemon(make_tiny_store(tmp_path), num_parallel=1) as daemon:
        def stats() -> dict:
            return json.loads(call(daemon.url, "GET", "/api/stats")[1])

        busy, busy_response = open_stream(daemon.url, "/api/generate", {
            "model": "tiny", "prompt": "go", "options": {"num_predict": 300}})
        busy_response.readline()
        parts = urlsplit(daemon.url)
        queued = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        queued.request("POST", "/api/chat", body=json.dumps({
            "model": "tiny", "messages": [{"role": "user", "content": "x"}]}).encode())
        deadline = time.monotonic() + 60
        while stats()["queued"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        queued.sock.close()  # gone while queued
        queued.close()
        busy.sock.close()  # gone mid-stream
        busy.close()
        for path, body in (("/api/chat", {"messages": [{"role": "user", "content": "go"}]}),
                           ("/v1/chat/completions", {"stream": True, "messages": [
                               {"role": "user", "content": "go"}]})):
            connection, response = open_stream(daemon.url, path, {
                "model": "tiny", "options": {"num_predict": 300}, "max_tokens": 300, **body})
            response.readline()
            connection.sock.close()
            connection.close()
        while stats()["active"] or stats()["queued"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)
    noisy = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not noisy, [r.getMessage() for r in noisy]


def test_shutdown_gives_streams_their_grace_then_a_final_line(tmp_path):
    """Item 7: SIGTERM cut running streams with no final line."""
    # A context long enough that the answer cannot end inside the grace period.
    store = make_tiny_store(tmp_path, max_position_embeddings=16384)
    daemon = Daemon(store, shutdown_grace=0.2).__enter__()
    try:
        connection, response = open_stream(daemon.url, "/api/generate", {
            "model": "tiny", "prompt": "go", "options": {"num_predict": 100_000,
                                                        "num_ctx": 16384}})
        first = json.loads(response.readline())
        assert first["done"] is False
        stopper = threading.Thread(target=daemon.stop)
        stopper.start()
        rest = lines(response.read())
        stopper.join(60)
        assert rest[-1] == {"error": "the server shut down before the answer was complete"}
        assert all(item.get("done") is False for item in rest[:-1])
        connection.close()
    finally:
        daemon.stop()


def test_one_client_address_is_bounded_by_exl3_max_client_jobs(tmp_path):
    from exl3cli.server.limits import Limits

    with Daemon(make_tiny_store(tmp_path), num_parallel=4,
                limits=Limits(max_client_jobs=1)) as daemon:
        connection, response = open_stream(daemon.url, "/api/generate", {
            "model": "tiny", "prompt": "go", "options": {"num_predict": 200}})
        response.readline()
        status, raw = call(daemon.url, "POST", "/api/generate", {
            "model": "tiny", "prompt": "x", "options": {"num_predict": 1}})
        assert status == 503 and "EXL3_MAX_CLIENT_JOBS" in error_of(raw)
        rest = lines(response.read())
        connection.close()
        assert rest[-1]["done"] is True
        status, raw = call(daemon.url, "POST", "/api/generate", {
            "model": "tiny", "prompt": "x", "stream": False, "options": {"num_predict": 1}})
        assert status == 200, raw
