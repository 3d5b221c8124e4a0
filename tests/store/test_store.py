"""ModelStore: content-addressed blobs, manifests by name, sharing, removal, folders."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from exl3cli.errors import Exl3Error, ModelNotFound
from exl3cli.store.manifest import Manifest
from exl3cli.store.names import ModelName
from exl3cli.store.store import ModelStore


def write_hf_folder(folder: Path, seed: int = 0, hidden: int = 8) -> Path:
    """A tiny Hugging Face style folder: config.json, one safetensors file, a tokenizer
    file in a subfolder and a hidden cache file that the store must skip."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": hidden, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 1, "max_position_embeddings": 256, "vocab_size": 32,
              "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(seed)
    save_file({"model.embed_tokens.weight": torch.randn(32, hidden, generator=generator),
               "model.norm.weight": torch.ones(hidden)},
              str(folder / "model.safetensors"))
    (folder / "extra").mkdir(exist_ok=True)
    (folder / "extra" / "notes.txt").write_text("same text in every folder\n")
    (folder / ".cache").mkdir(exist_ok=True)
    (folder / ".cache" / "lock").write_text("not part of the model")
    return folder


def store_snapshot(root: Path) -> dict[str, str]:
    """Every file under the store with its sha256: to check that nothing changed."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def sha256_of(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def store(tmp_path: Path) -> ModelStore:
    return ModelStore(tmp_path / "store")


def test_root_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("EXL3_MODELS", str(tmp_path / "elsewhere"))
    assert ModelStore().root == tmp_path / "elsewhere"
    monkeypatch.delenv("EXL3_MODELS")
    assert ModelStore().root == Path.home() / ".exl3" / "models"


def test_blobs_are_content_addressed_and_stored_once(store, tmp_path):
    source = tmp_path / "data.bin"
    source.write_bytes(os.urandom(3 * (1 << 20) + 17))  # several copy chunks
    digest = store.add_blob_from_file(source)
    assert digest == sha256_of(source)
    assert store.blob_path(digest).read_bytes() == source.read_bytes()
    copy = tmp_path / "copy.bin"
    copy.write_bytes(source.read_bytes())
    assert store.add_blob_from_file(copy) == digest
    assert sorted(p.name for p in store.blobs_dir.iterdir()) == [f"sha256-{digest[7:]}"]


def test_import_folder_and_read_back(store, tmp_path):
    folder = write_hf_folder(tmp_path / "hf")
    manifest = store.import_folder("me/tiny:v1", folder, {"type": "folder", "path": str(folder)})
    assert sorted(manifest.files) == ["config.json", "extra/notes.txt", "model.safetensors"]
    for relpath, digest in manifest.files.items():
        assert digest == sha256_of(folder / relpath)
    again = store.read_manifest("me/tiny:v1")
    assert again == manifest
    assert again["files"] == manifest.files  # dict-style access works too
    assert again.get("source") == {"type": "folder", "path": str(folder)}
    path = store.manifests_dir / "exl3" / "me" / "tiny" / "v1"
    assert json.loads(path.read_text())["schema"] == 1
    assert not [p for p in store.root.rglob(".tmp-*")]


def test_names_match_case_insensitively_and_keep_one_spelling(store, tmp_path):
    store.import_folder("Me/Tiny:V1", write_hf_folder(tmp_path / "hf"), {})
    assert store.exists("me/tiny:v1")
    assert store.read_manifest("ME/TINY:v1").files
    store.copy("me/tiny:v1", "me/TINY:v1")  # the same name spelled otherwise
    assert [str(m.name) for m in store.list_models()] == ["me/TINY:v1"]


def test_missing_models_raise_model_not_found(store):
    with pytest.raises(ModelNotFound, match="'nothing:latest' not found"):
        store.read_manifest("nothing")
    with pytest.raises(ModelNotFound):
        store.remove("nothing")
    with pytest.raises(ModelNotFound):
        store.copy("nothing", "other")
    assert store_snapshot(store.root) == {}


def test_manifest_with_missing_blob_is_refused(store):
    manifest = Manifest(files={"config.json": "sha256:" + "0" * 64})
    with pytest.raises(Exl3Error, match="missing from the store"):
        store.write_manifest("broken", manifest)
    assert not store.exists("broken")
    with pytest.raises(Exl3Error, match="invalid file name"):
        store.write_manifest("broken", Manifest(files={"../escape": "sha256:" + "0" * 64}))


def test_list_sizes_count_shared_blobs_once(store, tmp_path):
    folder = write_hf_folder(tmp_path / "hf")
    (folder / "duplicate.txt").write_bytes((folder / "config.json").read_bytes())
    store.import_folder("tiny", folder, {})
    expected = sum((folder / name).stat().st_size
                   for name in ("config.json", "model.safetensors", "extra/notes.txt"))
    [row] = store.list_models()
    assert row.name == ModelName.parse("tiny:latest")
    assert row.size == expected
    assert row.id == row.digest[:12] == store.read_manifest("tiny").digest()[:12]


def test_copy_shares_files_and_remove_frees_only_unused_blobs(store, tmp_path):
    store.import_folder("a", write_hf_folder(tmp_path / "a", seed=1), {})
    store.import_folder("b", write_hf_folder(tmp_path / "b", seed=2), {})
    blobs_before = set(os.listdir(store.blobs_dir))
    store.copy("a", "c")
    assert set(os.listdir(store.blobs_dir)) == blobs_before
    rows = {str(r.name): r for r in store.list_models()}
    assert rows["a:latest"].digest == rows["c:latest"].digest != rows["b:latest"].digest
    shared_note = store.blob_path(store.read_manifest("a").files["extra/notes.txt"])

    store.remove("a")  # "c" still uses every blob of "a"
    assert set(os.listdir(store.blobs_dir)) == blobs_before
    store.remove("c")
    remaining = set(os.listdir(store.blobs_dir))
    assert remaining == {store.blob_path(d).name for d in store.read_manifest("b").files.values()}
    assert shared_note.exists()  # "b" has the same notes.txt
    store.remove("b")
    assert os.listdir(store.blobs_dir) == []
    assert not any(store.manifests_dir.iterdir())


def test_model_folder_links_blobs_under_their_names(store, tmp_path):
    folder = write_hf_folder(tmp_path / "hf")
    store.import_folder("tiny", folder, {})
    loaded = store.model_folder("tiny")
    for relpath in ("config.json", "model.safetensors", "extra/notes.txt"):
        assert (loaded / relpath).read_bytes() == (folder / relpath).read_bytes()
    assert not (loaded / ".cache").exists()
    store.copy("tiny", "again")
    assert store.model_folder("again") == loaded  # same files, same folder
    store.remove("tiny")
    assert loaded.is_dir()
    store.remove("again")
    assert not loaded.exists()


def test_failed_staging_removes_only_new_unused_blobs(store, tmp_path):
    store.import_folder("kept", write_hf_folder(tmp_path / "kept"), {})
    before = store_snapshot(store.root)
    new_file = tmp_path / "new.bin"
    new_file.write_bytes(b"fresh bytes")
    with pytest.raises(RuntimeError):
        with store.staging_blobs():
            store.add_folder_files(tmp_path / "kept")  # already stored: must survive
            store.add_blob_from_file(new_file)
            raise RuntimeError("boom")
    assert store_snapshot(store.root) == before


def test_import_of_a_missing_or_empty_folder_fails_cleanly(store, tmp_path):
    with pytest.raises(ModelNotFound, match="no such folder"):
        store.import_folder("x", tmp_path / "absent", {})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFound, match="no files"):
        store.import_folder("x", tmp_path / "empty", {})
    assert not store.exists("x")


def test_manifest_digest_ignores_creation_time():
    one = Manifest(files={"a": "sha256:" + "1" * 64}, parameters={"top_k": 1}, created="then")
    two = Manifest(files={"a": "sha256:" + "1" * 64}, parameters={"top_k": 1}, created="now")
    assert one.digest() == two.digest()
    two.parameters["top_k"] = 2
    assert one.digest() != two.digest()
