"""/api/blobs and /api/create with uploaded `files`; server paths only for the local CLI."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import ollama
import pytest

from exl3cli.client.http import LOCAL_TOKEN_HEADER, HttpClient
from tests.fixtures.http_raw import raw_request
from tests.fixtures.tiny_store import write_tiny_chat_model


def call(url: str, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    return raw_request(url, method, path, body, headers)


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_chat_model(tmp_path_factory.mktemp("upload") / "model")


def test_blob_upload_checks_the_digest(daemon):
    data = b"some bytes" * 1000
    assert call(daemon.url, "HEAD", f"/api/blobs/{sha(data)}")[0] == 404
    status, raw = call(daemon.url, "POST", f"/api/blobs/{sha(b'other')}", data)
    assert status == 400 and "digest mismatch" in json.loads(raw)["error"]
    assert call(daemon.url, "HEAD", f"/api/blobs/{sha(b'other')}")[0] == 404
    assert call(daemon.url, "POST", f"/api/blobs/{sha(data)}", data)[0] == 201
    assert call(daemon.url, "HEAD", f"/api/blobs/{sha(data)}")[0] == 200
    for bad in ("sha256:xyz", "md5:00", "..%2F..%2Fetc%2Fpasswd"):
        assert call(daemon.url, "HEAD", f"/api/blobs/{bad}")[0] == 400
        assert call(daemon.url, "POST", f"/api/blobs/{bad}", b"x")[0] == 400


def test_ollama_client_creates_a_model_from_uploaded_files(daemon, folder, store):
    client = ollama.Client(host=daemon.url)
    files = {path.name: client.create_blob(path) for path in sorted(folder.iterdir())
             if path.is_file()}
    client.create(model="uploaded", files=files, system="Be brief.",
                  parameters={"temperature": 0})
    assert store.read_manifest("uploaded").system == "Be brief."
    answer = client.generate(model="uploaded", prompt="hi", options={"num_predict": 3})
    assert answer.done
    with pytest.raises(ollama.ResponseError, match="not in the store"):
        client.create(model="broken", files={"config.json": sha(b"never uploaded")})
    with pytest.raises(ollama.ResponseError, match="invalid file name"):
        client.create(model="broken", files={"../../x": files["config.json"]})


@pytest.mark.parametrize("source", ["/etc", "/etc/shadow", "/nonexistent", "FOLDER",
                                    "./relative", "~/x.gguf", "model.gguf"])
def test_create_over_http_never_reads_server_paths(daemon, folder, store, source):
    """Item 4: FROM <path> copied server folders; errors told which paths exist."""
    source = str(folder) if source == "FOLDER" else source
    errors = set()
    for body in ({"model": "leak", "from": source},
                 {"model": "leak", "modelfile": f"FROM {source}\n"},
                 {"model": "leak", "modelfile": "FROM tiny\nDRAFT /etc\n"}):
        status, raw = call(daemon.url, "POST", "/api/create", json.dumps(body).encode())
        assert status == 400, raw
        errors.add(json.loads(raw)["error"].replace(source, "<path>"))
    assert not store.exists("leak")
    assert all("not read for HTTP clients" in error for error in errors)


def test_the_local_cli_may_still_name_server_paths(daemon, folder, store, monkeypatch):
    monkeypatch.setenv("EXL3_MODELS", str(store.root))
    client = HttpClient(daemon.url)
    events = list(client.create({"model": "from-folder", "modelfile": f"FROM {folder}\n"}))
    assert events[-1]["status"] == "success" and store.exists("from-folder")
    status, raw = call(daemon.url, "POST", "/api/create",
                       json.dumps({"model": "x", "from": str(folder)}).encode(),
                       headers={LOCAL_TOKEN_HEADER: "0" * 64})
    assert status == 400 and not store.exists("x")
