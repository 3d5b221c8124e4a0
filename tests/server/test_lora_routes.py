"""LoRA adapters over HTTP on a real daemon: Ollama's /api/create with uploaded
`adapters` (the official client), TabbyAPI's /v1/loras, /v1/lora, /v1/lora/load and
/v1/lora/unload, and a 400 naming the adapter and the mismatch for one that does not fit."""

from __future__ import annotations

import ollama
import pytest

from tests.engine.test_lora import make_adapter
from tests.fixtures.daemon import Daemon
from tests.fixtures.tiny_model import tiny_reference_model
from tests.fixtures.tiny_store import TINY_VOCAB
from tests.server.test_tabby_routes import call

OPTIONS = {"temperature": 0, "num_predict": 10}


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-dir")
    reference = tiny_reference_model("llama", vocab_size=TINY_VOCAB)
    make_adapter(reference, root / "style", seed=1)
    make_adapter(reference, root / "other", seed=2, targets=["q_proj", "v_proj"])
    make_adapter(tiny_reference_model("llama", hidden_size=96), root / "wide", seed=3)
    return root


@pytest.fixture(scope="module")
def served(store, lora_dir):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EXL3_LORA_DIR", str(lora_dir))
        with Daemon(store) as daemon:
            yield daemon, ollama.Client(host=daemon.url)


def text(client: ollama.Client, model: str) -> str:
    return client.generate(model=model, prompt="hello there", raw=True, options=OPTIONS).response


def upload(client: ollama.Client, folder) -> dict[str, str]:
    return {name: client.create_blob(folder / name)
            for name in ("adapter_config.json", "adapter_model.safetensors")}


def test_create_with_uploaded_adapters(served, lora_dir):
    daemon, client = served
    client.create(model="tiny-style", from_="tiny", adapters=upload(client, lora_dir / "style"))
    shown = client.show("tiny-style")
    assert "ADAPTER sha256-" in shown.modelfile
    assert text(client, "tiny-style") != text(client, "tiny")
    # A model made from a stored adapter model by name gives the same text.
    client.create(model="tiny-style2", from_="tiny-style")
    assert text(client, "tiny-style2") == text(client, "tiny-style")


def test_an_adapter_for_another_base_is_a_400(served, lora_dir):
    _, client = served
    with pytest.raises(ollama.ResponseError) as error:
        client.create(model="tiny-wide", from_="tiny", adapters=upload(client, lora_dir / "wide"))
    assert error.value.status_code == 400
    assert "shape mismatch at model.layers.0." in error.value.error
    with pytest.raises(ollama.ResponseError) as error:
        client.create(model="tiny-x", from_="tiny",
                      adapters={"adapter_model.safetensors": "sha256:" + "0" * 64})
    assert error.value.status_code == 400 and "is not in the store" in error.value.error
    only_config = {"adapter_config.json": upload(client, lora_dir / "style")["adapter_config.json"]}
    with pytest.raises(ollama.ResponseError) as error:
        client.create(model="tiny-x", from_="tiny", adapters=only_config)
    assert error.value.status_code == 400 and "give the two PEFT files" in error.value.error
    status, body = call(daemon_url(served) + "/api/create", "POST",
                        {"model": "tiny-p", "modelfile": f"FROM tiny\nADAPTER {lora_dir}/style\n"})
    assert status == 400 and "ADAPTER paths are not read for HTTP clients" in body["error"]


def daemon_url(served) -> str:
    return served[0].url


def test_tabby_lora_routes(served, lora_dir):
    daemon, client = served
    url = daemon.url
    base = text(client, "tiny")
    status, listed = call(url + "/v1/loras")
    names = [card["id"] for card in listed["data"]]
    assert status == 200 and {"style", "other", "wide"} <= set(names)
    assert call(url + "/v1/model/load", "POST", {"name": "tiny"})[0] == 200
    status, body = call(url + "/v1/lora/load", "POST", {"loras": [{"name": "style"}]})
    assert (status, body) == (200, {"success": ["style"], "failure": []})
    status, active = call(url + "/v1/lora")
    assert [(c["id"], c["scaling"]) for c in active["data"]] == [("style", 1.0)]
    styled = text(client, "tiny")
    assert styled != base
    client.create(model="tiny-style3", from_="tiny",
                  adapters=upload(client, lora_dir / "style"))
    assert styled == text(client, "tiny-style3")  # the same adapter, the same text
    # A second LoRA is added to the first (their sum), as TabbyAPI applies both.
    status, body = call(url + "/v1/lora/load", "POST",
                        {"loras": [{"name": "other", "scaling": 0.5}]})
    assert body["success"] == ["style", "other"]
    assert text(client, "tiny") not in (base, styled)
    # One that does not fit: a 400 naming it, and the loaded ones stay.
    status, body = call(url + "/v1/lora/load", "POST", {"loras": [{"name": "wide"}]})
    assert status == 400 and "adapter wide: shape mismatch" in body["error"]["message"]
    status, body = call(url + "/v1/lora/load", "POST", {"loras": [{"name": "../etc"}]})
    assert status == 400 and "no such LoRA" in body["error"]["message"]
    assert len(call(url + "/v1/lora")[1]["data"]) == 2
    assert call(url + "/v1/lora/unload", "POST")[0] == 200
    assert call(url + "/v1/lora")[1]["data"] == []
    assert text(client, "tiny") == base


def test_loading_loras_needs_the_admin_key(store, lora_dir):
    with Daemon(store, admin_key="admin-key") as daemon:
        body = {"loras": [{"name": "style"}]}
        for route in ("/v1/lora/load", "/v1/lora/unload"):
            status, _ = call(daemon.url + route, "POST", body, {"x-api-key": "nope"})
            assert status == 401
        assert call(daemon.url + "/v1/loras", headers={"x-admin-key": "admin-key"})[0] == 200


def test_the_cli_uploads_an_adapter_folder_to_a_daemon_that_does_not_read_its_paths(
        served, store, lora_dir, tmp_path, monkeypatch):
    from exl3cli.client.http import HttpClient
    from exl3cli.runtime.adapters import adapter_files

    daemon, client = served
    monkeypatch.setenv("EXL3_MODELS", str(tmp_path / "elsewhere"))  # another local token
    events = list(HttpClient(daemon.url).create(
        {"model": "tiny-up", "modelfile": f"FROM tiny\nADAPTER {lora_dir / 'style'}\n"}))
    assert events[-1]["status"] == "success"
    assert sorted(adapter_files(store.read_manifest("tiny-up"))) == [
        "adapter_config.json", "adapter_model.safetensors"]
    client.create(model="tiny-style4", from_="tiny", adapters=upload(client, lora_dir / "style"))
    assert text(client, "tiny-up") == text(client, "tiny-style4")
