"""Garbage collection never races a create, and killed writers leave nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from exl3cli.client.local import LocalClient
from exl3cli.store.store import ModelStore
from tests.store.test_store import write_hf_folder


def leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.name.startswith((".tmp-", ".convert-")))


def test_rm_waits_for_a_create_that_is_adding_blobs(tmp_path):
    """Item 6: `rm` of an unrelated model while `create` copied deleted its new blobs."""
    store = ModelStore(tmp_path / "store")
    store.import_folder("unrelated", write_hf_folder(tmp_path / "a", seed=1), {})
    store.copy("unrelated", "victim")
    source = write_hf_folder(tmp_path / "b", seed=2)
    (tmp_path / "Modelfile").write_text(f"FROM {source}\n")
    removers: list[threading.Thread] = []
    original = store.add_blob_from_file

    def add_then_rm(path):  # a concurrent `rm` lands right after each blob is added
        digest = original(path)
        if not removers and str(path).endswith(".safetensors"):  # weights of its own
            remover = threading.Thread(target=store.remove, args=("victim",))
            removers.append(remover)
            remover.start()
            remover.join(0.5)  # before the fix it deleted our blob in this time
        return digest

    store.add_blob_from_file = add_then_rm
    events = list(LocalClient(store).create({"model": "new", "modelfile":
                                             (tmp_path / "Modelfile").read_text(),
                                             "base_dir": str(tmp_path)}))
    assert events[-1] == {"status": "success"}
    removers[0].join(30)
    assert not removers[0].is_alive() and not store.exists("victim")
    manifest = store.read_manifest("new")
    assert all(store.has_blob(d) for d in manifest.files.values())
    assert all(store.has_blob(d) for d in store.read_manifest("unrelated").files.values())


def test_leftovers_of_killed_writers_go_when_the_store_opens(tmp_path):
    store = ModelStore(tmp_path / "store")
    store.import_folder("m", write_hf_folder(tmp_path / "a"), {})
    (store.blobs_dir / ".tmp-abc123").write_bytes(b"half a blob")
    (store.root / ".convert-xyz" / "model").mkdir(parents=True)
    (store.folders_dir / ".tmp-q").mkdir(parents=True)
    (store.manifests_dir / ".tmp-m").write_text("{")
    with store.writing():  # a writer runs: its temporary files are left alone
        assert len(leftovers(store.root)) == 4
        ModelStore(store.root)
        assert len(leftovers(store.root)) == 4
    ModelStore(store.root)
    assert leftovers(store.root) == []
    assert store.exists("m") and all(store.has_blob(d) for d in
                                      store.read_manifest("m").files.values())


def test_uploaded_blobs_survive_collection_until_used(tmp_path):
    import hashlib

    store = ModelStore(tmp_path / "store")
    data = b"uploaded bytes"
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    store.add_blob_from_stream(iter([data[:5], data[5:]]), digest)
    store.collect_garbage()
    assert store.has_blob(digest)
    pin = store.uploads_dir / store.blob_path(digest).name
    os.utime(pin, (time.time() - 7200, time.time() - 7200))  # the grace ran out
    store.collect_garbage()
    assert not store.has_blob(digest) and not pin.exists()


def run_exl3(store: Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, EXL3_MODELS=str(store), EXL3_HOST="127.0.0.1:9")
    return subprocess.Popen([sys.executable, "-m", "exl3cli", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_kill_9_during_create_leaves_nothing_after_the_next_open(tmp_path):
    """Killed creates left `.tmp-*` blobs and `.convert-*` folders that nothing removed."""
    root = tmp_path / "store"
    ModelStore(root).import_folder("keep", write_hf_folder(tmp_path / "keep"), {})
    source = write_hf_folder(tmp_path / "big", seed=3)
    with open(source / "padding.bin", "wb") as handle:  # slow enough to be caught mid-copy
        handle.write(os.urandom(1 << 20) * 48)
    (tmp_path / "Modelfile").write_text(f"FROM {source}\n")
    kills = 0
    for _ in range(3):
        process = run_exl3(root, "create", "half", "-f", str(tmp_path / "Modelfile"))
        deadline = time.monotonic() + 60
        while not leftovers(root) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            kills += 1
        process.wait(30)
    assert kills >= 1
    store = ModelStore(root)  # opening the store cleans up after the killed ones
    assert leftovers(root) == []
    assert store.exists("keep") and all(store.has_blob(d) for d in
                                         store.read_manifest("keep").files.values())
    store.collect_garbage()
    used = {store.blob_path(d).name for d in store.read_manifest("keep").files.values()}
    if store.exists("half"):  # a run finished before its kill: then it is whole
        used |= {store.blob_path(d).name for d in store.read_manifest("half").files.values()}
    assert {p.name for p in store.blobs_dir.iterdir()} == used
