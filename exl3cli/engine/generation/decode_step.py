"""The generator's decode step with fixed shapes, replayed from CUDA graphs.

A step that only decodes (one new token for each of n jobs) runs through a
`FixedDecodeStep` (fixed_step.py): the batch is padded to a bucket of B rows and every row's page
table to P pages, and all the step reads from the host (token ids, cached lengths,
rotary offsets and positions, the slot each new key goes to, attention lengths, page
tables; worked out on the host, which knows them) sits in one device buffer filled by
a single copy, so one captured graph serves every step of that (B, P) bucket: a job
joining, leaving or growing a page changes the data in the buffer, never the graph.
Padding rows write to the pool's scratch page and attend to that one slot.

A token's rotary position is its cache position plus its row's offset: 0, except after
images that move positions (Qwen2.5-VL's M-RoPE, vision/mrope.py: a text token after
an image sits max(rows, columns) - rows * columns positions before its cache index).
The offset of a row is the model's `images.decode_offset(tokens so far)`, computed once
per page table (decode only appends text, which keeps it).

`DecodeRunner.run(rows)` feeds rows [(PageTable, token)] and returns logits [n, V]
(float32; a graph's output buffer, valid until the next run); the caller commits the
tokens to the tables. The tokens may also come as a device tensor (`ids`): the
generator then launches a step before the tokens of the one before are read back.

Verification passes (speculative decoding) run here too: `run_feeds([(table, tokens)])`
feeds a job's pending token and its k drafts as 1 + k rows of one table, row j at
position length + j attending to length + j + 1 positions. Each layer writes every
row's key/value before any row attends, so row j sees the new tokens 0..j and no later
one: the per-row lengths are the causal mask. Nothing is committed (the generator
commits what it accepts; a rejected draft's slot is written over by the next step).
Such steps may hold up to `MAX_ROWS` rows (more than `max_batch`).

Modes: "graph" (the CUDA default): capture per bucket, replay; "static": the same
fixed-shape step run eagerly (what a graph replays, checkable on any device);
"off": the generator's general paged path for every step (the CPU default, where
the fused CPU kernels of the general path are faster).
`EXL3_DECODE_MODE` overrides the default. `EXL3_STEP_ARGMAX=1` (opt-in until measured)
also computes each row's argmax inside the step (in the graph, in two passes:
batch_sampling.argmax_rows): `DecodeRunner.greedy` after a run, which the generator's
on-device sampling takes instead of launching its own argmax.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from exl3cli.engine.generation.batch_sampling import argmax_rows
from exl3cli.engine.generation.fixed_step import FixedDecodeStep
from exl3cli.engine.kvcache.paged_attention import reference_paged_attention
from exl3cli.engine.kvcache.paged_cache import PagePool, PageTable, pages_for
from exl3cli.envvars import switch
from exl3cli.errors import InvalidSetting

MODES = ("graph", "static", "off")
log = logging.getLogger(__name__)

# One capture at a time in the process: torch.cuda.graph synchronizes the device and
# empties the allocator's cache when it begins, which breaks another thread's capture in
# progress (two models served together: "operation not permitted when stream is capturing").
_CAPTURE_LOCK = threading.Lock()
# A capture that fails leaves its (B, P) bucket to eager steps; after this many failures
# the runner stops capturing ("static"), so one transient failure (memory pressure while
# another model loads) does not cost the model its graphs for the rest of its life.
MAX_CAPTURE_FAILURES = 3
MAX_ROWS = 64  # rows of a fixed-shape step that verifies drafts (jobs x (1 + k))


def recover_from_failed_capture(device: torch.device, pool: tuple[int, int] | None) -> None:
    """Undo what a capture that raised leaves behind. torch's CUDAGraph.capture_end throws
    at cudaStreamEndCapture, before its bookkeeping: the device's default random generator
    stays marked as capturing (every later CUDA random op outside a capture, sampling
    included, then fails with "Offset increment outside graph capture encountered
    unexpectedly"), and the allocator keeps the capture's pool entry (a capture-status
    query on every allocation), which this ends where torch still lists it. Even so,
    torch 2.11 refuses the next capture into that pool ("already recording", run 52's
    bench/diag/failed_capture.py): the caller takes a fresh pool handle. An empty
    capture that succeeds runs the generator's epilogue on the same state object, so
    graphs captured earlier keep sharing it."""
    if device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    if pool is not None:
        try:  # absent when the failure came before the capture began: nothing to end
            torch._C._cuda_endAllocateToPool(index, pool)
        except (AttributeError, RuntimeError, TypeError) as error:
            log.debug("no capture pool to end after a failed capture: %s", error)
    try:
        with torch.cuda.device(index):
            scratch = torch.zeros(1, device=device)
            stream = torch.cuda.Stream(device=device)
            stream.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                scratch.add_(1)
            torch.cuda.current_stream().wait_stream(stream)
            del graph
    except RuntimeError as error:  # leave the generator as it is; report why
        log.warning("could not reset CUDA state after a failed graph capture: %s", error)


def default_mode(device: torch.device) -> str:
    mode = os.environ.get("EXL3_DECODE_MODE", "").strip().lower()
    if mode:
        if mode not in MODES:
            raise InvalidSetting(f"EXL3_DECODE_MODE must be one of {MODES}, got {mode!r}")
        if mode == "graph" and device.type != "cuda":
            return "static"
        return mode
    return "graph" if device.type == "cuda" else "off"


def bucket(count: int, limit: int) -> int:
    """The smallest power of two >= count, capped at `limit` (>= count)."""
    size = 1
    while size < count:
        size *= 2
    return max(count, min(size, limit))


class DecodeRunner:
    """Fixed-shape decode steps of one model over one page pool, by (B, P) bucket."""

    def __init__(self, model: Any, pool: PagePool, max_batch: int, num_ctx: int,
                 mode: str | None = None):
        mode = mode or default_mode(pool.device)
        if mode not in MODES:
            raise ValueError(f"unknown decode mode {mode!r}; choose from {MODES}")
        if mode == "graph" and pool.device.type != "cuda":
            raise ValueError("CUDA graphs need a model on a CUDA device")
        if mode != "off" and (pool.scratch_page is None
                              or not model.prepare_decode(num_ctx + pool.page_size)):
            mode = "off"  # e.g. dynamic NTK rope: its table changes with the length
        if mode == "graph" and not getattr(model, "supports_graphs", True):
            mode = "static"  # several processes or devices per step: no one-device graph
        self.model = model
        self.pool = pool
        self.mode = mode
        self.max_batch = max_batch
        self.max_rows = max(max_batch, MAX_ROWS)  # verification passes: rows, not jobs
        self.max_pages = pages_for(num_ctx, pool.page_size)
        self.captures = 0  # graphs captured so far (a step that captured is not timed)
        self.capture_ns = 0  # time spent capturing (warm-ups included), for diagnostics
        self.capture_failures = 0
        self.step_argmax = switch("EXL3_STEP_ARGMAX", False)
        self.greedy: torch.Tensor | None = None  # the last run's argmax rows, or None
        self._steps: dict[tuple[int, int], FixedDecodeStep] = {}
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool_handle: Any = None
        self._uncaptured: set[tuple[int, int]] = set()  # buckets whose capture failed
        self._rope_version = self._version() if mode == "graph" else None
        # Each page table's rotary offset (module docstring), kept while the table lives.
        self._offsets: weakref.WeakKeyDictionary[PageTable, int] = weakref.WeakKeyDictionary()

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def graph_count(self) -> int:
        return len(self._graphs)

    def _version(self) -> tuple[int, int, int]:
        """What captured graphs depend on besides their bucket: the rotary tables and the
        model's LoRA adapters (engine/adapters/lora.py bumps `adapter_version`)."""
        local = getattr(self.model, "local_rotary", None)
        return (self.model.rotary.version, -1 if local is None else local.version,
                getattr(self.model, "adapter_version", 0))

    def fits(self, rows: Sequence[tuple[PageTable, int]]) -> bool:
        """Whether these rows can run as one fixed-shape step."""
        if not self.enabled or not 0 < len(rows) <= self.max_batch:
            return False
        size = self.pool.page_size
        return all(pages_for(table.length + 1, size) <= self.max_pages for table, _ in rows)

    def fits_feeds(self, feeds: Sequence[tuple[PageTable, Sequence[int]]]) -> bool:
        """Whether jobs feeding these tokens (a pending token, then any drafts) can run
        as one fixed-shape step of one row per token."""
        total = sum(len(tokens) for _, tokens in feeds)
        if not self.enabled or not 0 < total <= self.max_rows:
            return False
        size = self.pool.page_size
        return all(tokens and pages_for(table.length + len(tokens), size) <= self.max_pages
                   for table, tokens in feeds)

    def warm(self, keys: Sequence[tuple[int, int]] | None = None) -> int:
        """Capture the graphs of these (B, P) buckets now (default: one row over one and
        two pages, where a single chat starts), so a job's first tokens are not paid for
        with captures; padding rows only touch the scratch page. Returns the graphs held."""
        if self.mode != "graph":
            return 0
        adapters = getattr(self.model, "adapters", None)
        if adapters is not None and adapters.names:
            return 0  # graphs read the rows' adapter choice: captured with a job's selection
        if keys is None:
            keys = sorted({(1, 1), (1, min(2, self.max_pages))})
        for key in keys:
            if self.mode != "graph":
                break  # a capture failed: decoding goes on without graphs
            if key in self._graphs or not (0 < key[0] <= self.max_rows
                                           and 0 < key[1] <= self.max_pages):
                continue
            step = self._steps.get(key)
            if step is None:
                step = self._steps[key] = FixedDecodeStep(self.pool, *key)
            step.load_padding()
            self._capture(key, step)
        return len(self._graphs)

    def run(self, rows: Sequence[tuple[PageTable, int | None]],
            ids: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step for `rows` [(table, token)]: logits [n, V] (float32). Each
        row's token goes to position table.length; the caller commits it to the table
        once it is known on the host (with `ids`, a device tensor of the tokens, the
        step can run before that)."""
        return self._run(rows, ids, None)

    def run_feeds(self, feeds: Sequence[tuple[PageTable, Sequence[int]]]) -> torch.Tensor:
        """One step where job i feeds `tokens_i` (its pending token, then drafts): one
        row per token, in order (module docstring); logits [sum of counts, V]. Nothing
        is committed: the caller commits what it keeps."""
        rows: list[tuple[PageTable, int | None]] = []
        ahead: list[int] = []
        for table, tokens in feeds:
            rows.extend((table, int(token)) for token in tokens)
            ahead.extend(range(len(tokens)))
        return self._run(rows, None, ahead)

    def _run(self, rows: Sequence[tuple[PageTable, int | None]], ids: torch.Tensor | None,
             ahead: Sequence[int] | None) -> torch.Tensor:
        size = self.pool.page_size
        steps = ahead if ahead is not None else [0] * len(rows)
        needed = max(pages_for(table.length + 1 + j, size)
                     for (table, _), j in zip(rows, steps, strict=True))
        limit = self.max_batch if len(rows) <= self.max_batch else self.max_rows
        key = (bucket(len(rows), limit), bucket(needed, self.max_pages))
        step = self._steps.get(key)
        if step is None:
            step = self._steps[key] = FixedDecodeStep(self.pool, *key)
        step.load(rows, ids, self._row_offsets(rows), ahead)
        if self.mode == "graph":
            logits = self._replay(key, step)
        else:
            logits = self._forward(step)
        self.greedy = step.greedy[: len(rows)] if step.greedy is not None else None
        return logits[: len(rows)]

    def _row_offsets(self, rows: Sequence[tuple[PageTable, int | None]]) -> list[int] | None:
        """Each row's rotary offset; None when the model's positions are its cache's."""
        images = getattr(self.model, "images", None)
        if images is None or images.cache_positions:
            return None
        out = []
        for table, _ in rows:
            offset = self._offsets.get(table)
            if offset is None:
                offset = self._offsets[table] = images.decode_offset(table.tokens[: table.length])
            out.append(offset)
        return out

    def _forward(self, step: FixedDecodeStep) -> torch.Tensor:
        logits = self.model.forward(step.ids[None, :], step, last_logits_only=True)[0]
        step.greedy = argmax_rows(logits) if self.step_argmax else None
        return logits

    def _replay(self, key: tuple[int, int], step: FixedDecodeStep) -> torch.Tensor:
        version = self._version()
        if version != self._rope_version:  # tables rebuilt: captured pointers are stale
            self._graphs.clear()
            self._uncaptured.clear()
            self._pool_handle = None
            self._rope_version = version
        graph = self._graphs.get(key)
        if graph is None:
            if key in self._uncaptured:
                return self._forward(step)
            graph = self._capture(key, step)
            if graph is None:
                return self._forward(step)
        graph[0].replay()
        return graph[1]

    def _capture(self, key: tuple[int, int], step: FixedDecodeStep
                 ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """Warm up on a side stream (kernels built, workspaces sized), then capture.
        The warm-up runs the real step: its cache writes are the ones the replay makes
        again, so running it twice changes nothing."""
        began = time.perf_counter_ns()
        try:
            with _CAPTURE_LOCK:
                graph, logits = self._capture_alone(step)
        except Exception as error:  # a capture can fail in many ways: keep generating
            with _CAPTURE_LOCK:
                recover_from_failed_capture(self.pool.device, self._pool_handle)
            # The failed capture's pool may still be marked as recording ("beginAllocateToPool:
            # already recording to mempool_id" at the next capture into it): a fresh one.
            self._pool_handle = None
            self.capture_failures += 1
            self.capture_ns += time.perf_counter_ns() - began
            last = self.capture_failures >= MAX_CAPTURE_FAILURES
            print(f"exl3: CUDA graph capture failed ({type(error).__name__}: {error}); "
                  + ("decoding without graphs" if last else
                     f"steps of {key[0]} rows over {key[1]} pages run without a graph"),
                  file=sys.stderr)
            self._capture_failed(key)
            return None
        self._graphs[key] = (graph, logits)
        self.captures += 1
        took = time.perf_counter_ns() - began
        self.capture_ns += took
        log.debug("captured decode graph %s in %.1f ms on %s (%d held)", key, took / 1e6,
                  threading.current_thread().name, len(self._graphs))
        return self._graphs[key]

    def _capture_failed(self, key: tuple[int, int]) -> None:
        """The bucket's steps run eagerly from now on; enough failures end capturing."""
        self._uncaptured.add(key)
        if self.capture_failures >= MAX_CAPTURE_FAILURES:
            self.mode = "static"

    def _capture_alone(self, step: FixedDecodeStep) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm-up and capture, on a stream of this capture's own (not torch.cuda.graph's
        one class-wide default stream). The caller holds _CAPTURE_LOCK."""
        prior = torch.cuda.current_stream(self.pool.device)
        try:
            return self._capture_on_side_stream(step)
        except BaseException:
            # torch.cuda.graph leaves its stream current when capture_end raises.
            torch.cuda.set_stream(prior)
            raise

    def _capture_on_side_stream(self, step: FixedDecodeStep
                                ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        stream = torch.cuda.Stream(device=self.pool.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(step)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool_handle is None:
            self._pool_handle = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool_handle, stream=stream,
                              capture_error_mode="thread_local"):
            logits = self._forward(step)
        return graph, logits


__all__ = ["MAX_CAPTURE_FAILURES", "MAX_ROWS", "MODES", "DecodeRunner", "FixedDecodeStep",
           "bucket", "default_mode", "recover_from_failed_capture", "reference_paged_attention"]
