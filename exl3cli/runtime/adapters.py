"""LoRA adapters between the store, `create` and the loaded models.

A model made with `ADAPTER` keeps its adapter's two PEFT files in its manifest under
`adapter/` (`adapter/adapter_config.json`, `adapter/adapter_model.safetensors`), next
to the base model's files. The base weights' key (client/inference.weights_key) leaves
those out, so every model derived from one base with another adapter shares one loaded
base model, and their requests run in one batch, each row with its own adapter
(engine/adapters/lora.py). An adapter is loaded on the base model under a name made from its
files' digests, once, when a request first needs it.

`ADAPTER` takes a PEFT folder (adapter_config.json + adapter_model.safetensors), a GGUF
LoRA file (llama.cpp's layout, stored as the PEFT files it amounts to: gguf/lora.py) or
the name of a stored model that has an adapter (its adapter is reused). `/api/create`'s
`adapters` ({file name: digest} of uploaded blobs) does the same for HTTP clients.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from exl3cli.errors import AdapterError, Exl3Error, InvalidModelName, ModelfileError
from exl3cli.store.names import ModelName

ADAPTER_DIR = "adapter"
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"  # lora_peft.py
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
MAX_RESIDENT_ADAPTERS = 8  # adapters kept loaded on one base model while idle


def adapter_files(manifest: Any) -> dict[str, str]:
    """{file name: digest} of the model's adapter (empty without one)."""
    prefix = ADAPTER_DIR + "/"
    return {path[len(prefix):]: digest for path, digest in (manifest.get("files") or {}).items()
            if path.startswith(prefix)}


def base_files(files: dict[str, str]) -> dict[str, str]:
    """The files of the base model: everything but the adapter's."""
    return {path: digest for path, digest in files.items()
            if not path.startswith(ADAPTER_DIR + "/")}


def with_adapter(files: dict[str, str], adapter: dict[str, str]) -> dict[str, str]:
    """The base model's files with `adapter` ({file name: digest}) as its adapter."""
    return {**base_files(files), **{f"{ADAPTER_DIR}/{name}": d for name, d in adapter.items()}}


def adapter_key(adapter: dict[str, str]) -> str:
    """The name an adapter is loaded under on a base model (the same files: one load)."""
    text = json.dumps(sorted(adapter.items()))
    return "lora-" + hashlib.sha256(text.encode()).hexdigest()[:16]


def import_adapter(store: Any, value: str, base_dir: Path, line: int,
                   base: Any = None, allow_paths: bool = True) -> dict[str, str]:
    """The {file name: digest} of the adapter an `ADAPTER value` line names: a PEFT
    folder (its two files copied into the store), a stored model with an adapter, or
    (show --modelfile's round trip) the very adapter `base` already carries. Without
    `allow_paths` (a remote HTTP client) only the last two."""
    if base is not None and base.get("adapter") == value and adapter_files(base):
        return adapter_files(base)
    path = Path(os.path.expanduser(value))
    if not path.is_absolute():
        path = base_dir / path
    if allow_paths and (path.exists() or value.startswith(("/", "./", "../", "~"))):
        if path.is_file() and path.suffix.lower() == ".gguf":
            try:
                return import_gguf_adapter(store, path, value, base)
            except AdapterError as error:
                raise ModelfileError(line, str(error)) from None
        return _import_folder(store, value, path, line)
    try:
        name = ModelName.parse(value)
    except InvalidModelName:
        raise ModelfileError(line, f"ADAPTER {value}: no such folder, and not a model "
                                   "name") from None
    if not store.exists(name):
        raise ModelfileError(line, f"ADAPTER {value}: no such folder or stored model")
    files = adapter_files(store.read_manifest(name))
    if not files:
        raise ModelfileError(line, f"ADAPTER {value}: the stored model {name} has no "
                                   "adapter")
    return files


def import_gguf_adapter(store: Any, path: Path, label: str, base: Any) -> dict[str, str]:
    """A GGUF LoRA file (llama.cpp's layout) stored as the PEFT files it amounts to
    (gguf/lora.py; the base model's head counts undo llama.cpp's q/k row order)."""
    import tempfile

    from exl3cli.gguf.lora import gguf_lora_to_peft

    config: dict[str, Any] = {}
    digest = (base.get("files") or {}).get("config.json") if base is not None else None
    if digest:
        try:
            config = json.loads(store.blob_path(digest).read_text())
        except (OSError, ValueError):
            config = {}
    heads = int(config.get("num_attention_heads") or 0)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    if not heads:
        raise AdapterError(f"adapter {label}: a GGUF LoRA needs its base model's config.json "
                           "(head counts)")
    store.root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=store.root, prefix=".convert-") as work:
        folder = gguf_lora_to_peft(path, Path(work) / "adapter", label, heads, kv_heads)
        return {name: store.add_blob_from_file(folder / name) for name in ADAPTER_FILES}


def _import_folder(store: Any, value: str, path: Path, line: int) -> dict[str, str]:
    if not path.is_dir():
        raise ModelfileError(line, f"ADAPTER {value}: no such folder")
    missing = [name for name in ADAPTER_FILES if not (path / name).is_file()]
    if missing:
        raise ModelfileError(line, f"ADAPTER {value}: not a PEFT LoRA folder (no "
                                   f"{' or '.join(missing)})")
    return {name: store.add_blob_from_file(path / name) for name in ADAPTER_FILES}


def uploaded_adapter(store: Any, adapters: Any, base: Any) -> dict[str, str]:
    """`/api/create`'s `adapters` ({file name: digest} of uploaded blobs): the two PEFT
    files, or one GGUF LoRA file (converted)."""
    if not isinstance(adapters, dict) or not adapters:
        raise Exl3Error("adapters must map file names to blob digests")
    for name, digest in adapters.items():
        if not isinstance(digest, str) or not store.has_blob(digest):
            raise Exl3Error(f"adapters: blob {digest} of '{name}' is not in the store; "
                            "upload it first (POST /api/blobs/<digest>)")
    names = sorted(adapters)
    if len(names) == 1 and names[0].lower().endswith(".gguf"):
        return import_gguf_adapter(store, store.blob_path(adapters[names[0]]), names[0], base)
    if names != sorted(ADAPTER_FILES):
        raise Exl3Error(f"adapters: give the two PEFT files {CONFIG_FILE} and "
                        f"{WEIGHTS_FILE}, or one GGUF LoRA file; got {', '.join(names)}")
    return dict(adapters)


def check_adapter(store: Any, manifest: Any, line: int) -> None:
    """ModelfileError unless the manifest's adapter reads and fits its base model
    (checked against config.json and the tensor names, without loading weights)."""
    from exl3cli.engine.adapters.lora import check_adapter_fits, config_module_shapes
    from exl3cli.engine.adapters.peft import read_peft_adapter
    from exl3cli.engine.models.weights import WeightReader
    from exl3cli.engine.spec.architecture import get_architecture, load_family_config

    label = manifest.get("adapter") or "uploaded"
    try:
        folder = store.files_folder(manifest.files)
        adapter = read_peft_adapter(folder / ADAPTER_DIR, name=label)
        config = load_family_config(folder)
        spec = get_architecture(config.architecture)
        names = spec.tensor_names(WeightReader(folder).has)
        check_adapter_fits(adapter, config_module_shapes(config, spec, names),
                           config.architecture)
    except AdapterError as error:
        raise ModelfileError(line, str(error)) from None


def job_adapter(store: Any, loaded: Any, manifest: Any, generator: Any) -> str | None:
    """The adapter a request on `manifest`'s model runs with, loaded on the base model
    now if it is not yet: the model's own (ADAPTER), else the one loaded through
    TabbyAPI's /v1/lora/load (LoadedModel.default_adapter), else None."""
    from exl3cli.engine.adapters.lora import AdapterBank, load_adapter
    from exl3cli.engine.adapters.peft import read_peft_adapter

    files = adapter_files(manifest)
    if not files:
        return loaded.default_adapter
    key = adapter_key(files)
    model = loaded.text_model.model
    if key in AdapterBank.of(model):
        return key
    folder = store.files_folder(manifest.files)
    adapter = read_peft_adapter(folder / ADAPTER_DIR, name=manifest.get("adapter") or key)
    adapter.name = key
    _make_room(loaded, generator)
    load_adapter(model, adapter, generator)
    return key


def _make_room(loaded: Any, generator: Any) -> None:
    """Every loaded adapter costs each forward a little (its ranks are computed for all
    rows): past MAX_RESIDENT_ADAPTERS, idle ones (no job, not TabbyAPI's) are unloaded,
    oldest first, and loaded again when a request needs them."""
    from exl3cli.engine.adapters.lora import AdapterBank, unload_adapter

    bank = AdapterBank.of(loaded.text_model.model)
    with generator.lock:
        busy = generator.adapters_in_use() | {loaded.default_adapter}
        idle = [name for name in bank.names if name not in busy]
        for name in idle[: max(0, len(bank.names) + 1 - MAX_RESIDENT_ADAPTERS)]:
            unload_adapter(loaded.text_model.model, name, generator)


# ---- TabbyAPI's LoRA routes: adapters for every request on the current model -----------

def lora_dir() -> Path:
    """Where `/v1/lora/load` finds LoRA folders by name: `EXL3_LORA_DIR`, default
    `~/.exl3/loras` (as TabbyAPI's lora_dir: the server's own folder)."""
    return Path(os.environ.get("EXL3_LORA_DIR") or "~/.exl3/loras").expanduser()


def resolve_lora(store: Any, name: str) -> Path:
    """The adapter folder of a LoRA name: a folder in lora_dir(), or a stored model
    with an adapter."""
    if not isinstance(name, str) or not name:
        raise AdapterError("a LoRA needs a name")
    if "/" not in name and "\\" not in name and name not in (".", ".."):
        folder = lora_dir() / name  # a plain name: never a path out of lora_dir
        if folder.is_dir():
            return folder
    try:
        model = ModelName.parse(name)
    except InvalidModelName:
        model = None
    if model is not None and store.exists(model):
        manifest = store.read_manifest(model)
        if adapter_files(manifest):
            return store.files_folder(manifest.files) / ADAPTER_DIR
        raise AdapterError(f"adapter {name}: the stored model {model} has no adapter")
    raise AdapterError(f"adapter {name}: no such LoRA (a folder in {lora_dir()}, or a "
                       "stored model made with ADAPTER)")


def load_default_loras(store: Any, loaded: Any, loras: list[dict[str, Any]],
                       generator: Any) -> list[str]:
    """Apply `loras` ([{name, scaling}]) to every request on `loaded` that has no
    adapter of its own, together with those loaded before (their sum, as TabbyAPI
    applies every loaded LoRA). All or nothing: AdapterError names the first that
    cannot be read or does not fit."""
    from exl3cli.engine.adapters.lora import AdapterBank, load_adapter, unload_adapter
    from exl3cli.engine.adapters.peft import combine_adapters, read_peft_adapter

    wanted = {entry["name"]: entry for entry in (loaded.default_loras or [])}
    wanted.update({entry["name"]: entry for entry in loras})
    adapters = []
    for entry in wanted.values():
        scaling = entry.get("scaling")
        adapter = read_peft_adapter(resolve_lora(store, entry["name"]), entry["name"],
                                    1.0 if scaling is None else scaling)
        AdapterBank.of(loaded.text_model.model).check(adapter)
        adapters.append(adapter)
    combined = combine_adapters(adapters, "tabby:" + "+".join(wanted))
    model = loaded.text_model.model
    load_adapter(model, combined, generator)
    previous = loaded.default_adapter
    loaded.default_adapter = combined.name
    loaded.default_loras = [{"name": e["name"], "scaling": e.get("scaling", 1.0)}
                            for e in wanted.values()]
    if previous is not None and previous != combined.name:
        try:
            unload_adapter(model, previous, generator)
        except Exl3Error:
            pass  # still in use by running requests: it goes with the model
    return list(wanted)


def unload_default_loras(loaded: Any, generator: Any) -> None:
    """Requests on `loaded` run without the LoRAs of /v1/lora/load from now on."""
    from exl3cli.engine.adapters.lora import unload_adapter

    previous, loaded.default_adapter, loaded.default_loras = loaded.default_adapter, None, None
    if previous is not None:
        try:
            unload_adapter(loaded.text_model.model, previous, generator)
        except Exl3Error:
            pass  # running requests keep it until they finish; new ones do not get it


def available_loras(store: Any) -> list[str]:
    """What `/v1/loras` lists: LoRA folders in lora_dir() and stored models with an
    adapter."""
    names = []
    folder = lora_dir()
    if folder.is_dir():
        names += sorted(p.name for p in folder.iterdir() if (p / CONFIG_FILE).is_file())
    for row in store.list_models():
        if adapter_files(store.read_manifest(row.name)):
            names.append(str(row.name))
    return names
