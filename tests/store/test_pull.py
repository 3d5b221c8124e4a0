"""pull_model end to end against the local hub, with the real store."""

from __future__ import annotations

import hashlib

import pytest

from exl3cli.errors import InvalidModelName, ModelNotFound, PullError
from exl3cli.store import catalog
from exl3cli.store.names import ModelName
from exl3cli.store.pull import download_dir, pull_model, source_refs
from exl3cli.store.store import ModelStore
from tests.fixtures.local_hub import LocalHub
from tests.fixtures.tiny_gguf import write_tiny_gguf
from tests.fixtures.tiny_model import write_tiny_model
from tests.fixtures.tiny_tokenizer import write_tiny_tokenizer


@pytest.fixture
def repo_folder(tmp_path):
    folder = write_tiny_model(tmp_path / "repo", "llama")
    write_tiny_tokenizer(folder)
    return folder


def test_hub_names_map_to_hub_references():
    assert source_refs(ModelName.parse("hf.co/u/r")) == ["hf:u/r"]
    assert source_refs(ModelName.parse("hf.co/u/r:v1.0")) == ["hf:u/r@v1.0"]
    assert source_refs(ModelName.parse("hf.co/u/r-GGUF:Q4_K_M")) == ["hf:u/r-GGUF#*Q4_K_M*.gguf"]
    with pytest.raises(ModelNotFound):
        source_refs(ModelName.parse("unknownmodel"))


def test_pull_from_hub_stores_files_and_reports_progress(repo_folder, tmp_path, monkeypatch):
    store = ModelStore(tmp_path / "store")
    events = []
    with LocalHub() as hub:
        commit = hub.add_repo("someone/tiny", repo_folder)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        manifest = pull_model(store, "hf.co/someone/tiny", events.append)
    statuses = [e["status"] for e in events]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    data = (repo_folder / "model.safetensors").read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert manifest.files["model.safetensors"] == digest
    assert store.blob_path(digest).read_bytes() == data
    assert store.read_manifest("hf.co/someone/tiny").source["commit"] == commit
    assert any(e.get("digest") == digest and e.get("completed") == len(data) for e in events)
    folder = store.model_folder("hf.co/someone/tiny")
    assert (folder / "tokenizer.json").read_bytes() == (repo_folder / "tokenizer.json").read_bytes()
    assert not download_dir(store, "hf:someone/tiny").exists()  # work folder cleaned up


def test_failed_pull_keeps_no_manifest_and_a_retry_succeeds(repo_folder, tmp_path, monkeypatch):
    store = ModelStore(tmp_path / "store")
    with LocalHub() as hub:
        hub.add_repo("someone/tiny", repo_folder)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        with pytest.raises(PullError):
            pull_model(store, "hf.co/someone/tiny")
        assert not store.exists("hf.co/someone/tiny")
        monkeypatch.delenv("HF_HUB_OFFLINE")
        pull_model(store, "hf.co/someone/tiny")
    assert store.exists("hf.co/someone/tiny")


def test_catalog_pull_falls_back_to_the_next_source(tmp_path, monkeypatch):
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    entry = catalog.CatalogEntry("tinycat:1m", ("hf:nobody/missing", f"gguf:{gguf_path}"),
                                 "test model", "mit")
    monkeypatch.setitem(catalog.CATALOG, "tinycat:1m", entry)
    monkeypatch.setitem(catalog.ALIASES, "tinycat:latest", "tinycat:1m")
    store = ModelStore(tmp_path / "store")
    events = []
    with LocalHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        manifest = pull_model(store, "tinycat", events.append)
    assert manifest.source["ref"] == f"gguf:{gguf_path}"
    assert any("trying the next source" in e["status"] for e in events)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(manifest.files)
    assert store.exists("tinycat:latest")


def test_catalog_pull_reports_every_failure(tmp_path, monkeypatch):
    entry = catalog.CatalogEntry("badcat:1m", ("gguf:/no/such.gguf", "folder:/no/such/folder"),
                                 "test", "mit")
    monkeypatch.setitem(catalog.CATALOG, "badcat:1m", entry)
    with pytest.raises(PullError, match="such.gguf.*such/folder"):
        pull_model(ModelStore(tmp_path / "store"), "badcat:1m")


def test_invalid_names_are_rejected(tmp_path):
    with pytest.raises(InvalidModelName):
        pull_model(ModelStore(tmp_path), "../evil")


def test_a_second_alias_of_a_stored_catalog_model_reuses_it(tmp_path, monkeypatch):
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    entry = catalog.CatalogEntry("twincat:1m", (f"gguf:{gguf_path}",), "test model", "mit")
    monkeypatch.setitem(catalog.CATALOG, "twincat:1m", entry)
    monkeypatch.setitem(catalog.ALIASES, "twincat:latest", "twincat:1m")
    store = ModelStore(tmp_path / "store")
    first = pull_model(store, "twincat")
    gguf_path.unlink()  # a second fetch would now fail
    events = []
    second = pull_model(store, "twincat:1m", events.append)
    assert second.files == first.files
    assert "using existing layers" in [e["status"] for e in events]
    assert {str(m.name) for m in store.list_models()} == {"twincat:latest", "twincat:1m"}


def test_a_catalog_pull_stores_the_entrys_settings(tmp_path, monkeypatch):
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    entry = catalog.CatalogEntry("setcat:1m", (f"gguf:{gguf_path}",), "test model", "mit",
                                 parameters={"temperature": 0.2, "stop": ["<|im_end|>"]},
                                 system="Be brief.")
    monkeypatch.setitem(catalog.CATALOG, "setcat:1m", entry)
    manifest = pull_model(ModelStore(tmp_path / "store"), "setcat:1m")
    assert manifest.parameters == {"temperature": 0.2, "stop": ["<|im_end|>"]}
    assert manifest.system == "Be brief." and manifest.license == "mit"


def test_pulling_a_present_model_fetches_nothing_and_keeps_its_date(tmp_path, monkeypatch):
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    entry = catalog.CatalogEntry("herecat:1m", (f"gguf:{gguf_path}",), "test model", "mit")
    monkeypatch.setitem(catalog.CATALOG, "herecat:1m", entry)
    store = ModelStore(tmp_path / "store")
    first = pull_model(store, "herecat:1m")
    modified = store.modified("herecat:1m")
    gguf_path.unlink()  # a second fetch would fail: proves nothing is fetched
    events = []
    second = pull_model(store, "herecat:1m", events.append)
    assert second.files == first.files and store.modified("herecat:1m") == modified
    assert [e["status"] for e in events] == ["pulling manifest", "using existing layers",
                                             "success"]
    store.blob_path(first.files["config.json"]).unlink()  # incomplete: fetched again
    with pytest.raises(ModelNotFound, match="tiny.gguf"):
        pull_model(store, "herecat:1m")
