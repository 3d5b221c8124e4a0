"""Continuous batching over the paged KV cache: one model, many concurrent jobs.

Each `step()` runs ONE forward pass over the decode token of every running job plus
prompt chunks of jobs still ingesting their prompt (at most `max_prefill_tokens` per
step, so decoding jobs keep flowing while a long prompt comes in). Jobs join at any
step (from a bounded queue, when a batch slot and their pages are free) and leave at
any step; `cancel` frees a job's pages at once. Prompts reuse the full pages of
earlier or running jobs with the same prefix (paged_cache.PageTable.admit).

Drive it with `step()` / `run_until_done()`, by iterating job handles (which step the
generator themselves), or from a `GeneratorThread`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from exl3cli.engine.generator_jobs import (
    ActiveJob,
    GenerationJob,
    GeneratorEvent,
    JobHandle,
    build_job_sampler,
    special_stop_ids,
)
from exl3cli.engine.kv_quant import KVCacheType, resolve_kv_cache_type
from exl3cli.engine.paged_attention import PagedBatch
from exl3cli.engine.paged_cache import PAGE_SIZE, PagePool, PageTable, pages_for
from exl3cli.engine.speculative import VerifyingBatch
from exl3cli.engine.token_ids import check_token_ids
from exl3cli.engine.tokenizer import Tokenizer
from exl3cli.errors import ContextOverflow, GeneratorBusy

DEFAULT_MAX_PREFILL_TOKENS = 512


@dataclass
class StepReport:
    """What one step did (for schedulers, tests and benchmarks)."""

    decode_tokens: int = 0  # decoding jobs fed (one pending token each)
    draft_tokens: int = 0  # draft tokens fed after them for verification
    prefill_tokens: int = 0
    jobs: int = 0
    finished: int = 0
    job_ids: list[int] = field(default_factory=list)  # the jobs fed in this pass


class Generator:
    """Serves GenerationJobs with continuous batching over a PagePool.

    `num_ctx` is the longest context of any job; the pool holds `num_pages` pages
    (default: enough for `max_batch` jobs at full context). Extra pages are a prefix
    cache: more of them keeps more finished prompts reusable.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Tokenizer,
        *,
        max_batch: int = 16,
        num_ctx: int = 4096,
        kv_cache_type: str | KVCacheType | None = None,
        num_pages: int | None = None,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        max_queue: int = 256,
    ):
        config = model.config
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max(1, int(max_batch))
        self.num_ctx = min(int(num_ctx), int(config.max_position_embeddings))
        self.cache_type = resolve_kv_cache_type(kv_cache_type)
        self.max_prefill_tokens = max(1, int(max_prefill_tokens))
        self.max_queue = max_queue
        if num_pages is None:
            num_pages = self.max_batch * pages_for(self.num_ctx, PAGE_SIZE)
        self.pool = PagePool(
            num_pages, len(model.layers), config.num_kv_heads, config.head_dim,
            model.dtype, model.device, self.cache_type,
        )
        self.background = False  # True while a GeneratorThread runs this generator
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        self._queue: deque[JobHandle] = deque()
        self._active: list[ActiveJob] = []
        self._next_id = 0
        # Called with each step's report (from the stepping thread, under the lock).
        self.step_observers: list[Callable[[StepReport], None]] = []

    # ---- jobs -------------------------------------------------------------------------

    def submit(self, job: GenerationJob) -> JobHandle:
        """Queue a job; ContextOverflow if its prompt cannot fit, GeneratorBusy if the
        queue is full."""
        prompt = self._fit_prompt(job)
        with self._lock:
            if len(self._queue) >= self.max_queue:
                raise GeneratorBusy(f"the generator queue is full ({self.max_queue} jobs)")
            handle = JobHandle(self, job, self._next_id, prompt)
            self._next_id += 1
            self._queue.append(handle)
            self._work.notify_all()
            return handle

    def _context_of(self, job: GenerationJob) -> int:
        # A pool smaller than one full context caps every job's context too.
        capacity = self.pool.num_pages * self.pool.page_size
        return min(self.num_ctx, job.num_ctx or self.num_ctx, capacity)

    def _budget(self, job: GenerationJob, prompt: list[int]) -> int:
        room = self._context_of(job) - len(prompt)
        return room if job.num_predict < 0 else min(job.num_predict, room)

    def _fit_prompt(self, job: GenerationJob) -> list[int]:
        # Ids past the vocabulary would fail the shared batch: refuse them here, alone.
        prompt = check_token_ids(job.prompt_ids, self.model.config.vocab_size, "prompt token")
        if not prompt:
            raise ValueError("a generation job needs at least one prompt token")
        context = self._context_of(job)
        if len(prompt) < context:
            return prompt
        if not job.truncate:
            raise ContextOverflow(
                f"the prompt is {len(prompt)} tokens, which does not fit the context "
                f"window of {context} tokens (raise num_ctx, or ask for truncate)")
        keep = max(0, min(job.num_keep, context // 2 - 1))
        return prompt[:keep] + prompt[len(prompt) - (context // 2 - keep):]

    def cancel(self, handle: JobHandle) -> None:
        """Stop a job now: its pages go back to the pool, its last event says cancelled."""
        with self._lock:
            if handle.done:
                return
            if handle in self._queue:
                self._queue.remove(handle)
                self._emit(handle, [GeneratorEvent(done=True, done_reason="stop",
                                                   cancelled=True)])
                return
            for active in self._active:
                if active.handle is handle:
                    self._retire(active, active.finish("stop", cancelled=True))
                    return

    @property
    def has_work(self) -> bool:
        return bool(self._active or self._queue)

    @property
    def active_jobs(self) -> int:
        return len(self._active)

    @property
    def queued_jobs(self) -> int:
        return len(self._queue)

    # ---- the step ---------------------------------------------------------------------

    def step(self) -> StepReport:
        """Admit what fits, run one forward pass over all active jobs, emit events."""
        with self._lock:
            self._admit()
            report = StepReport()
            room = self.max_prefill_tokens
            fed: list[tuple[ActiveJob, list[int]]] = []
            for active in self._active:  # decoders first: they are never held back
                if not active.prefilling:
                    tokens = active.next_tokens(0)
                    if tokens:
                        fed.append((active, tokens))
                        report.decode_tokens += 1
                        report.draft_tokens += len(tokens) - 1
            for active in self._active:
                if active.prefilling and room > 0:
                    tokens = active.next_tokens(room)
                    fed.append((active, tokens))
                    room -= len(tokens)
                    report.prefill_tokens += len(tokens)
            if not fed:
                return report
            report.jobs = len(fed)
            report.job_ids = [active.handle.id for active, _ in fed]
            start = time.perf_counter_ns()
            tables, token_lists = [a.table for a, _ in fed], [t for _, t in fed]
            verifying = [active.verifying for active, _ in fed]
            if any(verifying):
                batch = VerifyingBatch(self.pool, tables, token_lists, verifying)
                rows: list[Any] = [r if v else r.start
                                   for r, v in zip(batch.output_rows, verifying, strict=True)]
            else:
                batch = PagedBatch(self.pool, tables, token_lists)
                rows = list(range(len(fed)))
            input_ids = torch.tensor([[t for tokens in token_lists for t in tokens]],
                                     dtype=torch.long, device=self.model.device)
            logits = self.model.forward(input_ids, batch, last_logits_only=True)[0]
            elapsed = time.perf_counter_ns() - start
            for row, (active, tokens) in zip(rows, fed, strict=True):
                events = active.after_forward(tokens, logits[row], elapsed)
                if events and events[-1].done:
                    self._retire(active, events)
                    report.finished += 1
                elif events:
                    self._emit(active.handle, events)
            for observer in self.step_observers:
                observer(report)
            return report

    def run_until_done(self) -> None:
        """Step until every submitted job has finished."""
        while self.has_work:
            self.step()

    def _admit(self) -> None:
        while self._queue and len(self._active) < self.max_batch:
            handle = self._queue[0]
            job = handle.job
            prompt = handle.prompt
            budget = self._budget(job, prompt)
            table = PageTable(self.pool)
            if not table.admit(prompt, len(prompt) + budget):
                return  # wait for running jobs to free pages (the first job always fits)
            self._queue.popleft()
            stops = [s for s in job.stop if s]
            eos = set(self.tokenizer.eos_token_ids) | special_stop_ids(self.tokenizer, stops)
            # Constrained jobs decode plainly: their mask is stateful, one token at a time.
            drafter = job.drafter if job.constraint is None else None
            self._active.append(ActiveJob(
                handle=handle, table=table, prompt=prompt, sampler=build_job_sampler(job),
                budget=budget, eos_ids=eos, tokenizer=self.tokenizer, stops=stops,
                drafter=drafter, draft_tokens=job.draft_tokens,
            ))

    def fail_all(self, error: BaseException) -> None:
        """End every queued and running job with `error` (re-raised by their handles)."""
        with self._lock:
            for handle in list(self._queue):
                handle.error = error
            for active in self._active:
                active.handle.error = error
            for handle in list(self._queue) + [a.handle for a in self._active]:
                self.cancel(handle)

    def _retire(self, active: ActiveJob, events: list[GeneratorEvent]) -> None:
        active.table.free()
        release = getattr(active.drafter, "release", None)
        if release is not None:  # a draft model's cache for this job
            release()
        self._active.remove(active)
        self._emit(active.handle, events)

    @staticmethod
    def _emit(handle: JobHandle, events: list[GeneratorEvent]) -> None:
        for event in events:
            if event.done:
                handle.final = event
            handle.events.put(event)


class GeneratorThread:
    """Runs a Generator's steps on a daemon thread while it has work.

    Use as a context manager, or start()/stop(). While it runs, handles block on their
    event queues instead of stepping the generator themselves.
    """

    def __init__(self, generator: Generator):
        self.generator = generator
        self._stop = False
        self._thread: threading.Thread | None = None

    def start(self) -> GeneratorThread:
        self.generator.background = True
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="exl3-generator", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self.generator._work:
            self._stop = True
            self.generator._work.notify_all()
        if self._thread is not None:
            self._thread.join()
        self.generator.background = False

    def _run(self) -> None:
        generator = self.generator
        while True:
            with generator._work:
                while not self._stop and not generator.has_work:
                    generator._work.wait()
                if self._stop:
                    return
            try:
                generator.step()
            except Exception as error:  # a failed step must not leave consumers waiting
                generator.fail_all(error)

    def __enter__(self) -> GeneratorThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
