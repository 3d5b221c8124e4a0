"""HttpClient against a real daemon answers exactly what LocalClient answers in-process."""

from __future__ import annotations

import json
import socket
import time

import pytest

from exl3cli.client.http import HttpClient, daemon_url
from exl3cli.client.local import LocalClient
from exl3cli.errors import Exl3Error, InvalidOption, ModelNotFound
from exl3cli.runtime.residency import InferenceRunner
from tests.fixtures.tiny_store import write_tiny_chat_model

GREEDY = {"temperature": 0, "num_predict": 5}


@pytest.fixture(scope="module")
def http(daemon):
    return HttpClient(daemon.url)


@pytest.fixture(scope="module")
def local(store):
    return LocalClient(store)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def strip_times(body: dict) -> dict:
    return {k: v for k, v in body.items()
            if not k.endswith("_duration") and k not in ("created_at", "expires_at")}


def test_store_calls_match_the_in_process_client(http, local):
    assert http.list() == local.list()
    assert http.show({"model": "tiny"}) == {**local.show({"model": "tiny"}),
                                            "capabilities": ["completion"]}


def test_generate_and_chat_match_the_in_process_client(http, local):
    for method, req in (("generate", {"model": "tiny", "prompt": "hi", "options": GREEDY}),
                        ("chat", {"model": "tiny", "options": GREEDY,
                                  "messages": [{"role": "user", "content": "hi"}]})):
        remote = list(getattr(http, method)(req))
        here = list(getattr(local, method)(req))
        assert [strip_times(c) for c in remote] == [strip_times(c) for c in here]
        whole = list(getattr(http, method)({**req, "stream": False}))
        assert len(whole) == 1 and whole[0]["done"] is True


def test_errors_come_back_as_the_same_exceptions(http, local):
    for client in (http, local):
        with pytest.raises(ModelNotFound, match="nope"):
            client.show({"model": "nope"})
        with pytest.raises(ModelNotFound):
            client.generate({"model": "nope", "prompt": "x"})
    with pytest.raises(Exl3Error, match="keep_alive|duration") as bad:
        http.generate({"model": "tiny", "prompt": "x", "keep_alive": "soon"})
    with pytest.raises(InvalidOption):
        list(local.generate({"model": "tiny", "prompt": "x", "keep_alive": "soon"}))
    assert bad.value.http_status == 400


def test_create_with_a_relative_from_path_copy_delete_ps(http, tmp_path, monkeypatch):
    write_tiny_chat_model(tmp_path / "hf")
    monkeypatch.chdir(tmp_path)
    statuses = [e["status"] for e in http.create({"model": "made",
                                                  "modelfile": "FROM ./hf\nSYSTEM hi\n"})]
    assert statuses[-1] == "success"
    assert http.show({"model": "made"})["system"] == "hi"
    http.copy({"source": "made", "destination": "made2"})
    http.delete({"model": "made"})
    assert "made2:latest" in {m["name"] for m in http.list()["models"]}
    http.delete({"model": "made2"})
    list(http.generate({"model": "tiny", "prompt": "", "keep_alive": "1m"}))
    assert [m["name"] for m in http.ps()["models"]] == ["tiny:latest"]


def test_closing_a_stream_early_cancels_the_job(http, daemon):
    stream = http.chat({"model": "tiny", "messages": [{"role": "user", "content": "go"}],
                        "options": {"num_predict": 200}})
    assert next(stream)["done"] is False
    stream.close()
    deadline = time.monotonic() + 10
    while daemon.manager.stats()["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon.manager.stats()["active"] == 0
    assert daemon.manager.stats()["cancelled"] >= 1


def test_daemon_url_probes_exl3_host(daemon, monkeypatch):
    monkeypatch.setenv("EXL3_HOST", daemon.url)
    assert daemon_url() == daemon.url
    monkeypatch.setenv("EXL3_HOST", f"127.0.0.1:{free_port()}")
    started = time.monotonic()
    assert daemon_url() is None
    assert time.monotonic() - started < 1.0


def test_an_unreachable_daemon_is_a_clear_error():
    with pytest.raises(Exl3Error, match="could not reach"):
        HttpClient(f"http://127.0.0.1:{free_port()}").list()


def test_embed_and_json_format_match_the_in_process_runner(http, store):
    req = {"model": "tiny", "input": ["hi", "the sky"]}
    remote, here = http.embed(req), InferenceRunner(store).embed(req)
    assert strip_times(remote) == strip_times(here) and len(remote["embeddings"]) == 2
    asked = {"model": "tiny", "prompt": "hi", "format": "json",
             "options": {"temperature": 0, "num_predict": 30}, "stream": False}
    answer = list(http.generate(asked))[-1]["response"]
    assert answer == list(InferenceRunner(store).generate(asked))[-1]["response"]
    assert isinstance(json.loads(answer), dict)
