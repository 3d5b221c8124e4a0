"""In-process inference behind the client interface: /api/generate, /api/chat, /api/ps.

`InferenceRunner` takes and returns plain dicts shaped like the Ollama REST bodies, so
the in-process client and the HTTP daemon answer identically. It resolves a name to a
store manifest, loads the model once (cached by the digest of its weight files, so two
names sharing weights share one loaded model), merges options (manifest PARAMETERs <
request options), applies the manifest SYSTEM / TEMPLATE / MESSAGEs, and streams the
answer from the model's continuous-batching Generator (engine/generation/generator.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from exl3cli.errors import ContextOverflow, InvalidOption
from exl3cli.runtime.loaded_model import LoadedModel, folder_size, weights_key
from exl3cli.runtime.logprobs import LogprobRecorder
from exl3cli.runtime.options import (
    cache_type_option,
    default_num_parallel,
    drafter_for,
    int_option,
    merge_options,
    parse_keep_alive,
)
from exl3cli.store.names import ModelName

log = logging.getLogger(__name__)


class InferenceRunner:
    """Loads models from a store and serves generate/chat/ps requests in-process.

    Every loaded model has one continuous-batching Generator (engine/generation/generator.py):
    concurrent requests (threads) share forward passes, repeated prompt prefixes are
    reused, and the KV cache type comes from the `kv_cache_type` option (else
    $EXL3_KV_CACHE_TYPE). `num_parallel` jobs run in one batch; more wait in the
    generator's queue. With `background` (the daemon) a GeneratorThread steps it;
    otherwise the threads reading the answers step it themselves (no extra thread in
    a one-shot `exl3 run`).
    """

    def __init__(self, store: Any, max_loaded: int = 1, device: str | None = None,
                 num_parallel: int | None = None, background: bool = False):
        self.store = store
        self.max_loaded = max(1, max_loaded)
        self.device = device
        self.num_parallel = max(1, num_parallel or default_num_parallel())
        self.background = background
        self._loaded: OrderedDict[str, LoadedModel] = OrderedDict()
        self.loads: dict[str, int] = {}  # loads by name, evictions: for GET /api/stats
        self.evictions = 0
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)

    # ---- public API -----------------------------------------------------------------

    @property
    def lock(self) -> threading.RLock:
        """Held while the loaded models change (held: their generators stay put)."""
        return self._lock

    def generate(self, req: dict, cancel: threading.Event | None = None) -> Iterator[dict]:
        """Stream /api/generate response objects for one request. Setting `cancel`
        (the daemon does when the client goes away) stops the job at its next token;
        closing the returned iterator does the same."""
        from exl3cli.runtime.jobs import GenerateJob

        return self._run(GenerateJob(req), cancel)

    def chat(self, req: dict, cancel: threading.Event | None = None) -> Iterator[dict]:
        """Stream /api/chat response objects for one request (`cancel` as for
        `generate`)."""
        from exl3cli.runtime.jobs import ChatJob

        return self._run(ChatJob(req), cancel)

    def open(self, kind: str, req: dict, sink: Any) -> Any:
        """Start a generate/chat request whose events go to `sink` (a WakeBatcher,
        engine/generation/wake.py): a runtime.responses.PushedResponses for the caller
        to feed; a load-only request gives its iterator of response objects instead.
        Errors raise here, as for generate/chat."""
        from exl3cli.runtime.jobs import ChatJob, GenerateJob

        job = GenerateJob(req) if kind == "generate" else ChatJob(req)
        return self._run(job, None, sink)

    def embed(self, req: dict, normalize: bool = True) -> dict:
        """/api/embed in-process: L2-normalised mean-pooled embeddings of `input`
        (unnormalised with normalize=False, as the legacy /api/embeddings)."""
        from exl3cli.runtime.embeddings import run_embed

        return run_embed(self, req, normalize)

    def ps(self) -> dict:
        """Loaded models, shaped like Ollama's /api/ps body."""
        with self._lock:
            self._expire()
            models = []
            for loaded in self._loaded.values():
                expires = loaded.expires_wall or (datetime.now(timezone.utc)
                                                   + timedelta(days=365 * 100))
                models.append({  # name, digest and details as /api/tags shows them
                    "name": loaded.name,
                    "model": loaded.name,
                    "size": loaded.size,
                    "digest": loaded.digest or loaded.key,
                    "details": dict(loaded.details),
                    "expires_at": expires.isoformat().replace("+00:00", "Z"),
                    "size_vram": loaded.size_vram,
                    "context_length": loaded.context_length,
                })
            return {"models": models}

    @contextmanager
    def holding(self, name: str, manifest: dict[str, Any],
                keep_alive: float | None) -> Iterator[LoadedModel]:
        """`name` (whose store manifest is `manifest`) loaded and held for the `with`
        block: it is not unloaded meanwhile; afterwards it stays `keep_alive` seconds
        (None: forever, 0: unloaded at once if nobody else holds it)."""
        loaded = self._acquire(name, manifest)
        try:
            yield loaded
        finally:
            self._release(loaded, keep_alive)

    def current(self) -> LoadedModel | None:
        """The most recently used loaded model (TabbyAPI's "current model"), or None."""
        with self._lock:
            self._expire()
            return next(reversed(self._loaded.values()), None)

    def loaded_model(self, name: str) -> LoadedModel:
        """`name` loaded (loading it, with the default keep_alive, if it is not)."""
        manifest = self.store.read_manifest(name)
        with self._lock:
            loaded = self._loaded.get(weights_key(manifest))
            if loaded is not None:
                return loaded
        list(self.generate({"model": name, "prompt": ""}))  # the load-only request
        with self._lock:
            return self._loaded[weights_key(manifest)]

    def unload_all(self) -> list[str]:
        """Drop every loaded model that no request is using; their names."""
        with self._lock:
            idle = [key for key, loaded in self._loaded.items() if loaded.in_use == 0]
            names = [self._loaded[key].name for key in idle]
            for key in idle:
                self._drop(key)
            return names

    def unload(self, name: str) -> bool:
        """Drop a loaded model now (`exl3 stop`, keep_alive 0); False if not loaded."""
        manifest = self.store.read_manifest(name)
        with self._lock:
            return self._drop(weights_key(manifest))

    def generator_for(self, name: str) -> Any:
        """The Generator of the loaded model `name` (None if not loaded or not built
        yet): for stats, tests and benchmarks."""
        manifest = self.store.read_manifest(name)
        with self._lock:
            loaded = self._loaded.get(weights_key(manifest))
            return None if loaded is None else loaded.generator

    def close(self) -> None:
        """Stop every generator thread and drop every loaded model."""
        with self._lock:
            for key in list(self._loaded):
                self._drop(key)

    # ---- internals ------------------------------------------------------------------

    def _run(self, job: Any, cancel: threading.Event | None, sink: Any = None) -> Any:
        # Validate, resolve and start eagerly so a bad request raises at the call, not
        # at the first next(): that is where a CLI or HTTP handler expects errors.
        started = time.perf_counter_ns()
        manifest = self.store.read_manifest(job.model)
        if job.has_images:  # refused before a text-only model is loaded for nothing
            from exl3cli.runtime.images import refuse_images_unless_read

            refuse_images_unless_read(job.model, self.store.model_folder(job.model))
        keep_alive = parse_keep_alive(job.req.get("keep_alive"))
        options, ignored = merge_options(manifest.get("parameters"), job.req.get("options"))
        from exl3cli.engine.grammar.constraints import compile_format

        compile_format(job.req.get("format"))  # a bad schema fails before any loading
        cache_type = cache_type_option(options)
        load_started = time.perf_counter_ns()
        loaded = self._acquire(job.model, manifest)
        load_ns = time.perf_counter_ns() - load_started
        if job.is_load_only():
            return self._finish_load_only(job, loaded, keep_alive, started, load_ns)
        if cancel is None:
            cancel = threading.Event()  # set when the stream is closed early
        try:
            handle = self._submit(job, loaded, manifest, options, cache_type, cancel, sink)
        except BaseException:
            self._release(loaded, keep_alive)
            raise
        if sink is not None:
            from exl3cli.runtime.responses import PushedResponses, ResponseShaper

            shaper = ResponseShaper(job, handle, loaded.text_model.tokenizer, ignored,
                                    started, load_ns)
            return PushedResponses(shaper, lambda: self._release(loaded, keep_alive))
        return self._respond(job, loaded, handle, cancel, ignored, keep_alive,
                             started, load_ns)

    def _submit(self, job: Any, loaded: LoadedModel, manifest: dict[str, Any],
                options: dict[str, Any], cache_type: Any,
                cancel: threading.Event | None = None, sink: Any = None) -> Any:
        """Build the prompt (dropping old chat turns that do not fit) and the
        GenerationJob, and submit it to the model's generator."""
        from exl3cli.engine.generation.jobs import GenerationJob
        from exl3cli.engine.generation.sampling import build_sampler
        from exl3cli.engine.grammar.constraints import build_constraint
        from exl3cli.runtime.adapters import job_adapter
        from exl3cli.runtime.images import check_prompt_ids
        from exl3cli.runtime.jobs import fit_prompt

        text_model = loaded.text_model
        num_ctx = text_model.context_length(options)
        truncate = bool(options.get("truncate"))
        job.max_tokens = None if truncate else num_ctx
        prompt_ids = fit_prompt(job, text_model, manifest, num_ctx, cancel)
        if not prompt_ids:
            raise InvalidOption("the prompt is empty once rendered (check the template)")
        prompt_ids = check_prompt_ids(text_model, prompt_ids)
        if len(prompt_ids) >= num_ctx and not truncate:
            raise ContextOverflow(
                f"the prompt is {len(prompt_ids)} tokens, which does not fit the context "
                f"window of {num_ctx} tokens (raise num_ctx)")
        num_predict = int_option(options, "num_predict")
        drafter, draft_tokens = drafter_for(manifest.get("draft"), options,
                                            text_model.model.config.vocab_size, self.store)
        sampler = build_sampler(options)
        if job.top_logprobs is not None:
            # Drafts are verified outside the sampler: off while logprobs are recorded
            # (a draft only ever changes speed).
            sampler = job.recorder = LogprobRecorder(sampler, job.top_logprobs)
            drafter, draft_tokens = None, 0
        generation = GenerationJob(
            prompt_ids, sampler=sampler,
            stop=[s for s in (options.get("stop") or []) if s],
            num_predict=-1 if num_predict is None else num_predict, num_ctx=num_ctx,
            truncate=truncate, num_keep=max(0, int_option(options, "num_keep") or 0),
            constraint=build_constraint(job.req.get("format"), text_model.tokenizer),
            drafter=drafter, draft_tokens=draft_tokens, sink=sink,
        )
        with self._lock:
            generator = self._generator(loaded, num_ctx, cache_type)
            loaded.context_length = num_ctx
            generation.adapter = job_adapter(self.store, loaded, manifest, generator)
            loaded.submitting += 1  # no rebuild of this generator until it is handed over
        try:
            # Outside the runner's lock: submit waits for the generator's step (a whole
            # pass, or a CUDA graph capture), which must not hold up other models.
            return generator.submit(generation)
        finally:
            with self._lock:
                loaded.submitting -= 1
                self._changed.notify_all()

    def _generator(self, loaded: LoadedModel, num_ctx: int, cache_type: Any) -> Any:
        """The model's generator, built on first use and rebuilt for a longer context
        or another cache type once no job runs on it (requests wait until then).
        Called with the lock held."""
        from exl3cli.engine.generation.generator import Generator
        from exl3cli.engine.generation.generator_thread import GeneratorThread

        def unfit(generator: Any) -> bool:
            return (generator is None or generator.num_ctx < num_ctx
                    or generator.cache_type != cache_type)

        while True:
            current = loaded.generator
            if not unfit(current) and not loaded.rebuilds_waiting:
                return current
            busy = current is not None and (current.has_work or loaded.submitting)
            if unfit(current) and (not busy or self._loaded.get(loaded.key) is not loaded):
                break  # idle (or unloaded meanwhile): rebuild now
            waiting = unfit(current)  # a request that fits only lets a rebuild go first
            loaded.rebuilds_waiting += waiting
            try:
                if current.background:
                    self._changed.wait(timeout=0.05)  # jobs finish on its thread
                else:
                    current.step()  # help the running jobs along: nobody else may
            finally:
                loaded.rebuilds_waiting -= waiting
        loaded.stop_generator()
        text_model = loaded.text_model
        wanted = max(num_ctx, text_model.context_length({}),
                     current.num_ctx if current is not None else 0)
        loaded.generator = Generator(text_model.model, text_model.tokenizer,
                                     max_batch=self.num_parallel, num_ctx=wanted,
                                     kv_cache_type=cache_type)
        if self.background:
            loaded.generator_thread = GeneratorThread(loaded.generator).start()
        return loaded.generator

    def _respond(self, job: Any, loaded: LoadedModel, handle: Any, cancel: threading.Event,
                 ignored: list[str], keep_alive: float | None, started: int,
                 load_ns: int) -> Iterator[dict]:
        """The job's response objects (runtime/responses.py); the model is let go once
        they end or the stream is closed."""
        from exl3cli.runtime.responses import stream_responses

        try:
            yield from stream_responses(job, handle, cancel, loaded.text_model.tokenizer,
                                        ignored, started, load_ns)
        finally:
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
        key = weights_key(manifest)
        with self._lock:
            self._expire()
            loaded = self._loaded.get(key)
            if loaded is not None and getattr(loaded.text_model.model, "failure", None):
                self._drop(key)  # a tensor-parallel rank died: load it again
                loaded = None
            if loaded is None:
                loaded = self._load(key, name)
                named = str(ModelName.parse(name))
                self.loads[named] = self.loads.get(named, 0) + 1
                log.debug("loaded %s (load %d)", named, self.loads[named])
                while len(self._loaded) >= self.max_loaded:
                    victim = next((k for k, m in self._loaded.items() if m.in_use == 0), None)
                    if victim is None:
                        break
                    log.debug("evicting %s for %s", self._loaded[victim].name, name)
                    self.evictions += 1
                    self._drop(victim)
                self._loaded[key] = loaded
            self._loaded.move_to_end(key)
            loaded.name = str(ModelName.parse(name))
            loaded.digest = manifest.digest()
            loaded.in_use += 1
            return loaded

    def _load(self, key: str, name: str) -> LoadedModel:
        from exl3cli.engine.generation.textmodel import TextModel
        from exl3cli.runtime.model_info import model_details

        folder = Path(self.store.model_folder(name))
        manifest = self.store.read_manifest(name)
        parameters = manifest.get("parameters") or {}
        num_gpu = parameters.get("num_gpu")  # Modelfile PARAMETERs, else the daemon's
        width = parameters.get("tensor_parallel") or os.environ.get("EXL3_TENSOR_PARALLEL")
        split = parameters.get("gpu_split") or os.environ.get("EXL3_GPU_SPLIT") or None
        text_model = TextModel.load(folder, device=self.device,
                                    gpu_layers=None if num_gpu is None else int(num_gpu),
                                    tensor_parallel=int(width) if width else None,
                                    gpu_split=split if not width or int(width) < 2 else None)
        device = str(getattr(text_model.model, "device", "cpu"))
        details = model_details(self.store, manifest)
        return LoadedModel(key=key, name=name, text_model=text_model,
                           size=folder_size(folder), details=details,
                           on_gpu=device.startswith("cuda"),
                           placement=getattr(text_model.model, "placement", None))

    def _release(self, loaded: LoadedModel, keep_alive: float | None) -> None:
        with self._lock:
            loaded.in_use = max(0, loaded.in_use - 1)
            if keep_alive is None:
                loaded.expires_at = loaded.expires_wall = None
            else:
                loaded.expires_at = time.monotonic() + keep_alive
                loaded.expires_wall = datetime.now(timezone.utc) + timedelta(seconds=keep_alive)
            if keep_alive == 0 and loaded.in_use == 0:
                self._drop(loaded.key)
            if loaded.in_use == 0 and self._loaded.get(loaded.key) is not loaded:
                loaded.stop_generator()  # unloaded while this request still ran
            self._changed.notify_all()

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, m in self._loaded.items()
                    if m.in_use == 0 and m.expires_at is not None and m.expires_at <= now]:
            self._drop(key)

    def _drop(self, key: str) -> bool:
        loaded = self._loaded.pop(key, None)
        if loaded is None:
            return False
        loaded.stop_generator()
        close = getattr(loaded.text_model.model, "close", None)
        if close is not None:  # a tensor-parallel model: stop its other ranks
            close()
        return True
