"""Model sources against a local hub (HF_ENDPOINT) and local files; no mocks."""

from __future__ import annotations

import hashlib

import pytest

from exl3cli.errors import ModelNotFound, PullError
from exl3cli.store.sources import find_source, get_sources
from tests.fixtures.local_hub import LocalHub
from tests.fixtures.tiny_gguf import write_tiny_gguf
from tests.fixtures.tiny_model import write_tiny_model
from tests.fixtures.tiny_tokenizer import write_tiny_tokenizer


@pytest.fixture
def repo_folder(tmp_path):
    folder = write_tiny_model(tmp_path / "repo", "llama")
    write_tiny_tokenizer(folder)
    (folder / "onnx").mkdir()
    (folder / "onnx" / "model.onnx").write_bytes(b"not needed")
    return folder


def _events():
    events = []
    return events, events.append


def test_builtin_sources_are_registered_through_the_hook():
    names = [source.name for source in get_sources()]
    assert set(names) >= {"hf", "folder", "gguf", "pypi"}
    assert names.index("hf") < names.index("pypi")  # priority order
    assert find_source("gguf:/x.gguf").name == "gguf"
    with pytest.raises(PullError):
        find_source("ftp:somewhere")


def test_hub_source_downloads_folder_with_digests(repo_folder, tmp_path, monkeypatch):
    with LocalHub() as hub:
        commit = hub.add_repo("someone/tiny", repo_folder)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        events, report = _events()
        fetched = find_source("hf:someone/tiny").fetch("hf:someone/tiny", tmp_path / "w", report)
    names = sorted(p.name for p in fetched.folder.iterdir())
    assert "model.safetensors" in names and "config.json" in names and "onnx" not in names
    data = (repo_folder / "model.safetensors").read_bytes()
    assert (fetched.folder / "model.safetensors").read_bytes() == data
    assert fetched.expected_digests["model.safetensors"] == "sha256:" + hashlib.sha256(data).hexdigest()
    assert fetched.source_info["commit"] == commit
    done = [e for e in events if e.get("digest") == fetched.expected_digests["model.safetensors"]]
    assert done[-1]["completed"] == done[-1]["total"] == len(data)


def test_hub_source_resumes_a_dropped_transfer(repo_folder, tmp_path, monkeypatch):
    from huggingface_hub import constants

    # huggingface_hub writes whole chunks; small chunks let a small file be cut mid-way
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    data = (repo_folder / "model.safetensors").read_bytes()
    with LocalHub() as hub:
        hub.add_repo("someone/tiny", repo_folder)
        hub.drop_once_after["model.safetensors"] = len(data) // 3
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        fetched = find_source("hf:x/y").fetch("hf:someone/tiny", tmp_path / "w", lambda e: None)
        ranges = [r.headers.get("range") for r in hub.requests
                  if r.method == "GET" and r.path.endswith("model.safetensors")]
    assert (fetched.folder / "model.safetensors").read_bytes() == data
    assert len(ranges) == 2 and ranges[0] is None
    resumed_at = int(ranges[1].removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at <= len(data) // 3  # the second request asked only for the rest


def test_hub_source_sends_hf_token_for_gated_repos(repo_folder, tmp_path, monkeypatch):
    with LocalHub() as hub:
        hub.add_repo("someone/gated", repo_folder, token="secret-token")
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        with pytest.raises(PullError, match="gated"):
            find_source("hf:a/b").fetch("hf:someone/gated", tmp_path / "w1", lambda e: None)
        monkeypatch.setenv("HF_TOKEN", "secret-token")
        fetched = find_source("hf:a/b").fetch("hf:someone/gated", tmp_path / "w2", lambda e: None)
    assert (fetched.folder / "config.json").is_file()


def test_hub_source_errors(repo_folder, tmp_path, monkeypatch):
    with LocalHub() as hub:
        hub.add_repo("someone/tiny", repo_folder)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        source = find_source("hf:a/b")
        with pytest.raises(ModelNotFound):
            source.fetch("hf:someone/missing", tmp_path / "w", lambda e: None)
        with pytest.raises(ModelNotFound):
            source.fetch("hf:someone/tiny@v9", tmp_path / "w", lambda e: None)
    # the hub is gone now: a connection error becomes a PullError
    with pytest.raises(PullError, match="cannot reach"):
        source.fetch("hf:someone/tiny", tmp_path / "w", lambda e: None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PullError, match="HF_HUB_OFFLINE"):
        source.fetch("hf:someone/tiny", tmp_path / "w", lambda e: None)


def test_hub_source_converts_gguf_only_repos(tmp_path, monkeypatch):
    repo = tmp_path / "ggufrepo"
    repo.mkdir()
    write_tiny_gguf(repo / "tiny-Q8_0.gguf", quant="Q8_0")
    write_tiny_gguf(repo / "tiny-F32.gguf", quant="F32")
    with LocalHub() as hub:
        hub.add_repo("someone/tiny-GGUF", repo)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        fetched = find_source("hf:a/b").fetch("hf:someone/tiny-GGUF#*F32*.gguf", tmp_path / "w",
                                              lambda e: None)
    assert fetched.source_info["file"] == "tiny-F32.gguf"
    assert (fetched.folder / "model.safetensors").is_file()
    assert (fetched.folder / "tokenizer.json").is_file()


def test_local_folder_and_gguf_sources(repo_folder, tmp_path):
    fetched = find_source("folder:x").fetch(f"folder:{repo_folder}", tmp_path / "w", lambda e: None)
    assert fetched.folder == repo_folder.resolve()
    with pytest.raises(ModelNotFound):
        find_source("folder:x").fetch(f"folder:{tmp_path / 'nothing'}", tmp_path / "w", print)
    write_tiny_gguf(tmp_path / "m.gguf")
    fetched = find_source("gguf:x").fetch(f"gguf:{tmp_path / 'm.gguf'}", tmp_path / "w", lambda e: None)
    assert (fetched.folder / "config.json").is_file()
    assert fetched.source_info == {"type": "gguf", "path": str((tmp_path / "m.gguf").resolve())}
