"""The on-disk model store: JSON manifests per name plus content-addressed blobs.

Layout under the root (`EXL3_MODELS`, default `~/.exl3/models`):
  blobs/sha256-<hex>                             file contents, named by their digest
  manifests/<host>/<namespace>/<model>/<tag>     one JSON manifest per model name
  folders/<digest of the file list>/             links to blobs under their original
                                                 names: a Hugging Face folder the engine loads
Every write goes to a temporary file in the target's directory, is fsynced and then
renamed into place, so a crash never leaves a half-written manifest or blob.

Writers (create, pull, cp, uploads) hold a shared lock on `<root>/.lock` while they add
blobs and write the manifest that uses them; garbage collection holds it exclusively,
so `rm` never deletes a blob a create has just added. Temporary files that a killed
process left (`.tmp-*`, `.convert-*`) are removed whenever no writer holds the lock:
when a store is opened and at each collection.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from exl3cli.errors import Exl3Error, ModelNotFound
from exl3cli.store.atomic import atomic_write_bytes, write_hashed
from exl3cli.store.manifest import Manifest, StoredModel, check_relpath
from exl3cli.store.names import ModelName
from exl3cli.store.store_lock import (
    hold_store_lock,
    read_local_token,
    remove_leftover_files,
)

_CHUNK = 1 << 20
# mkstemp makes 0600 files; store files are meant to be readable like any download.
_DIR_MODE = 0o755


def _check_digest(digest: str) -> str:
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
        raise Exl3Error(f"invalid blob digest '{digest}'")
    return hexpart


class ModelStore:
    """Models by name; `create` and `cp` share blobs, `rm` frees only unshared ones."""

    def __init__(self, root: str | os.PathLike[str] | None = None):
        if root is None:
            root = os.environ.get("EXL3_MODELS") or Path.home() / ".exl3" / "models"
        self.root = Path(root).expanduser()
        self.blobs_dir = self.root / "blobs"
        self.manifests_dir = self.root / "manifests"
        self.folders_dir = self.root / "folders"
        self.uploads_dir = self.root / "uploads"
        self._held = threading.local()  # how many store locks this thread holds
        if self.root.is_dir():
            self.remove_leftovers()

    # -- locking (store/store_lock.py) --------------------------------------------
    def _lock(self, exclusive: bool, wait: bool = True) -> Any:
        """Hold the store lock (shared: writers; exclusive: collection); the context
        yields False when `wait` is off and another holder keeps it."""
        return hold_store_lock(self.root, self._held, exclusive, wait)

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Hold off garbage collection while blobs are added and a manifest written."""
        with self._lock(exclusive=False):
            yield

    def remove_leftovers(self) -> int:
        """Delete the temporary files and folders of killed writers, if no writer runs
        now (else nothing: they may be its files). Returns how many were removed."""
        with self._lock(exclusive=True, wait=False) as alone:
            if not alone:
                return 0
            places = [self.root, self.blobs_dir, self.folders_dir, self.manifests_dir,
                      self.uploads_dir]
            if self.manifests_dir.is_dir():
                places += self._manifest_tree(files=False)
            return remove_leftover_files(places)

    def local_token(self) -> str:
        """The secret that proves a client is this user's local CLI (store_lock.py)."""
        return read_local_token(self.root)

    # -- blobs ---------------------------------------------------------------------
    def blob_path(self, digest: str) -> Path:
        """Where the blob `sha256:<hex>` lives (it may not exist)."""
        return self.blobs_dir / f"sha256-{_check_digest(digest)}"

    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).is_file()

    def add_blob_from_file(self, path: str | os.PathLike[str]) -> str:
        """Copy a file into the store, hashing while copying; returns `sha256:<hex>`.
        A blob that is already there is kept as is (the copy is dropped)."""
        def chunks() -> Iterator[bytes]:
            with open(path, "rb") as src:
                while chunk := src.read(_CHUNK):
                    yield chunk

        digest = write_hashed(self.blobs_dir, chunks(), self.blob_path)
        return digest

    @contextmanager
    def staging_blobs(self) -> Iterator[None]:
        """Blobs added inside the block are deleted again if it fails, unless a manifest
        uses them: a failed create or import leaves the store as it was. The block holds
        the writers' lock, so a collection cannot take its blobs meanwhile."""
        before = set(os.listdir(self.blobs_dir)) if self.blobs_dir.is_dir() else set()
        try:
            with self.writing():
                yield
        except BaseException:
            added = set(os.listdir(self.blobs_dir)) - before if self.blobs_dir.is_dir() else set()
            if added:
                # Exclusive (another create may share these blobs and not have written
                # its manifest yet); skipped when this thread still holds a lock.
                with self._lock(exclusive=True, wait=not self._holding()) as alone:
                    if alone:
                        used = self._used_blobs()
                        for blob in added - used:
                            (self.blobs_dir / blob).unlink(missing_ok=True)
            raise

    def _holding(self) -> bool:
        return getattr(self._held, "depth", 0) > 0

    # -- uploads (POST /api/blobs; store/uploads.py) -------------------------------
    def add_blob_from_stream(self, chunks: Iterator[bytes], expected: str) -> str:
        """Store an uploaded blob whose digest must be `expected` (sha256:<hex>); it is
        kept for UPLOAD_GRACE_SECONDS even while no manifest uses it."""
        from exl3cli.store.uploads import add_uploaded_blob

        return add_uploaded_blob(self, chunks, expected)

    def _pinned_uploads(self) -> set[str]:
        from exl3cli.store.uploads import pinned_uploads

        return pinned_uploads(self.uploads_dir)

    def add_folder_files(self, folder: str | os.PathLike[str]) -> dict[str, str]:
        """Add every regular file under `folder` as a blob: {relative path: digest}."""
        folder = Path(folder)
        if not folder.is_dir():
            raise ModelNotFound(f"no such folder: {folder}")
        files: dict[str, str] = {}
        for path in sorted(folder.rglob("*")):
            relative = path.relative_to(folder)
            if not path.is_file() or any(part.startswith(".") for part in relative.parts):
                continue  # skip hidden files such as .cache/ of huggingface_hub
            files[relative.as_posix()] = self.add_blob_from_file(path)
        if not files:
            raise ModelNotFound(f"folder {folder} holds no files")
        return files

    def import_folder(self, name: str | ModelName, folder: str | os.PathLike[str],
                      source: dict[str, Any]) -> Manifest:
        """Store every file of a Hugging Face folder and point `name` at them."""
        name = ModelName.coerce(name)
        with self.staging_blobs():
            manifest = Manifest(files=self.add_folder_files(folder), source=dict(source))
            self.write_manifest(name, manifest)
        return manifest

    # -- manifests -----------------------------------------------------------------
    def _manifest_path(self, name: ModelName) -> Path | None:
        """The existing manifest file of `name`, matching letter case loosely."""
        exact = self.manifests_dir.joinpath(*name.parts())
        if exact.is_file():
            return exact
        current = self.manifests_dir
        for part in name.parts():
            if not current.is_dir():
                return None
            match = next((child for child in current.iterdir()
                          if child.name.lower() == part.lower()), None)
            if match is None:
                return None
            current = match
        return current if current.is_file() else None

    def exists(self, name: str | ModelName) -> bool:
        return self._manifest_path(ModelName.coerce(name)) is not None

    def modified(self, name: str | ModelName) -> datetime:
        """When `name` was last written (its manifest file's time)."""
        model = ModelName.coerce(name)
        path = self._manifest_path(model)
        if path is None:
            raise ModelNotFound(f"model '{model}' not found")
        return datetime.fromtimestamp(path.stat().st_mtime, tz=timezone.utc)

    def read_manifest(self, name: str | ModelName) -> Manifest:
        """The manifest of `name`; raises ModelNotFound."""
        model = ModelName.coerce(name)
        path = self._manifest_path(model)
        if path is None:
            raise ModelNotFound(f"model '{model}' not found")
        try:
            return Manifest.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError) as error:
            raise Exl3Error(f"manifest of '{model}' is unreadable: {error}") from error

    def write_manifest(self, name: str | ModelName, manifest: Manifest) -> None:
        """Point `name` at `manifest`; every blob it names must already be stored."""
        model = ModelName.coerce(name)
        for relpath, digest in manifest.files.items():
            check_relpath(relpath)
            if not self.has_blob(digest):
                raise Exl3Error(f"blob {digest} of '{relpath}' is missing from the store")
        data = json.dumps(manifest.to_dict(), indent=2, ensure_ascii=False).encode("utf-8")
        old = self._manifest_path(model)
        target = self.manifests_dir.joinpath(*model.parts())
        atomic_write_bytes(target, data)
        if old is not None and old != target:  # same name, other spelling: keep one
            old.unlink(missing_ok=True)
            self._prune_empty_dirs(old.parent)

    def _manifest_tree(self, files: bool) -> list[Path]:
        """The folders (or the files) under manifests/. A folder that an `rm` removes
        while this walks is passed over (os.walk ignores what vanished), where a glob
        raised FileNotFoundError into a concurrent listing."""
        found: list[Path] = []
        for top, _dirs, names in os.walk(self.manifests_dir):
            here = Path(top)
            if files:
                found += [here / name for name in names]
            elif here != self.manifests_dir:
                found.append(here)
        return found

    def _iter_manifest_files(self) -> Iterator[tuple[ModelName, Path]]:
        if not self.manifests_dir.is_dir():
            return
        for path in sorted(self._manifest_tree(files=True)):
            if len(path.relative_to(self.manifests_dir).parts) != 4:
                continue
            if not path.is_file() or path.name.startswith(".tmp-"):
                continue
            host, namespace, model, tag = path.relative_to(self.manifests_dir).parts
            yield ModelName(host, namespace, model, tag), path

    def _iter_manifests(self) -> Iterator[tuple[ModelName, Manifest]]:
        for name, _path in self._iter_manifest_files():
            yield name, self.read_manifest(name)

    def list_models(self) -> list[StoredModel]:
        """Every stored model, newest first."""
        rows = []
        for name, path in self._iter_manifest_files():
            try:
                manifest = self.read_manifest(name)
                size = sum(self.blob_path(d).stat().st_size
                           for d in set(manifest.files.values()) if self.has_blob(d))
                modified = datetime.fromtimestamp(path.stat().st_mtime, tz=timezone.utc)
            except (ModelNotFound, FileNotFoundError):
                continue  # removed while this listed
            rows.append(StoredModel(name, manifest.digest(), size, modified))
        rows.sort(key=lambda row: row.modified, reverse=True)
        return rows

    def copy(self, source: str | ModelName, destination: str | ModelName) -> None:
        """Give a model a second name; no file is copied."""
        destination = ModelName.coerce(destination)
        self.read_manifest(source)  # ModelNotFound before anything is written
        with self.writing():
            self.write_manifest(destination, self.read_manifest(source))

    def remove(self, name: str | ModelName) -> None:
        """Delete a name, then the blobs and folders no other name still uses."""
        model = ModelName.coerce(name)
        path = self._manifest_path(model)
        if path is None:
            raise ModelNotFound(f"model '{model}' not found")
        path.unlink()
        self._prune_empty_dirs(path.parent)
        self.collect_garbage()

    def _used_blobs(self) -> set[str]:
        used = {self.blob_path(d).name for _n, m in self._iter_manifests()
                for d in m.files.values()}
        return used | self._pinned_uploads()

    def collect_garbage(self, wait: bool = True) -> bool:
        """Remove blobs and linked folders that no manifest references (and leftovers
        of killed writers). Waits for running writers first; with `wait` off, or when
        this thread itself holds the lock, does nothing if one runs. True if it ran."""
        with self._lock(exclusive=True, wait=wait and not self._holding()) as alone:
            if not alone:
                return False
            used_blobs = self._used_blobs()
            used_folders = {_folder_key(m.files) for _n, m in self._iter_manifests()}
            if self.folders_dir.is_dir():
                for folder in self.folders_dir.iterdir():
                    if folder.name not in used_folders:
                        shutil.rmtree(folder, ignore_errors=True)
            if self.blobs_dir.is_dir():
                for blob in self.blobs_dir.iterdir():
                    if blob.name.startswith("sha256-") and blob.name not in used_blobs:
                        blob.unlink(missing_ok=True)
        self.remove_leftovers()
        return True

    def _prune_empty_dirs(self, directory: Path) -> None:
        while directory != self.manifests_dir and self.manifests_dir in directory.parents:
            try:
                directory.rmdir()
            except OSError:
                return
            directory = directory.parent

    # -- folders for the engine ----------------------------------------------------
    def model_folder(self, name: str | ModelName) -> Path:
        """A Hugging Face style folder of links to the model's blobs, made on demand."""
        return self.files_folder(self.read_manifest(name).files)

    def files_folder(self, files: dict[str, str]) -> Path:
        """The folder of links for a set of stored files (a model's, or one being
        created: `create` checks an ADAPTER against it before the manifest is written)."""
        folder = self.folders_dir / _folder_key(files)
        if folder.is_dir():
            return folder
        with self.writing():
            return self._make_folder(Manifest(files=dict(files)), folder)

    def _make_folder(self, manifest: Manifest, folder: Path) -> Path:
        self.folders_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=self.folders_dir, prefix=".tmp-"))
        try:
            os.chmod(staging, _DIR_MODE)
            for relpath, digest in manifest.files.items():
                check_relpath(relpath)
                link = staging / relpath
                link.parent.mkdir(parents=True, exist_ok=True)
                blob = self.blob_path(digest)
                try:
                    os.link(blob, link)
                except OSError:  # file systems without hard links
                    os.symlink(blob, link)
            try:
                os.replace(staging, folder)
            except OSError:  # another process made the same folder first
                if not folder.is_dir():
                    raise
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        return folder


def _folder_key(files: dict[str, str]) -> str:
    text = json.dumps(sorted(files.items()), separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]
