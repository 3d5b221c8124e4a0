"""Decode steps replayed from CUDA graphs, so a small model is not bound by Python and
kernel-launch time.

A decode step (one token per row) of `CausalLM.decode_step` has fixed shapes once the
attention span is fixed: positions come from `cache.lengths` on the device and keys
are scattered there, so one captured graph serves every length within a span bucket
(spans are rounded up to `bucket` positions; keys past a row's length are masked).
Graphs are tied to the buffers they were captured with, so the runner owns a cache
that it hands out again (reset) to the next caller with the same shape.

Modes: "graph" (CUDA default), "static" (the same fixed-shape step run eagerly: what
the graph replays, for checking it on any device), "eager" (plain `model.forward`:
the CPU default, exactly the path used without this module).

Public API:
- ``DecodeGraphRunner(model, bucket=256, mode=None)``: ``cache(batch, max_seq_len)``,
  ``step(tokens, cache) -> logits [B, V]`` (float32; a graph's output buffer, valid
  until the next step), ``graph_count``, ``mode``.
- ``runner_for(model) -> DecodeGraphRunner | None``: the shared runner of a CUDA
  CausalLM (None on CPU or for other models).
- ``open_session(model, batch, max_seq_len) -> DecodeSession | None``: a checked-out
  cache plus ``step(tokens)``; None when graphs do not apply or the runner is busy.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

import torch

from exl3cli.engine.cache import KVCache

DEFAULT_BUCKET = 256
MODES = ("graph", "static", "eager")


class DecodeGraphRunner:
    """Decode steps of one model with one owned cache; see the module docstring."""

    def __init__(self, model: Any, bucket: int = DEFAULT_BUCKET, mode: str | None = None):
        if bucket < 1:
            raise ValueError("bucket must be at least 1")
        device = torch.device(model.device)
        mode = mode or ("graph" if device.type == "cuda" else "eager")
        if mode not in MODES:
            raise ValueError(f"unknown decode mode {mode!r}; choose from {MODES}")
        if mode == "graph" and device.type != "cuda":
            raise ValueError("CUDA graphs need a model on a CUDA device")
        self.model = model
        self.bucket = int(bucket)
        self.mode = mode
        self.lock = threading.Lock()
        self._cache: KVCache | None = None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._ids: torch.Tensor | None = None
        self._pool: Any = None
        self._rope_version = -1
        self._prepared: dict[int, bool] = {}  # max_seq_len -> model.prepare_decode result

    @property
    def graph_count(self) -> int:
        return len(self._graphs)

    def cache(self, batch_size: int, max_seq_len: int) -> KVCache:
        """An empty cache of this shape: the owned one (reset) when the shape matches,
        so its captured graphs stay valid; else a new one (graphs dropped)."""
        cache = self._cache
        if cache is None or cache.batch_size != batch_size or cache.max_seq_len != max_seq_len:
            self._drop_graphs()
            self._cache = None  # free the old buffers before allocating new ones
            cache = self.model.new_cache(batch_size, max_seq_len)
            self._cache = cache
            self._ids = torch.zeros(batch_size, 1, dtype=torch.long, device=self.model.device)
        else:
            cache.reset()
        return cache

    def step(self, tokens: torch.Tensor | list[int], cache: KVCache) -> torch.Tensor:
        """Feed one token per row; logits [B, V] (float32) of the next position."""
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1, 1)
        if ids.shape[0] != cache.batch_size:
            raise ValueError(f"{ids.shape[0]} tokens for a cache of {cache.batch_size} rows")
        if self.mode == "eager" or not self._fixed_shape_ok(cache):
            return self.model.forward(ids.to(self.model.device), cache,
                                      last_logits_only=True)[:, -1]
        span = self._span(cache)
        if self.mode == "static":
            logits = self.model.decode_step(ids.to(self.model.device), cache, span)
            cache.mark_advanced([1] * cache.batch_size)
            return logits
        version = self.model.rotary.version
        if version != self._rope_version:  # tables rebuilt: captured pointers are stale
            self._drop_graphs()
            self._rope_version = version
        graph = self._graphs.get(span)
        if graph is None:
            graph = self._capture(cache, span)
            if graph is None:  # capture failed: stay correct, run eagerly from now on
                self.mode = "static"
                return self.step(ids, cache)
        self._ids.copy_(ids, non_blocking=True)
        graph[0].replay()
        cache.mark_advanced([1] * cache.batch_size)
        return graph[1]

    def _drop_graphs(self) -> None:
        """Forget every graph and their memory pool. The pool handle must go too: once
        its last graph is gone the allocator keeps the pool with a use count of 0 (until
        its blocks are freed), and capturing into it again trips its internal assert
        (`use_count > 0`), which is how the first H200 run lost its graphs."""
        self._graphs.clear()
        self._pool = None

    def _fixed_shape_ok(self, cache: Any) -> bool:
        if not isinstance(cache, KVCache) or cache.batch_size == 0:
            return False
        if self.mode == "graph" and cache is not self._cache:
            return False  # graphs are captured for the owned cache's buffers only
        if max(cache.row_lengths()) + 1 > cache.max_seq_len:
            return False  # the eager path raises ContextOverflow
        if cache.max_seq_len not in self._prepared:
            self._prepared[cache.max_seq_len] = self.model.prepare_decode(cache.max_seq_len)
        return self._prepared[cache.max_seq_len]

    def _span(self, cache: KVCache) -> int:
        needed = max(cache.row_lengths()) + 1
        return min(cache.max_seq_len, -(-needed // self.bucket) * self.bucket)

    def _capture(self, cache: KVCache, span: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """Warm up (kernels built, cuBLAS handles made) on a side stream, then capture;
        the cache's lengths are restored (warm-up writes past them are never read)."""
        saved = cache.lengths.clone()
        try:
            stream = torch.cuda.Stream(device=cache.lengths.device)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.model.decode_step(self._ids, cache, span)
                    cache.lengths.copy_(saved)
            torch.cuda.current_stream().wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits = self.model.decode_step(self._ids, cache, span)
            cache.lengths.copy_(saved)  # capture does not run the step; be sure anyway
        except Exception as error:  # a capture can fail in many ways: keep generating
            cache.lengths.copy_(saved)
            print(f"exl3: CUDA graph capture failed ({type(error).__name__}: {error}); "
                  "decoding without graphs", file=sys.stderr)
            return None
        self._graphs[span] = (graph, logits)
        return self._graphs[span]


_runners: weakref.WeakKeyDictionary[Any, DecodeGraphRunner] = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


def runner_for(model: Any) -> DecodeGraphRunner | None:
    """The shared graph runner of a CausalLM on a CUDA device, else None."""
    device = getattr(model, "device", None)
    if not hasattr(model, "decode_step") or device is None or torch.device(device).type != "cuda":
        return None
    with _registry_lock:
        runner = _runners.get(model)
        if runner is None:
            runner = _runners[model] = DecodeGraphRunner(model)
        return runner


class DecodeSession:
    """A runner's cache checked out by one generation; `close()` hands it back."""

    def __init__(self, runner: DecodeGraphRunner, cache: KVCache):
        self.runner = runner
        self.cache = cache
        self._open = True

    def step(self, tokens: torch.Tensor | list[int]) -> torch.Tensor:
        """Logits [B, V] after feeding one token per row (valid until the next step)."""
        return self.runner.step(tokens, self.cache)

    def close(self) -> None:
        if self._open:
            self._open = False
            self.runner.lock.release()


def open_session(model: Any, batch_size: int, max_seq_len: int) -> DecodeSession | None:
    """The shared runner's cache for one generation, or None (CPU, non-CausalLM, or
    the runner is in use by another generation: the caller then decodes eagerly)."""
    runner = runner_for(model)
    if runner is None or not runner.lock.acquire(blocking=False):
        return None
    try:
        cache = runner.cache(batch_size, max_seq_len)
    except BaseException:
        runner.lock.release()
        raise
    return DecodeSession(runner, cache)
