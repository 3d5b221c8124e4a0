"""The Ollama API of a real daemon on 127.0.0.1, driven by the official `ollama` client."""

from __future__ import annotations

import hashlib
import json
import urllib.request
from datetime import datetime, timezone

import ollama
import pytest

from exl3cli import __version__
from exl3cli.client.local import LocalClient
from tests.fixtures.local_hub import LocalHub
from tests.fixtures.tiny_store import write_tiny_chat_model

GREEDY = {"temperature": 0, "num_predict": 6}


@pytest.fixture(scope="module")
def client(daemon):
    return ollama.Client(host=daemon.url)


def test_root_and_version(daemon, client):
    with urllib.request.urlopen(daemon.url + "/") as response:
        assert response.read() == b"exl3 is running"
    with urllib.request.urlopen(daemon.url + "/api/version") as response:
        assert json.loads(response.read()) == {"version": __version__}


def test_generate_streaming_and_not_give_the_same_greedy_text(client, store):
    chunks = list(client.generate(model="tiny", prompt="Once upon", options=GREEDY, stream=True))
    assert all(c.done is False for c in chunks[:-1]) and chunks[-1].done is True
    streamed = "".join(c.response for c in chunks)
    whole = client.generate(model="tiny", prompt="Once upon", options=GREEDY)
    assert whole.done and whole.response == streamed and streamed
    assert whole.done_reason == "length" and whole.eval_count == 6
    for name in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(whole[name], int) and whole[name] >= 0
    # and the in-process engine answers the very same text
    local = list(LocalClient(store).generate({"model": "tiny", "prompt": "Once upon",
                                              "options": GREEDY, "stream": False}))
    assert local[-1]["response"] == streamed


def test_chat_streaming_and_not(client):
    messages = [{"role": "user", "content": "hello"}]
    chunks = list(client.chat(model="tiny", messages=messages, options=GREEDY, stream=True))
    assert chunks[-1].done and chunks[-1].done_reason == "length"
    assert all(c.message.role == "assistant" for c in chunks)
    streamed = "".join(c.message.content or "" for c in chunks)
    whole = client.chat(model="tiny", messages=messages, options=GREEDY)
    assert whole.message.content == streamed and streamed
    assert whole.prompt_eval_count > 0 and whole.eval_count == 6


def test_empty_prompt_loads_and_keep_alive_zero_unloads(client):
    loaded = client.generate(model="tiny", prompt="", keep_alive="10m")
    assert loaded.done and loaded.done_reason == "load"
    names = [m.model for m in client.ps().models]
    assert "tiny:latest" in names
    unloaded = client.generate(model="tiny", prompt="", keep_alive=0)
    assert unloaded.done_reason == "unload"
    assert client.ps().models == []


def test_ps_reports_the_loaded_model_and_its_expiry(client):
    client.generate(model="tiny", prompt="hi", keep_alive="7m",
                    options={"num_predict": 1, "num_ctx": 128})
    (model,) = client.ps().models
    assert model.model == "tiny:latest" and model.size > 0 and model.size_vram == 0
    assert model.context_length == 128
    left = (model.expires_at - datetime.now(timezone.utc)).total_seconds()
    assert 6 * 60 < left <= 7 * 60


def test_ps_and_tags_agree_on_name_digest_and_details(client):
    client.generate(model="tiny", prompt="", keep_alive="1m")
    (running,) = client.ps().models
    (stored,) = [m for m in client.list().models if m.model == "tiny:latest"]
    assert (running.name, running.model, running.digest) == (stored.model, stored.model,
                                                            stored.digest)
    assert running.details == stored.details
    assert running.details.parameter_size  # was empty in /api/ps
    client.generate(model="tiny", prompt="", keep_alive=0)


def test_push_is_refused_as_not_supported(client):
    with pytest.raises(ollama.ResponseError) as error:
        client.push("tiny")
    assert error.value.status_code == 501 and "not supported" in error.value.error


def test_list_show_copy_delete(client):
    assert [m.model for m in client.list().models] == ["tiny:latest"]
    shown = client.show("tiny")
    assert shown.details.family == "llama" and shown.modelfile.startswith("FROM ")
    assert shown.modelinfo["llama.vocab_size"] == 400
    assert client.copy("tiny", "tiny-copy:v1").status == "success"
    assert {m.model for m in client.list().models} == {"tiny:latest", "tiny-copy:v1"}
    assert client.delete("tiny-copy:v1").status == "success"
    assert [m.model for m in client.list().models] == ["tiny:latest"]
    with pytest.raises(ollama.ResponseError) as missing:
        client.delete("tiny-copy:v1")
    assert missing.value.status_code == 404


def test_unknown_model_is_a_404(client):
    for call in (lambda: client.generate(model="nope", prompt="x"),
                 lambda: client.chat(model="nope", messages=[{"role": "user", "content": "x"}]),
                 lambda: client.show("nope")):
        with pytest.raises(ollama.ResponseError) as error:
            call()
        assert error.value.status_code == 404 and "nope" in error.value.error


def test_create_from_structured_fields_and_from_a_modelfile(client):
    statuses = [p.status for p in client.create(
        model="tiny-pirate", from_="tiny", system="You are a pirate.",
        parameters={"temperature": 0.3, "stop": ["<|im_end|>", "###"]}, stream=True)]
    assert statuses[-1] == "success"
    shown = client.show("tiny-pirate")
    assert "SYSTEM You are a pirate." in shown.modelfile
    assert "temperature" in shown.parameters and '"###"' in shown.parameters
    # Ollama's older form: Modelfile text
    request = urllib.request.Request(
        client._client.base_url.join("/api/create").__str__(),
        data=json.dumps({"model": "tiny-mf", "modelfile": "FROM tiny\nPARAMETER top_k 7\n",
                         "stream": False}).encode(), method="POST")
    with urllib.request.urlopen(request) as response:
        assert json.loads(response.read()) == {"status": "success"}
    assert "top_k" in client.show("tiny-mf").parameters
    with pytest.raises(ollama.ResponseError) as bad:
        client.create(model="broken", from_="tiny", parameters={"temperature": "hot"})
    assert bad.value.status_code == 400 and "temperature" in bad.value.error
    client.delete("tiny-pirate")
    client.delete("tiny-mf")


def test_pull_streams_progress_from_the_local_hub(client, tmp_path, monkeypatch):
    folder = write_tiny_chat_model(tmp_path / "repo")
    with LocalHub() as hub:
        hub.add_repo("someone/tiny", folder)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        events = list(client.pull("hf.co/someone/tiny", stream=True))
    assert events[0].status == "pulling manifest" and events[-1].status == "success"
    data = (folder / "model.safetensors").read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert any(e.digest == digest and e.completed == len(data) for e in events)
    assert "hf.co/someone/tiny:latest" in {m.model for m in client.list().models}
    answer = client.generate(model="hf.co/someone/tiny", prompt="hi", options=GREEDY)
    assert answer.done and answer.eval_count == 6
    client.delete("hf.co/someone/tiny")


def test_pull_of_an_unknown_name_reports_the_error(client):
    with pytest.raises(ollama.ResponseError) as error:
        list(client.pull("surely-not-in-the-catalog", stream=True))
    assert "catalog" in str(error.value)
