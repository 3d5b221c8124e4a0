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

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from exl3cli.engine.generation import invariant, step_forward
from exl3cli.engine.generation.ahead_step import AheadSteps, Flight, StepReport, async_step_default
from exl3cli.engine.generation.decode_step import DecodeRunner
from exl3cli.engine.generation.draft_policy import PlainStepClock, charge_step, fit_rows
from exl3cli.engine.generation.jobs import (
    ActiveJob,
    GenerationJob,
    GeneratorEvent,
    JobHandle,
    build_job_sampler,
    special_stop_ids,
)
from exl3cli.engine.generation.speculative import prepare_drafts
from exl3cli.engine.generation.step_forward import Fed
from exl3cli.engine.generation.verify_ahead import (
    VerifyAhead,
    VerifyFlight,
    verify_ahead_default,
)
from exl3cli.engine.generation.wake import flush_all
from exl3cli.engine.kvcache.kv_quant import KVCacheType, resolve_kv_cache_type
from exl3cli.engine.kvcache.paged_cache import PAGE_SIZE, ROOT_HASH, PagePool, PageTable, pages_for
from exl3cli.engine.text.token_ids import check_token_ids
from exl3cli.engine.text.tokenizer import Tokenizer
from exl3cli.envvars import switch
from exl3cli.errors import ContextOverflow, GeneratorBusy, InvalidOption

DEFAULT_MAX_PREFILL_TOKENS = 512
# A short prompt rides beside decode rows over about this many steps (_beside_room):
# with 60 jobs decoding, 4 rows a step would take a 200-token prompt 50 steps.
BESIDE_STEPS = 4


class Generator(AheadSteps, VerifyAhead):
    """Serves GenerationJobs with continuous batching over a PagePool.

    `num_ctx` is the longest context of any job; the pool holds `num_pages` pages
    (default: enough for `max_batch` jobs at full context). Extra pages are a prefix
    cache: more of them keeps more finished prompts reusable. `draft_cost` (default on,
    EXL3_DRAFT_COST=0 turns it off) times plain and drafting steps so that drafting
    backs off where its passes cost more than the plain steps they save
    (draft_policy.py); without it drafting backs off on acceptance only.
    `batch_invariant` (default EXL3_BATCH_INVARIANT): a job's tokens do not depend on
    the jobs beside it; prompt chunks run on the fixed-shape step (invariant.py).
    `async_step` (default on, EXL3_ASYNC_STEP=0 turns it off) launches each decode step before the
    previous one's tokens are read back where nothing can depend on them (ahead_step.py).
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
        decode_mode: str | None = None,
        draft_cost: bool | None = None,
        batch_invariant: bool | None = None,
        async_step: bool | None = None,
    ):
        config = model.config
        self.batch_invariant = invariant.resolve(batch_invariant)
        refusal = invariant.model_refusal(model) if self.batch_invariant else None
        if refusal is not None:
            raise InvalidOption(refusal)
        decode_mode = invariant.decode_mode(decode_mode, model.device, self.batch_invariant)
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = invariant.max_jobs(max(1, int(max_batch)), self.batch_invariant)
        self.num_ctx = min(int(num_ctx), int(config.max_position_embeddings))
        self.cache_type = resolve_kv_cache_type(kv_cache_type)
        self.max_prefill_tokens = max(1, int(max_prefill_tokens))
        self.max_queue = max_queue
        if num_pages is None:
            num_pages = self.max_batch * pages_for(self.num_ctx, PAGE_SIZE)
        # A model split over ranks or devices makes its own pool (its share of the KV
        # heads or of the layers; tp_driver.py, models/layer_split.py).
        make_pool = getattr(model, "page_pool", None)
        self.pool = make_pool(num_pages, self.cache_type) if make_pool is not None else PagePool(
            num_pages, len(model.layers), config.num_kv_heads, config.head_dim,
            model.dtype, model.device, self.cache_type,
        )
        # Decode-only steps: fixed shapes, replayed from CUDA graphs (decode_step.py).
        self.decode = DecodeRunner(model, self.pool, self.max_batch, self.num_ctx, decode_mode)
        self.decode.warm()  # one job's first graphs, captured at load rather than mid-answer
        self.background = False  # True while a GeneratorThread runs this generator
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        self._queue: deque[JobHandle] = deque()
        self._active: list[ActiveJob] = []
        self._flight: Flight | None = None  # a decode step whose tokens are not read yet
        # A step gathered after a read-back but not launched (verify_ahead.py): the next.
        self._gathered: tuple[Fed, StepReport, int] | None = None
        # Decode steps launched before the previous one is read back (ahead_step.py);
        # `async_step` False (or EXL3_ASYNC_STEP=0): every step read back first.
        self.async_step = async_step_default() if async_step is None else bool(async_step)
        # The step after a read-back step launched before its text work (EXL3_VERIFY_AHEAD).
        self.verify_ahead = verify_ahead_default()
        # Short prompts beside decode rows on the fixed-shape step (EXL3_PROMPT_BESIDE).
        self.prompt_beside = step_forward.prompt_beside_default()
        self.beside_in_turn = step_forward.beside_in_turn_default()
        self.launched_ahead = 0  # steps launched so far before their inputs were read
        # ... of which launched once a drafting job's token in flight was read and its
        # drafter found nothing with it (ahead_step._peeks_after)
        self.launched_late = 0
        # ... launched after a read-back step, before its text work (verify_ahead.py)
        self.launched_before_text = 0
        self._landed_ns = 0
        # Plain decode steps' wall time, which drafting passes must beat (draft_policy.py),
        # and whether the next step is a plain one to time it.
        # `draft_cost` False (or EXL3_DRAFT_COST=0): drafting backs off on acceptance only.
        if draft_cost is None:
            draft_cost = switch("EXL3_DRAFT_COST", True)
        self.draft_cost = draft_cost
        self.plain_clock = PlainStepClock()
        self._time_plain = False
        self._catch_up_ns = 0  # this step's draft model catch-up time (not charged)
        self._next_id = 0
        # Called with each step's report (from the stepping thread, under the lock).
        self.step_observers: list[Callable[[StepReport], None]] = []
        self._to_wake: set[Any] = set()  # event sinks written since the last flush

    # ---- jobs -------------------------------------------------------------------------

    def submit(self, job: GenerationJob) -> JobHandle:
        """Queue a job; ContextOverflow if its prompt cannot fit, GeneratorBusy if the
        queue is full."""
        prompt = self._fit_prompt(job)
        refusal = (invariant.job_refusal(job, prompt, self.model.config.vocab_size)
                   if self.batch_invariant else None)
        if refusal is not None:  # the mode's promise does not hold for this job
            raise InvalidOption(refusal)
        if job.adapter is not None:  # an adapter the model does not hold: this job fails
            adapters = getattr(self.model, "adapters", None)
            if adapters is None or job.adapter not in adapters:
                raise InvalidOption(f"adapter {job.adapter!r} is not loaded on this model")
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
        images = getattr(self.model, "images", None)  # image ids past the vocabulary
        prompt = (images.check(job.prompt_ids) if images is not None else
                  check_token_ids(job.prompt_ids, self.model.config.vocab_size, "prompt token"))
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
            for active in self._active:
                if active.handle is handle:
                    self._retire(active, active.finish("stop", cancelled=True))
                    break
            flush_all(self._to_wake)

    @property
    def lock(self) -> threading.RLock:
        """Held by every step: hold it to change the model between steps (adapters)."""
        return self._lock

    @property
    def has_work(self) -> bool:
        return bool(self._active or self._queue)

    @property
    def prefilling(self) -> bool:
        """Whether a queued or running job still has prompt tokens to take in."""
        return bool(self._queue) or any(active.prefilling for active in self._active)

    @property
    def active_jobs(self) -> int:
        return len(self._active)

    @property
    def queued_jobs(self) -> int:
        return len(self._queue)

    # ---- the step ---------------------------------------------------------------------

    def step(self) -> StepReport:
        """Admit what fits, run one forward pass over all active jobs, emit events.

        Decode-only steps through the fixed-shape runner keep the GPU busy while the
        host works: a step's tokens are sampled on the device, and before they are read
        back the next step is launched with them (when nothing else is due: no job to
        admit, none taking a prompt, room in every job's budget); the call that reads
        a step back is the step's report."""
        with self._lock:
            try:
                return self._step()
            finally:
                flush_all(self._to_wake)  # one wake-up per consumer for the whole step

    def _step(self) -> StepReport:
        with self._lock:
            if isinstance(self._flight, VerifyFlight):
                return self._land_verify(self._flight)
            if self._flight is not None:
                return self._land(self._flight)
            fed, report, began = self._gathered_step() or self._gather_step()
            if not fed:
                return report
            report.jobs = len(fed)
            report.job_ids = [active.handle.id for active, _ in fed]
            start = time.perf_counter_ns()
            captures = self.decode.captures
            if step_forward.decode_only(self.decode, fed):
                with self._adapters_for([(active, 1) for active, _ in fed]):
                    logits = self.decode.run([(active.table, tokens[0])
                                              for active, tokens in fed])
                for active, tokens in fed:
                    active.table.commit(tokens)
                flight = self._launch([active for active, _ in fed], logits, start, report)
                if flight is not None:
                    flight.timed = self.decode.captures == captures
                    return self._land(flight)
                rows: list[Any] = list(range(len(fed)))
            else:
                with self._adapters_for([(active, len(tokens)) for active, tokens in fed]):
                    logits, rows = self._forward(fed)
            read = step_forward.sample_rows(fed, logits, rows)
            return self._finish_step(fed, logits, rows, read, start, began,
                                     self.decode.captures == captures, report)

    def _gathered_step(self) -> tuple[Fed, StepReport, int] | None:
        """The step gathered after a read-back (verify_ahead.py), less the jobs that
        ended since (a cancel); None when there is none, or none of its jobs is left."""
        gathered, self._gathered = self._gathered, None
        if gathered is None:
            return None
        alive = {id(active) for active in self._active}
        fed = [(active, tokens) for active, tokens in gathered[0] if id(active) in alive]
        return (fed, *gathered[1:]) if fed else None

    def _gather_step(self) -> tuple[Fed, StepReport, int]:
        """Admit what fits and gather a step: (fed, its report, when gathering began:
        drafting, a draft model's passes, counts too)."""
        self._admit()
        report = StepReport()
        began = time.perf_counter_ns()
        return self._gather(report), report, began

    def _gather(self, report: StepReport) -> Fed:
        """The tokens each active job feeds this step: decoders first (they are never
        held back), then prompt chunks up to max_prefill_tokens. No drafts when a plain
        step is to be timed (`_time_step`)."""
        room = self.max_prefill_tokens
        fed: Fed = []
        draft, self._time_plain = not self._time_plain, False
        self._catch_up_ns = 0
        decoding = sum(1 for a in self._active if not a.prefilling and a.pending_token is not None)
        if draft and self.draft_cost and any(a.drafter is not None for a in self._active):
            plain = self.plain_clock.plain_ns(decoding)
            draft = plain is not None  # the first pass of a batch size is judged: time one
            if draft:  # batched drafters: one draft pass for all their jobs, if it can pay
                self._catch_up_ns = prepare_drafts(
                    self._active, lambda cost, jobs: cost.decide(jobs, decoding, plain))
        elif draft:
            prepare_drafts(self._active)
        for active in self._active:
            if not active.prefilling:
                tokens = active.next_tokens(0, draft)
                if tokens:
                    fed.append((active, tokens))
                    report.decode_tokens += 1
                    report.draft_tokens += len(tokens) - 1
        beside = False
        if self.batch_invariant and self.decode.enabled:  # prompts beside decode rows
            waiting = any(active.prefilling for active in self._active)
            room = invariant.prompt_room(fed, waiting, self.decode.max_rows, room)
            report.draft_tokens = sum(len(tokens) - 1 for _, tokens in fed)
        elif fed and self.decode.enabled and self.prompt_beside:
            room, beside = self._beside_room(fed, report, room)
        for active in self._active:
            if active.prefilling and room > 0:
                if beside and step_forward.prompt_rest([active]) > step_forward.BESIDE_MAX_PROMPT:
                    break  # a long prompt after short ones: a general-path step of its own
                tokens = active.next_tokens(room)
                fed.append((active, tokens))
                room -= len(tokens)
                report.prefill_tokens += len(tokens)
        if not report.prefill_tokens:
            report.draft_tokens -= self._fit_drafts(fed)
        return fed

    def _beside_room(self, fed: Fed, report: StepReport, room: int) -> tuple[int, bool]:
        """(prompt tokens for this step, whether they ride beside) when prompts wait
        beside decoding jobs (`fed`): the rows the fixed-shape step has left (drafts
        shortened so that up to half of them are free), so the prompts ride in it
        (step_forward.prompt_beside), in chunks over a few steps when they are longer;
        (`room`, False) when the first prompt waiting is too long for that (more than
        BESIDE_MAX_PROMPT tokens, or than BESIDE_STEPS steps' rows: the general path takes
        it). Several short prompts ride one after another (`beside_in_turn`; run 66's
        queue of 16 SmolLM2 jobs: a quarter of the admissions had 3-5 prompts waiting,
        ~230-470 tokens, and took a general-path step each); with EXL3_BESIDE_IN_TURN=0
        only when they are short together."""
        waiting = [active for active in self._active if active.prefilling]
        rest = step_forward.prompt_rest(waiting if not self.beside_in_turn else waiting[:1])
        rows = self.decode.max_rows
        # at most BESIDE_STEPS steps of prompt chunks beside the decode rows (one row each)
        if not 0 < rest <= min(step_forward.BESIDE_MAX_PROMPT,
                               BESIDE_STEPS * (rows - len(fed))):
            return room, False
        if report.draft_tokens:
            fit_rows(fed, rows - min(step_forward.prompt_rest(waiting), rows // 2))
            report.draft_tokens = sum(len(tokens) - 1 for _, tokens in fed)
        free = rows - sum(len(tokens) for _, tokens in fed)
        return (min(room, free), True) if free > 0 else (room, False)

    def _fit_drafts(self, fed: Fed) -> int:
        """Drafts dropped so the pass fits one fixed-shape step (draft_policy.fit_rows)."""
        return fit_rows(fed, self.decode.max_rows) if self.decode.enabled else 0

    def _time_step(self, fed: Fed, report: StepReport,
                   took_ns: int, before: list[tuple[int, bool]]) -> None:
        """Account for a decode step's wall time (draft_policy.charge_step); steps with
        prompt chunks time nothing."""
        if not report.prefill_tokens:  # nor the draft model's own prompt (catch-up)
            self._time_plain = charge_step(self.plain_clock, fed, bool(report.draft_tokens),
                                           took_ns - self._catch_up_ns, before,
                                           queued=bool(self._queue))

    def _deliver(self, active: ActiveJob, events: list[GeneratorEvent],
                 report: StepReport) -> None:
        if events and events[-1].done:
            self._retire(active, events)
            report.finished += 1
        elif events:
            self._emit(active.handle, events)

    def _forward(self, fed: Fed) -> tuple[torch.Tensor, list[Any]]:
        """One general forward pass over the fed tokens (step_forward.forward)."""
        return step_forward.forward(self.model, self.pool, self.decode, self.batch_invariant,
                                    fed, self.prompt_beside)

    def _adapters_for(self, rows: list[tuple[ActiveJob, int]]
                      ) -> contextlib.AbstractContextManager[None]:
        """Around a forward: each row's LoRA adapter (step_forward.adapter_rows)."""
        return step_forward.adapter_rows(self.model, rows)

    def adapters_in_use(self) -> set[str]:
        """The adapters of queued and running jobs (not to be unloaded under them)."""
        with self._lock:
            jobs = [h.job for h in self._queue] + [a.handle.job for a in self._active]
            return {job.adapter for job in jobs if job.adapter is not None}

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
            adapters = getattr(self.model, "adapters", None)
            table = PageTable(self.pool, ROOT_HASH if adapters is None
                              else adapters.root_hash(job.adapter))
            if not table.admit(prompt, len(prompt) + budget):
                return  # wait for running jobs to free pages (the first job always fits)
            self._queue.popleft()
            stops = [s for s in job.stop if s]
            eos = special_stop_ids(self.tokenizer, stops)
            if not job.ignore_eos:
                eos |= set(self.tokenizer.eos_token_ids)
            # Constrained jobs decode plainly: their mask is stateful, one token at a time.
            drafter = job.drafter if job.constraint is None else None
            self._active.append(ActiveJob(
                handle=handle, table=table, prompt=prompt, sampler=build_job_sampler(job),
                budget=budget, eos_ids=eos, tokenizer=self.tokenizer, stops=stops,
                drafter=drafter, draft_tokens=job.draft_tokens,
                keep_together=images.runs(prompt) if (images := getattr(
                    self.model, "images", None)) is not None else [],
            ))

    def fail_all(self, error: BaseException) -> None:
        """End every queued and running job with `error` (re-raised by their handles)."""
        with self._lock:
            self._flight = self._gathered = None
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

    def _emit(self, handle: JobHandle, events: list[GeneratorEvent]) -> None:
        for event in events:
            if event.done:
                handle.final = event
            if handle.sink is None:
                handle.events.put(event)
        if handle.sink is not None:  # woken at the end of the step (wake.py)
            handle.sink.add(handle, events)
            self._to_wake.add(handle.sink)
