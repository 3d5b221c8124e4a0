"""The model library: list, show, copy, delete, create and pull over the model store,
with Ollama-shaped request and response bodies.

The daemon's routes and the in-process client (`exl3cli.client.local`) both run on
this; pull is delegated to `exl3cli.store.pull`. Inference is `runtime.residency`'s.
"""

from __future__ import annotations

import json
import os
import queue
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from exl3cli.errors import Exl3Error, InvalidModelName, ModelfileError, ModelNotFound
from exl3cli.runtime.create_checks import check_new_model
from exl3cli.runtime.model_info import model_capabilities, model_facts
from exl3cli.store.manifest import Manifest
from exl3cli.store.modelfile import Modelfile, parse_modelfile
from exl3cli.store.names import ModelName
from exl3cli.store.store import ModelStore

Body = dict[str, Any]


class ModelLibrary:
    """The store operations of the `Client` protocol against a local `ModelStore`."""

    def __init__(self, store: ModelStore | None = None):
        self.store = store if store is not None else ModelStore()

    # -- model management ------------------------------------------------------------
    def list(self) -> Body:
        models = []
        for row in self.store.list_models():
            manifest = self.store.read_manifest(row.name)
            models.append({
                "name": str(row.name), "model": str(row.name),
                "modified_at": row.modified.isoformat(), "size": row.size,
                "digest": row.digest, "details": model_facts(self.store, manifest)[0],
            })
        return {"models": models}

    def show(self, req: Body) -> Body:
        name = ModelName.parse(_model_field(req))
        manifest = self.store.read_manifest(name)
        details, model_info = model_facts(self.store, manifest)
        return {
            "modelfile": manifest_to_modelfile(name, manifest).to_text(),
            "parameters": format_parameters(manifest.parameters),
            "template": manifest.template or _own_template(self.store, name),
            "system": manifest.system or "",
            "license": manifest.license or "",
            "details": details,
            "model_info": model_info,
            "messages": list(manifest.messages),
            "draft": manifest.draft or "",
            "adapter": manifest.adapter or "",
            "modified_at": self.store.modified(name).isoformat(),
            "capabilities": model_capabilities(self.store, manifest),
        }

    def copy(self, req: Body) -> Body:
        source, destination = req.get("source"), req.get("destination")
        if not source or not destination:
            raise Exl3Error("copy needs a source and a destination")
        self.store.copy(ModelName.parse(source), ModelName.parse(destination))
        return {}

    def delete(self, req: Body) -> Body:
        self.store.remove(ModelName.parse(_model_field(req)))
        return {}

    def create(self, req: Body, allow_paths: bool = True) -> Iterator[Body]:
        """Build a model from Modelfile text; nothing is stored unless all of it works.
        With `files` ({name: digest} of stored blobs, e.g. uploaded through
        /api/blobs) those are the model and FROM is not read. Without `allow_paths`
        (an HTTP client that is not the local CLI) FROM, ADAPTER and DRAFT must not be
        paths: the daemon does not read its own files for a remote client."""
        name = ModelName.parse(_model_field(req))
        text = req.get("modelfile")
        if not isinstance(text, str):
            raise Exl3Error("create needs the text of a Modelfile")
        modelfile = parse_modelfile(text)
        files = req.get("files")
        if not allow_paths:
            _refuse_paths(modelfile, check_from=not files)  # before any line: a 400
        yield {"status": "parsing modelfile"}
        base_dir = Path(req.get("base_dir") or os.getcwd())
        with self.store.staging_blobs():
            if files:
                base = yield from self._from_files(files)
            else:
                base = yield from self._resolve_from(modelfile, base_dir, allow_paths)
            manifest = apply_modelfile(base, modelfile, base_dir, resolve_paths=allow_paths)
            yield from self._attach_adapter(manifest, base, modelfile, base_dir, req,
                                            allow_paths)
            check_new_model(self.store, manifest, modelfile)
            yield {"status": "writing manifest"}
            self.store.write_manifest(name, manifest)
        yield {"status": "success"}

    def pull(self, req: Body) -> Iterator[Body]:
        name = ModelName.parse(_model_field(req))
        yield from _pull_events(self.store, name)

    # -- create helpers ---------------------------------------------------------------
    def _resolve_from(self, modelfile: Modelfile, base_dir: Path, allow_paths: bool = True):
        """The manifest FROM names (not yet stored under the new name); yields status."""
        value, line = modelfile.from_, modelfile.from_line
        path = from_path(value, base_dir) if allow_paths else None
        if path is not None:
            if path.is_dir():
                if not (path / "config.json").is_file():
                    raise ModelfileError(line, f"FROM {value}: not a model folder (no config.json)")
                yield {"status": f"importing {path}"}
                files = self.store.add_folder_files(path)
                return Manifest(files=files, source={"type": "folder", "path": str(path)})
            if path.is_file() and path.suffix.lower() == ".gguf":
                yield {"status": f"converting {path}"}
                return Manifest(files=self._import_gguf(path),
                                source={"type": "gguf", "path": str(path)})
            if path.exists():
                raise ModelfileError(line, f"FROM {value}: not a model folder or GGUF file")
            raise ModelfileError(line, f"FROM {value}: no such file or folder")
        try:
            base_name = ModelName.parse(value)
        except InvalidModelName as error:
            raise ModelfileError(line, str(error)) from None
        if not self.store.exists(base_name):
            yield from _pull_events(self.store, base_name, final=False)
        yield {"status": "using existing layers"}
        return self.store.read_manifest(base_name)

    def _attach_adapter(self, manifest: Manifest, base: Manifest, modelfile: Modelfile,
                        base_dir: Path, req: Body, allow_paths: bool) -> Iterator[Body]:
        """Put the adapter an ADAPTER line (or `/api/create`'s `adapters`) names into
        `manifest`'s files; without either the base's adapter, if any, stays."""
        from exl3cli.runtime.adapters import import_adapter, uploaded_adapter, with_adapter

        if req.get("adapters"):
            if modelfile.adapter is not None:
                raise ModelfileError(modelfile.lines.get("adapter", 0),
                                     "give an ADAPTER line or uploaded `adapters`, not both")
            files = uploaded_adapter(self.store, req["adapters"], base)
            manifest.adapter = "sha256-" + files["adapter_model.safetensors"][7:19]
        elif modelfile.adapter is not None:
            yield {"status": "importing adapter"}
            files = import_adapter(self.store, modelfile.adapter, base_dir,
                                   modelfile.lines.get("adapter", 0), base,
                                   allow_paths=allow_paths)
        else:
            return
        manifest.files = with_adapter(manifest.files, files)

    def _from_files(self, files: Any) -> Iterator[Body]:
        """The manifest of stored blobs named by file: an HF folder (config.json and
        weights) or one GGUF file, which is converted."""
        from exl3cli.store.manifest import check_relpath

        if not isinstance(files, dict) or not files:
            raise Exl3Error("files must map file names to blob digests")
        for relpath, digest in files.items():
            check_relpath(relpath)
            if not isinstance(digest, str) or not self.store.has_blob(digest):
                raise Exl3Error(f"files: blob {digest} of '{relpath}' is not in the store; "
                                "upload it first (POST /api/blobs/<digest>)")
        ggufs = [p for p in files if p.lower().endswith(".gguf")]
        if len(files) == 1 and ggufs:
            yield {"status": f"converting {ggufs[0]}"}
            return Manifest(files=self._import_gguf(self.store.blob_path(files[ggufs[0]])),
                            source={"type": "gguf", "upload": ggufs[0]})
        if "config.json" not in files:
            raise Exl3Error("files: give a model folder's files (with config.json) "
                            "or a single .gguf file")
        yield {"status": "using uploaded files"}
        return Manifest(files=dict(files), source={"type": "upload"})

    def _import_gguf(self, path: Path) -> dict[str, str]:
        from exl3cli.gguf.convert import gguf_to_hf_folder

        self.store.root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.store.root, prefix=".convert-") as work:
            folder = gguf_to_hf_folder(path, Path(work) / "model")
            return self.store.add_folder_files(folder)


def _looks_like_path(value: str) -> bool:
    return (value.startswith(("/", "./", "../", "~", ".\\", "\\")) or value in (".", "..")
            or value.lower().endswith(".gguf") or "\\" in value)


def _refuse_paths(modelfile: Modelfile, check_from: bool = True) -> None:
    """ModelfileError for a path in FROM/ADAPTER/DRAFT: one message whatever the path,
    so a remote client learns nothing about the server's files."""
    values = [("FROM", modelfile.from_)] if check_from else []
    values += [("ADAPTER", modelfile.adapter), ("DRAFT", modelfile.draft)]
    for instruction, value in values:
        if value and _looks_like_path(value):
            raise ModelfileError(modelfile.from_line if instruction == "FROM" else 0,
                                 f"{instruction} paths are not read for HTTP clients; name "
                                 "a model, or upload files (POST /api/blobs/<digest>) and "
                                 "list them in `files`")
        if instruction != "FROM" and value:
            try:
                ModelName.parse(value)
            except InvalidModelName:
                if value not in ("ngram",):
                    raise ModelfileError(0, f"{instruction} {value}: not a model name") from None


def _own_template(store: ModelStore, name: ModelName) -> str:
    """The chat template the model ships (tokenizer_config.json, chat_template.jinja),
    shown when no TEMPLATE replaces it, as Ollama shows a model's template."""
    from exl3cli.engine.text.chat_template import ChatTemplate

    try:
        template = ChatTemplate.from_folder(store.model_folder(name))
    except (Exl3Error, OSError, ValueError):
        return ""
    return "" if template.is_fallback else template.source


def _model_field(req: Body) -> str:
    value = req.get("model") or req.get("name")
    if not isinstance(value, str) or not value:
        raise InvalidModelName("a model name is required")
    return value


def from_path(value: str, base_dir: Path) -> Path | None:
    """The path a FROM value names, or None when it is a model name (Ollama's rule:
    explicit paths, existing files, and `.gguf` names are paths)."""
    explicit = value.startswith(("/", "./", "../", "~", ".\\")) or value in (".", "..")
    candidate = Path(value).expanduser()
    if not candidate.is_absolute():
        candidate = base_dir / candidate
    if explicit or candidate.exists() or value.lower().endswith(".gguf"):
        return candidate.resolve()
    return None


def _resolve_path_reference(value: str | None, base_dir: Path) -> str | None:
    """ADAPTER/DRAFT values: relative paths become absolute so they survive a move."""
    if value is None:
        return None
    path = from_path(value, base_dir)
    return str(path) if path is not None else value


def apply_modelfile(base: Manifest, modelfile: Modelfile, base_dir: Path,
                    resolve_paths: bool = True) -> Manifest:
    """The FROM model's manifest with the Modelfile's settings laid over it (Ollama's
    rules: a PARAMETER replaces the one of the same name, MESSAGEs and LICENSEs replace
    the whole list, TEMPLATE/SYSTEM/ADAPTER/DRAFT replace when given). Without
    `resolve_paths` ADAPTER/DRAFT values are kept as written (names, not paths)."""
    if not resolve_paths:
        def _resolve_reference(value: str | None, _base: Path) -> str | None:
            return value
    else:
        _resolve_reference = _resolve_path_reference
    parameters = dict(base.parameters)
    parameters.update(modelfile.parameters)
    return replace(
        base,
        files=dict(base.files), source=dict(base.source), parameters=parameters,
        template=modelfile.template if modelfile.template is not None else base.template,
        system=modelfile.system if modelfile.system is not None else base.system,
        messages=[dict(m) for m in modelfile.messages] if modelfile.messages
        else [dict(m) for m in base.messages],
        adapter=_resolve_reference(modelfile.adapter, base_dir) or base.adapter,
        license="\n\n".join(modelfile.license) if modelfile.license else base.license,
        draft=_resolve_reference(modelfile.draft, base_dir) or base.draft,
        created=Manifest(files={}).created,
    )


def manifest_to_modelfile(name: ModelName, manifest: Manifest) -> Modelfile:
    """A Modelfile that `create` turns back into this very manifest."""
    return Modelfile(
        from_=str(name), parameters=dict(manifest.parameters), template=manifest.template,
        system=manifest.system, adapter=manifest.adapter,
        license=[manifest.license] if manifest.license is not None else [],
        messages=[dict(m) for m in manifest.messages], draft=manifest.draft,
    )


def format_parameters(parameters: dict[str, Any]) -> str:
    """Ollama's text form of a model's parameters: `name<padding>value`, one per value."""
    lines = []
    for name, value in parameters.items():
        for item in value if isinstance(value, list) else [value]:
            shown = json.dumps(item) if isinstance(item, str) else _number(item)
            lines.append(f"{name:<30} {shown}")
    return "\n".join(lines)


def _number(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _pull_events(store: ModelStore, name: ModelName, final: bool = True) -> Iterator[Body]:
    """Run `pull_model` in a thread and stream its progress dicts as they come
    (`pull_model` reports the final {"status": "success"} itself)."""
    try:
        from exl3cli.store.pull import pull_model
    except ImportError:
        raise ModelNotFound(f"model '{name}' not found (pulling is not available)") from None
    events: queue.Queue = queue.Queue()
    done = object()
    failure: list[BaseException] = []

    def work(report: Callable[[Body], None] = events.put) -> None:
        try:
            pull_model(store, str(name), report)
        except BaseException as error:  # handed to the consuming thread below
            failure.append(error)
        finally:
            events.put(done)

    thread = threading.Thread(target=work, name=f"pull {name}", daemon=True)
    thread.start()
    while (event := events.get()) is not done:
        if final or event.get("status") != "success":  # inside create, success comes later
            yield event
    thread.join()
    if failure:
        raise failure[0]
