"""Rank 0 of a tensor-parallel model: what the generator drives as if it were one model.

``TensorParallelModel`` wraps rank 0's shard (models/tp_shard.py). Each forward sends
the other ranks the step's plan (tp_worker.py: input shape, the step's pages, lengths
and selected rows), broadcasts the input ids (and a fixed-shape step's buffer), then
runs rank 0's shard, whose all-reduces and final all-gather meet the other ranks'.
The logits come out whole on rank 0, where the generator samples them as always
(continuous batching, samplers, constraints and drafts untouched).

The page pool is made by the model (``page_pool``, which the generator asks for): rank
0's slice of the KV heads, and on every other rank a pool with the same pages. Pools
the generator lets go are dropped on the ranks with the next message.

A rank that dies (tp_launch.RankWatch) or a collective that fails stops the model:
every later call raises ``RankFailure`` with the reason, which the generator hands to
its jobs; the daemon drops the model and loads it again on the next request.

Public API: ``TensorParallelModel(local, group, watch=None)``: ``forward``,
``hidden_states``, ``prepare_decode``, ``page_pool``, ``close()``, ``failure``, and the
attributes the generator and runtime read (``config``: the whole model's, ``layers``,
``device``, ``dtype``, ``rotary``, ``images`` None, ``tensor_parallel``).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

import torch

from exl3cli.engine.generation.tp_group import TensorParallelGroup
from exl3cli.engine.kvcache.kv_quant import KVCacheType
from exl3cli.engine.kvcache.paged_cache import PagePool
from exl3cli.errors import RankFailure


class TensorParallelModel:
    """Rank 0's side of a tensor-parallel model (module docstring)."""

    supports_graphs = False  # a step spans processes: fixed-shape steps run eagerly
    images = None  # image-text models are refused (tp_shard.check_parallel_support)

    def __init__(self, local: Any, group: TensorParallelGroup, watch: Any = None):
        self.local = local
        self.group = group
        self.watch = watch
        self.config = local.full_config
        self.layers = local.layers
        self.rotary = local.rotary
        self.local_rotary = local.local_rotary
        self.tensor_parallel = group.world
        self.placement = None
        self._lock = threading.RLock()
        self._keys = itertools.count()
        self._pool_keys: weakref.WeakKeyDictionary[PagePool, int] = weakref.WeakKeyDictionary()
        self._dropped: list[int] = []
        self._failure: str | None = None
        self._closed = False

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def failure(self) -> str | None:
        """Why the model stopped (a rank died, a collective failed), else None."""
        if self._failure is None and self.watch is not None:
            self._failure = self.watch.failure
        return self._failure

    def fail(self, reason: str) -> None:
        """Stop the model: every later call raises RankFailure(reason)."""
        if self._failure is None:
            self._failure = reason
        self.group.abort()

    def _check(self) -> None:
        if self.failure is not None:
            raise RankFailure(f"tensor-parallel model stopped: {self.failure}")
        if self._closed:
            raise RankFailure("tensor-parallel model was closed")

    def _send(self, message: dict[str, Any]) -> None:
        if self._dropped:
            message["drop"], self._dropped = self._dropped, []
        self.group.send(message)

    def _guarded(self, run: Any) -> Any:
        """Run one operation; a failure of the group stops the model with its reason."""
        with self._lock:
            self._check()
            try:
                return run()
            except RankFailure:
                raise
            except Exception as error:
                reason = self.failure or f"a collective failed ({type(error).__name__}: {error})"
                self.fail(reason)
                raise RankFailure(f"tensor-parallel model stopped: {reason}") from error

    # ---- what the generator calls ------------------------------------------------------

    def page_pool(self, num_pages: int, cache_type: KVCacheType) -> PagePool:
        """Rank 0's pool (its KV heads); every other rank makes the same pages."""
        config = self.local.config

        def run() -> PagePool:
            pool = PagePool(num_pages, len(self.layers), config.num_kv_heads, config.head_dim,
                            self.dtype, self.device, cache_type)
            key = next(self._keys)
            self._send({"op": "pool", "key": key, "num_pages": num_pages,
                        "cache_type": cache_type})
            self._pool_keys[pool] = key
            weakref.finalize(pool, self._dropped.append, key)
            return pool

        return self._guarded(run)

    def prepare_decode(self, max_seq_len: int) -> bool:
        return self.local.prepare_decode(max_seq_len)

    def forward(self, input_ids: torch.Tensor, cache: Any = None, *,
                last_logits_only: bool = False) -> torch.Tensor:
        def run() -> torch.Tensor:
            ids = input_ids.to(self.device, torch.long).contiguous()
            message: dict[str, Any] = {"op": "forward", "shape": tuple(ids.shape),
                                       "last": last_logits_only, "cache": None, "pool": None}
            if cache is not None:
                describe = getattr(cache, "describe", None)
                key = self._pool_keys.get(getattr(cache, "pool", None))
                if describe is None or key is None:
                    raise RankFailure("a tensor-parallel step needs a cache over the pool "
                                      "the model made (page_pool)")
                message["cache"], message["pool"] = describe(), key
            self._send(message)
            self.group.broadcast(ids)
            if message["cache"] is not None and message["cache"]["kind"] == "fixed":
                self.group.broadcast(cache.buffer)
            return self.local.forward(ids, cache, last_logits_only=last_logits_only)

        return self._guarded(run)

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        def run() -> torch.Tensor:
            ids = input_ids.to(self.device, torch.long).contiguous()
            self._send({"op": "hidden", "shape": tuple(ids.shape)})
            self.group.broadcast(ids)
            return self.local.hidden_states(ids)

        return self._guarded(run)

    __call__ = forward

    def close(self) -> None:
        """Stop the other ranks and wait for them (killed if they do not go)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.watch is not None:
                self.watch.expect_exit()
            if self.failure is None:
                try:
                    self._send({"op": "stop"})
                except Exception:  # noqa: BLE001 - a rank already gone
                    pass
        if self.watch is not None:
            self.watch.stop()
