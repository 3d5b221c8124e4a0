"""In-process inference behind the client interface: /api/generate, /api/chat, /api/ps.

`InferenceRunner` takes and returns plain dicts shaped like the Ollama REST bodies, so
the in-process client and the HTTP daemon answer identically. It resolves a name to a
store manifest, loads the model once (cached by the digest of its weight files, so two
names sharing weights share one loaded model), merges options (manifest PARAMETERs <
request options), applies the manifest SYSTEM / TEMPLATE / MESSAGEs, and streams.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from exl3cli.errors import ContextOverflow, InvalidOption

log = logging.getLogger(__name__)

DEFAULT_KEEP_ALIVE = "5m"


def now_iso() -> str:
    """`created_at` as Ollama writes it: UTC, microseconds, trailing Z."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_keep_alive(value: Any) -> float | None:
    """Seconds a model stays loaded after a request; None means forever.

    Accepts what Ollama accepts: a number of seconds, or a duration string such as
    `5m`, `1h30m`, `300ms`, `0`, `-1`.
    """
    if value is None or value == "":
        value = os.environ.get("EXL3_KEEP_ALIVE", DEFAULT_KEEP_ALIVE)
    if isinstance(value, bool):
        raise InvalidOption(f"invalid keep_alive: {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).strip()
        try:
            seconds = float(text)
        except ValueError:
            seconds = _parse_duration_text(text)
    return None if seconds < 0 else seconds


_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
                   "h": 3600.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def _parse_duration_text(text: str) -> float:
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    parts = _DURATION_PART.findall(body)
    if not parts or "".join(number + unit for number, unit in parts) != body:
        raise InvalidOption(f"invalid duration: {text!r} (use e.g. 30s, 5m, 1h, 0, -1)")
    return sign * sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)


def known_option_names() -> set[str]:
    """Every option a request may set: the Modelfile PARAMETER names."""
    from exl3cli.store.modelfile import PARAMETER_TYPES

    return set(PARAMETER_TYPES)


def merge_options(parameters: dict[str, Any] | None,
                  options: dict[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """Manifest PARAMETERs overlaid by request options; returns (merged, ignored names).

    Unknown request options are dropped with a warning, as Ollama does, so a client
    written for another server keeps working.
    """
    merged = dict(parameters or {})
    ignored: list[str] = []
    known = known_option_names()
    for name, value in (options or {}).items():
        if name not in known:
            ignored.append(name)
            continue
        if value is None:
            continue
        merged[name] = value
    if isinstance(merged.get("stop"), str):
        merged["stop"] = [merged["stop"]]
    for name in ignored:
        log.warning("invalid option provided: %s (ignored)", name)
    return merged, ignored


def _int_option(options: dict[str, Any], name: str) -> int | None:
    value = options.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InvalidOption(f"option {name} must be an integer, got {value!r}") from None


@dataclass
class LoadedModel:
    """A model resident in this process, with the facts /api/ps reports."""

    key: str
    name: str
    text_model: Any
    size: int
    details: dict[str, Any]
    on_gpu: bool
    context_length: int = 0
    expires_at: float | None = None  # monotonic deadline; None = forever
    expires_wall: datetime | None = None
    in_use: int = 0


def _weights_key(manifest: dict[str, Any]) -> str:
    files = manifest.get("files") or {}
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def _folder_size(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        try:
            if path.is_file():
                total += path.stat().st_size
        except OSError:
            continue
    return total


def _model_details(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    family = str(config.get("model_type") or "")
    quant = config.get("quantization_config") or {}
    bits = quant.get("bits") if isinstance(quant, dict) else None
    level = f"EXL3 {bits}bpw" if bits else str(config.get("torch_dtype") or "").upper()
    return {"parent_model": "", "format": "safetensors", "family": family,
            "families": [family] if family else None, "parameter_size": "",
            "quantization_level": level}


class InferenceRunner:
    """Loads models from a store and serves generate/chat/ps requests in-process."""

    def __init__(self, store: Any, max_loaded: int = 1, device: str | None = None):
        self.store = store
        self.max_loaded = max(1, max_loaded)
        self.device = device
        self._loaded: OrderedDict[str, LoadedModel] = OrderedDict()
        self._lock = threading.RLock()

    # ---- public API -----------------------------------------------------------------

    def generate(self, req: dict) -> Iterator[dict]:
        """Stream /api/generate response objects for one request."""
        from exl3cli.client.inference_jobs import GenerateJob

        return self._run(GenerateJob(req))

    def chat(self, req: dict) -> Iterator[dict]:
        """Stream /api/chat response objects for one request."""
        from exl3cli.client.inference_jobs import ChatJob

        return self._run(ChatJob(req))

    def embed(self, req: dict, normalize: bool = True) -> dict:
        """/api/embed in-process: L2-normalised mean-pooled embeddings of `input`
        (unnormalised with normalize=False, as the legacy /api/embeddings)."""
        from exl3cli.client.embeddings import run_embed

        return run_embed(self, req, normalize)

    def ps(self) -> dict:
        """Loaded models, shaped like Ollama's /api/ps body."""
        with self._lock:
            self._expire()
            models = []
            for loaded in self._loaded.values():
                expires = loaded.expires_wall or (datetime.now(timezone.utc)
                                                   + timedelta(days=365 * 100))
                models.append({
                    "name": loaded.name,
                    "model": loaded.name,
                    "size": loaded.size,
                    "digest": loaded.key,
                    "details": dict(loaded.details),
                    "expires_at": expires.isoformat().replace("+00:00", "Z"),
                    "size_vram": loaded.size if loaded.on_gpu else 0,
                    "context_length": loaded.context_length,
                })
            return {"models": models}

    def unload(self, name: str) -> bool:
        """Drop a loaded model now (`exl3 stop`, keep_alive 0); False if not loaded."""
        manifest = self.store.read_manifest(name)
        with self._lock:
            return self._loaded.pop(_weights_key(manifest), None) is not None

    # ---- internals ------------------------------------------------------------------

    def _run(self, job: Any) -> Iterator[dict]:
        # Validate, resolve and start eagerly so a bad request raises at the call, not
        # at the first next(): that is where a CLI or HTTP handler expects errors.
        started = time.perf_counter_ns()
        manifest = self.store.read_manifest(job.model)
        keep_alive = parse_keep_alive(job.req.get("keep_alive"))
        options, ignored = merge_options(manifest.get("parameters"), job.req.get("options"))
        from exl3cli.engine.structured import compile_format

        compile_format(job.req.get("format"))  # a bad schema fails before any loading
        load_started = time.perf_counter_ns()
        loaded = self._acquire(job.model, manifest)
        load_ns = time.perf_counter_ns() - load_started
        if job.is_load_only():
            return self._finish_load_only(job, loaded, keep_alive, started, load_ns)
        cancel = threading.Event()
        try:
            text_model = loaded.text_model
            prompt_ids = job.prompt_ids(text_model, manifest)
            num_ctx = text_model.context_length(options)
            drop = 0
            while len(prompt_ids) >= num_ctx and drop < job.droppable(manifest):
                drop += 1
                prompt_ids = job.prompt_ids(text_model, manifest, drop=drop)
            if len(prompt_ids) >= num_ctx:
                raise ContextOverflow(
                    f"the prompt is {len(prompt_ids)} tokens, which does not fit the context "
                    f"window of {num_ctx} tokens (raise num_ctx)")
            loaded.context_length = num_ctx
            num_predict = _int_option(options, "num_predict")
            stop = [s for s in (options.get("stop") or []) if s]
            events = text_model.stream(prompt_ids, options, stop=stop,
                                       num_predict=-1 if num_predict is None else num_predict,
                                       cancel=cancel, format=job.req.get("format"))
        except BaseException:
            self._release(loaded, keep_alive)
            raise
        return self._respond(job, loaded, events, cancel, prompt_ids, ignored, keep_alive,
                             started, load_ns)

    def _respond(self, job: Any, loaded: LoadedModel, events: Iterator[Any],
                 cancel: threading.Event, prompt_ids: list[int], ignored: list[str],
                 keep_alive: float | None, started: int, load_ns: int) -> Iterator[dict]:
        """Turn engine events into response objects (chunks, or one object if not
        streaming), then the final object with Ollama's counters."""
        final_event = None
        pieces: list[tuple[str, str]] = []
        generated: list[int] = []
        splitter = job.thinking_splitter()
        tool_parser = job.tool_parser()

        def routed(items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
            """Thinking passes through; content goes through the tool-call parser."""
            out: list[tuple[str, Any]] = []
            for kind, part in items:
                out.extend(tool_parser.push(part) if kind == "content" else [(kind, part)])
            return out

        try:
            for event in events:
                if event.done:
                    final_event = event
                    break
                generated.extend(event.token_ids)
                for kind, part in routed(splitter.push(event.text)):
                    if job.streaming:
                        yield job.chunk(part, kind)
                    else:
                        pieces.append((kind, part))
            for kind, part in routed(splitter.flush()) + tool_parser.flush():
                if job.streaming:
                    yield job.chunk(part, kind)
                else:
                    pieces.append((kind, part))
            done = final_event or SimpleNamespace(done_reason="stop", prompt_eval_count=0,
                                                  prompt_eval_duration=0, eval_count=0,
                                                  eval_duration=0)
            yield job.final(
                pieces=None if job.streaming else pieces,
                done_reason=done.done_reason or "stop",
                metrics={
                    "total_duration": time.perf_counter_ns() - started,
                    "load_duration": load_ns,
                    "prompt_eval_count": done.prompt_eval_count,
                    "prompt_eval_duration": done.prompt_eval_duration,
                    "eval_count": done.eval_count,
                    "eval_duration": done.eval_duration,
                },
                warnings=[f"invalid option provided: {name}" for name in ignored],
                context=list(prompt_ids) + generated,
            )
        finally:
            cancel.set()  # a closed generator (Ctrl-C, client gone) stops the engine
            close = getattr(events, "close", None)
            if close is not None:
                close()
            self._release(loaded, keep_alive)

    def _finish_load_only(self, job: Any, loaded: LoadedModel, keep_alive: float | None,
                          started: int, load_ns: int) -> Iterator[dict]:
        unloading = keep_alive == 0
        self._release(loaded, keep_alive)
        final = job.final(pieces=None if job.streaming else [],
                          done_reason="unload" if unloading else "load",
                          metrics={"total_duration": time.perf_counter_ns() - started,
                                   "load_duration": load_ns},
                          warnings=[], context=None)
        return iter([final])

    def _acquire(self, name: str, manifest: dict[str, Any]) -> LoadedModel:
        key = _weights_key(manifest)
        with self._lock:
            self._expire()
            loaded = self._loaded.get(key)
            if loaded is None:
                loaded = self._load(key, name)
                while len(self._loaded) >= self.max_loaded:
                    victim = next((k for k, m in self._loaded.items() if m.in_use == 0), None)
                    if victim is None:
                        break
                    del self._loaded[victim]
                self._loaded[key] = loaded
            self._loaded.move_to_end(key)
            loaded.name = name
            loaded.in_use += 1
            return loaded

    def _load(self, key: str, name: str) -> LoadedModel:
        from exl3cli.engine.textmodel import TextModel

        folder = Path(self.store.model_folder(name))
        text_model = TextModel.load(folder, device=self.device)
        device = str(getattr(text_model.model, "device", "cpu"))
        return LoadedModel(key=key, name=name, text_model=text_model,
                           size=_folder_size(folder), details=_model_details(folder),
                           on_gpu=device.startswith("cuda"))

    def _release(self, loaded: LoadedModel, keep_alive: float | None) -> None:
        with self._lock:
            loaded.in_use = max(0, loaded.in_use - 1)
            if keep_alive is None:
                loaded.expires_at = loaded.expires_wall = None
            else:
                loaded.expires_at = time.monotonic() + keep_alive
                loaded.expires_wall = datetime.now(timezone.utc) + timedelta(seconds=keep_alive)
            if keep_alive == 0 and loaded.in_use == 0:
                self._loaded.pop(loaded.key, None)

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, m in self._loaded.items()
                    if m.in_use == 0 and m.expires_at is not None and m.expires_at <= now]:
            del self._loaded[key]
