"""`pull`: fetch a model from its sources and store it under the requested name.

Names resolve to source references: `hf.co/<user>/<repo>[:<revision>]` goes to the
hub (a GGUF quantisation tag such as `:Q4_K_M` picks that GGUF file, as in Ollama);
catalog names list several references that are tried in order. Progress is
reported as Ollama's /api/pull lines: `pulling manifest`, `pulling <digest>`
(total/completed), `verifying sha256 digest`, `writing manifest`, `success`.
Each reference downloads into its own folder under `<store>/downloads/`, kept on
failure so that the next pull resumes, removed after success.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from exl3cli.errors import Exl3Error, ModelNotFound, PullError
from exl3cli.store.catalog import CatalogEntry, catalog_entry, catalog_sources
from exl3cli.store.manifest import Manifest
from exl3cli.store.names import DEFAULT_TAG, ModelName
from exl3cli.store.sources import FetchedModel, fetch_ref
from exl3cli.store.store import ModelStore

HUB_HOSTS = ("hf.co", "huggingface.co")
_QUANT_TAG = re.compile(r"^(i?q\d[a-z0-9_]*|f16|f32|bf16)$", re.IGNORECASE)


def source_refs(name: ModelName) -> list[str]:
    """The source references to try for a model name, best first."""
    if name.host.lower() in HUB_HOSTS:
        ref = f"hf:{name.namespace}/{name.model}"
        if name.tag.lower() == DEFAULT_TAG:
            return [ref]
        if _QUANT_TAG.match(name.tag):
            return [f"{ref}#*{name.tag}*.gguf"]
        return [f"{ref}@{name.tag}"]
    refs = catalog_sources(name)
    if refs is None:
        raise ModelNotFound(
            f"model '{name}' is not in the catalog; pull hf.co/<user>/<repo>[:<revision>] "
            "for a Hugging Face repository, or create it from a Modelfile")
    return refs


def pull_model(store: ModelStore, name: str,
               progress: Callable[[dict[str, Any]], None] | None = None) -> Manifest:
    """Fetch `name` from its first working source and store it; returns the manifest."""
    model = ModelName.parse(name)
    report = _ReportedDigests(progress or (lambda _event: None))
    report({"status": "pulling manifest"})
    present = _present(store, model)
    if present is not None:
        # Stored and complete: nothing to fetch (`exl3 rm` it to fetch it again).
        report({"status": "using existing layers"})
        report({"status": "success"})
        return present
    twin = _stored_catalog_twin(store, model)
    if twin is not None:
        # `smollm2` and `smollm2:135m` are one catalog model: name the stored copy again.
        store.copy(twin, model)
        report({"status": "using existing layers"})
        report({"status": "success"})
        return store.read_manifest(model)
    refs = source_refs(model)
    failures: list[tuple[str, Exl3Error]] = []
    for ref in refs:
        workdir = download_dir(store, ref)
        try:
            fetched = fetch_ref(ref, workdir, report)
        except (PullError, ModelNotFound) as error:
            failures.append((ref, error))
            if ref != refs[-1]:
                report({"status": f"{ref} failed ({error}); trying the next source"})
            continue
        manifest = _store_fetched(store, model, ref, fetched, report)
        shutil.rmtree(workdir, ignore_errors=True)
        _remove_if_empty(workdir.parent)
        report({"status": "success"})
        return manifest
    if len(failures) == 1:
        raise failures[0][1]
    details = "; ".join(f"{ref}: {error}" for ref, error in failures)
    raise PullError(f"could not pull '{model}' from any source ({details})")


def _present(store: ModelStore, model: ModelName) -> Manifest | None:
    """The stored manifest of `model` when every blob it names is in the store (a
    catalog model stored before its entry carried settings gets them now)."""
    if not store.exists(model):
        return None
    manifest = store.read_manifest(model)
    if not all(store.has_blob(digest) for digest in manifest.files.values()):
        return None
    entry = catalog_entry(model)
    settings = entry is not None and (entry.parameters or entry.system)
    if settings and not manifest.parameters and manifest.system is None:
        manifest = with_catalog_settings(manifest, entry)
        store.write_manifest(model, manifest)
    return manifest


def with_catalog_settings(manifest: Manifest, entry: CatalogEntry | None) -> Manifest:
    """`manifest` with the catalog entry's parameters, system prompt and license."""
    if entry is None:
        return manifest
    manifest.parameters = {k: list(v) if isinstance(v, list) else v
                           for k, v in entry.parameters.items()}
    manifest.system = entry.system
    manifest.license = manifest.license or entry.license
    return manifest


def _stored_catalog_twin(store: ModelStore, model: ModelName) -> ModelName | None:
    """Another stored name of the same catalog model, when `model` itself is not stored."""
    entry = catalog_entry(model)
    if entry is None or store.exists(model):
        return None
    for stored in store.list_models():
        if stored.name != model and catalog_entry(stored.name) == entry:
            return stored.name
    return None


def download_dir(store: ModelStore, ref: str) -> Path:
    """The work folder of one source reference (stable, so a retry resumes there)."""
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "-", ref)[:60].strip("-")
    digest = hashlib.sha256(ref.encode("utf-8")).hexdigest()[:12]
    return store.root / "downloads" / f"{readable}-{digest}"


def _license_text(folder: Path) -> str | None:
    """The text of a LICENSE file the model ships, if any (`show --license`)."""
    for name in ("LICENSE", "LICENSE.txt", "LICENSE.md", "license.txt"):
        path = Path(folder) / name
        if path.is_file():
            try:
                return path.read_text(encoding="utf-8").strip() or None
            except (OSError, UnicodeDecodeError):
                return None
    return None


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass  # still holds another reference's partial download


class _ReportedDigests:
    """Forwards progress events, remembering which digests already had a bar."""

    def __init__(self, progress: Callable[[dict[str, Any]], None]):
        self._progress = progress
        self.digests: set[str] = set()

    def __call__(self, event: dict[str, Any]) -> None:
        if "digest" in event:
            self.digests.add(event["digest"])
        self._progress(event)


def _store_fetched(store: ModelStore, model: ModelName, ref: str, fetched: FetchedModel,
                   report: _ReportedDigests) -> Manifest:
    with store.writing():  # no collection between adding the blobs and the manifest
        return _store_fetched_locked(store, model, ref, fetched, report)


def _store_fetched_locked(store: ModelStore, model: ModelName, ref: str,
                          fetched: FetchedModel, report: _ReportedDigests) -> Manifest:
    files = store.add_folder_files(fetched.folder)
    for digest in files.values():
        if digest in report.digests:
            continue  # its download bar was shown already
        size = store.blob_path(digest).stat().st_size
        report({"status": f"pulling {digest[7:19]}", "digest": digest,
                "total": size, "completed": size})
    report({"status": "verifying sha256 digest"})
    for relpath, expected in fetched.expected_digests.items():
        if files.get(relpath) != expected:
            store.collect_garbage(wait=False)  # drop the blobs no manifest uses
            raise PullError(f"digest mismatch for {relpath}: expected {expected}, "
                            f"got {files.get(relpath, 'no file')}")
    report({"status": "writing manifest"})
    manifest = Manifest(files=files, source={"ref": ref, **fetched.source_info},
                        license=_license_text(fetched.folder))
    manifest = with_catalog_settings(manifest, catalog_entry(model))
    store.write_manifest(model, manifest)
    return manifest
