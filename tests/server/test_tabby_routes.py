"""TabbyAPI's routes on a real daemon: health, the current model, load/unload, token
encode/decode, and the admin key that guards loading and the store."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import ollama
import openai
import pytest

from exl3cli.engine.text.tokenizer import Tokenizer
from tests.fixtures.daemon import Daemon


def call(url: str, method: str = "GET", body: dict | None = None,
         headers: dict | None = None) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, method=method, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(request) as response:
            raw = response.read().decode()
            status, kind = response.status, response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
    if kind.startswith("text/event-stream"):
        return status, [json.loads(line[6:]) for line in raw.splitlines()
                        if line.startswith("data: ")]
    return status, json.loads(raw)


def test_health_needs_no_key(store):
    with Daemon(store, api_key="secret") as daemon:
        assert call(daemon.url + "/health") == (200, {"status": "healthy"})


def test_load_current_unload(daemon):
    url = daemon.url
    status, body = call(url + "/v1/model")
    assert status == 400 and "No models are currently loaded" in body["error"]["message"]
    status, events = call(url + "/v1/model/load", "POST", {"model_name": "tiny"})
    assert status == 200 and events[-1]["status"] == "finished"
    status, card = call(url + "/v1/model")
    assert status == 200 and card["id"] == "tiny:latest" and card["object"] == "model"
    assert card["parameters"]["max_seq_len"] > 0
    (running,) = ollama.Client(host=url).ps().models
    assert running.expires_at.year > 2100  # loaded until unloaded
    assert call(url + "/v1/model/unload", "POST") == (200, None)
    assert ollama.Client(host=url).ps().models == []
    status, body = call(url + "/v1/model/load", "POST", {"name": "tiny", "max_seq_len": 4096})
    assert status == 400 and "max_seq_len" in body["error"]["message"]
    assert call(url + "/v1/model/load", "POST", {"name": "nosuch"})[0] == 404


def test_token_encode_and_decode_round_trip(daemon, store):
    tokenizer = Tokenizer.from_folder(store.model_folder("tiny"))
    url = daemon.url
    status, body = call(url + "/v1/token/encode", "POST", {"text": "Hello there", "model": "tiny"})
    # add_bos_token defaults to true, as in TabbyAPI
    assert status == 200 and body["tokens"] == tokenizer.encode("Hello there", add_bos=True)
    assert body["tokens"][0] == tokenizer.bos_token_id and body["length"] == len(body["tokens"])
    status, body = call(url + "/v1/token/encode", "POST", {"text": "Hello there",
                                                          "add_bos_token": False})
    assert body["tokens"] == tokenizer.encode("Hello there", add_bos=False)
    status, decoded = call(url + "/v1/token/decode", "POST", {"tokens": body["tokens"]})
    assert status == 200 and decoded == {"text": "Hello there"}  # the current model now
    status, chat = call(url + "/v1/token/encode", "POST",
                        {"text": [{"role": "user", "content": "hi"}]})
    im_start = tokenizer.token_to_id("<|im_start|>")
    assert status == 200 and im_start in chat["tokens"]
    status, body = call(url + "/v1/token/decode", "POST", {"tokens": [10 ** 9]})
    assert status == 400 and "ids must be" in body["error"]["message"]


def test_the_admin_key_guards_loading_and_the_store(store):
    with Daemon(store, api_key="user-key", admin_key="admin-key") as daemon:
        url = daemon.url
        user, admin = {"Authorization": "Bearer user-key"}, {"x-admin-key": "admin-key"}
        assert call(url + "/v1/auth/permission", headers=user) == (200, {"permission": "api"})
        assert call(url + "/v1/auth/permission", headers=admin) == (200, {"permission": "admin"})
        status, body = call(url + "/v1/model/load", "POST", {"name": "tiny"}, headers=user)
        assert status == 401 and "admin key" in body["error"]["message"]
        assert call(url + "/v1/model/load", "POST", {"name": "tiny"}, headers=admin)[0] == 200
        with pytest.raises(ollama.ResponseError) as refused:
            ollama.Client(host=url, headers=user).delete("tiny")
        assert refused.value.status_code == 401
        # the API key (and the admin key) still use models
        chat = openai.OpenAI(base_url=url + "/v1", api_key="user-key", max_retries=0)
        answer = chat.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": "hi"}])
        assert answer.choices[0].message.content is not None
        assert call(url + "/v1/model", headers={"x-api-key": "user-key"})[0] == 200
        assert call(url + "/v1/model")[0] == 401  # no key at all


def test_the_cli_client_sends_the_admin_key_from_its_environment(store, monkeypatch):
    from exl3cli.client.http import HttpClient
    from exl3cli.errors import Exl3Error

    with Daemon(store, admin_key="admin-key") as daemon:
        with pytest.raises(Exl3Error, match="admin key"):
            HttpClient(daemon.url).copy({"source": "tiny", "destination": "tiny-copy"})
        monkeypatch.setenv("EXL3_ADMIN_KEY", "admin-key")
        HttpClient(daemon.url).copy({"source": "tiny", "destination": "tiny-copy"})
        HttpClient(daemon.url).delete({"model": "tiny-copy"})
    assert not store.exists("tiny-copy")
