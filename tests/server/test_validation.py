"""Malformed requests get clear 400s; a fuzz test posts junk to every route and the
daemon never answers 500 and never dies."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exl3cli.store.manifest import Manifest
from tests.fixtures.daemon import Daemon
from tests.fixtures.tiny_store import make_tiny_store

ROUTES = [("POST", "/api/generate"), ("POST", "/api/chat"), ("POST", "/api/show"),
          ("POST", "/api/pull"), ("POST", "/api/create"), ("POST", "/api/copy"),
          ("DELETE", "/api/delete"), ("GET", "/api/tags"), ("GET", "/api/ps"),
          ("GET", "/api/version"), ("GET", "/"), ("GET", "/api/stats"),
          ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
          ("GET", "/v1/models"), ("GET", "/v1/models/tiny"), ("POST", "/api/embed"),
          ("POST", "/api/embeddings"), ("POST", "/v1/embeddings")]
FIELDS = ["model", "name", "prompt", "messages", "options", "stream", "keep_alive", "format",
          "system", "template", "raw", "context", "images", "think", "tools", "source",
          "destination", "modelfile", "from", "parameters", "license", "max_tokens",
          "temperature", "top_p", "stop", "seed", "n", "stream_options", "response_format",
          "role", "content", "num_predict", "top_k", "presence_penalty", "suffix", "quantize",
          "input", "truncate", "dimensions", "encoding_format", "type", "properties",
          "required", "items", "enum", "$ref", "anyOf"]


def post(url: str, method: str, path: str, body: bytes) -> tuple[int, bytes]:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        connection.request(method, path, body=body,
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, request):
    # A short context and a small default num_predict keep every generation short.
    store = make_tiny_store(tmp_path_factory.mktemp("validation"), max_position_embeddings=64)
    base = store.read_manifest("tiny")
    tiny = Manifest(files=dict(base.files), source=dict(base.source),
                    parameters={"num_predict": 2})
    store.write_manifest("tiny", tiny)
    patch = pytest.MonkeyPatch()
    patch.setenv("HF_HUB_OFFLINE", "1")  # a fuzzed pull never reaches the network
    patch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with Daemon(store) as running:
        running.tiny_manifest = tiny  # the fuzzer may delete it; the last test restores it
        yield running
    patch.undo()


@pytest.mark.parametrize("path, body, fragment", [
    ("/api/generate", b"{not json", "invalid JSON"),
    ("/api/generate", b"[1, 2]", "must be a JSON object"),
    ("/api/generate", b"", "missing request body"),
    ("/api/generate", b'{"model": "tiny", "prompt": 5}', "prompt"),
    ("/api/generate", b'{"prompt": "hi"}', "model is required"),
    ("/api/generate", b'{"model": "tiny", "prompt": "x", "options": {"temperature": "hot"}}',
     "options.temperature"),
    ("/api/generate", b'{"model": "tiny", "prompt": "x", "options": {"top_k": NaN}}',
     "invalid JSON"),
    ("/api/generate", b'{"model": "tiny", "prompt": "x", "keep_alive": "soon"}', "duration"),
    ("/api/generate", b'{"model": "tiny", "prompt": "x", "context": ["a"]}', "context[0]"),
    ("/api/chat", b'{"model": "tiny", "messages": "hi"}', "messages"),
    ("/api/chat", b'{"model": "tiny", "messages": [{"content": "hi"}]}', "messages[0].role"),
    ("/api/chat", b'{"model": "tiny", "messages": [{"role": "user", "content": 3}]}',
     "messages[0].content"),
    ("/api/copy", b'{"source": "tiny"}', "destination is required"),
    ("/api/create", b'{"model": "x", "modelfile": "PARAMETER top_k 1"}', "FROM"),
])
def test_bad_requests_get_a_400_naming_the_problem(daemon, path, body, fragment):
    status, answer = post(daemon.url, "POST", path, body)
    assert status == 400, answer
    assert fragment in json.loads(answer)["error"]


def test_prompt_longer_than_the_context_is_a_400(daemon):
    body = json.dumps({"model": "tiny", "prompt": "word " * 200}).encode()
    status, answer = post(daemon.url, "POST", "/api/generate", body)
    assert status == 400 and "context" in json.loads(answer)["error"]


def test_unknown_routes_and_methods_answer_json(daemon):
    status, answer = post(daemon.url, "GET", "/api/nothing", b"")
    assert status == 404 and "no such route" in json.loads(answer)["error"]
    status, answer = post(daemon.url, "GET", "/api/generate", b"")
    assert status == 405 and "error" in json.loads(answer)


def test_openai_routes_answer_errors_in_their_shape(daemon):
    status, answer = post(daemon.url, "POST", "/v1/chat/completions",
                          b'{"model": "tiny", "messages": [{"role": "wizard"}]}')
    error = json.loads(answer)["error"]
    assert status == 400 and error["type"] == "invalid_request_error"
    assert "messages[0].role" in error["message"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=20) | st.sampled_from(["tiny", "tiny:latest", "nope", "user", "json"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(FIELDS) | st.text(max_size=5), inner, max_size=4),
    max_leaves=12)
bodies = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6).map(
        lambda d: json.dumps(d).encode()),
    st.fixed_dictionaries({"model": st.sampled_from(["tiny", "nope", ""])},
                          optional={k: json_values for k in FIELDS[2:14]}).map(
        lambda d: json.dumps(d).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=40),
)


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(route=st.sampled_from(ROUTES), body=bodies)
def test_fuzzed_bodies_never_cause_a_500(daemon, route, body):
    method, path = route
    status, answer = post(daemon.url, method, path, body)
    assert status < 500 or status == 503, (status, answer[:300])
    if status >= 400:
        assert "error" in json.loads(answer)
    elif b'"error"' in answer and path in ("/api/generate", "/api/chat"):
        pytest.fail(f"error inside a 200 answer: {answer[:300]!r}")


def test_daemon_is_alive_after_the_fuzzing(daemon):
    assert post(daemon.url, "GET", "/", b"") == (200, b"exl3 is running")
    # the fuzzer may have deleted "tiny" (and with it its blobs): import it again
    source = daemon.tiny_manifest.source
    daemon.store.import_folder("tiny", source["path"], source)
    status, answer = post(daemon.url, "POST", "/api/generate",
                          b'{"model": "tiny", "prompt": "hi", "stream": false}')
    assert status == 200 and json.loads(answer)["done"] is True
