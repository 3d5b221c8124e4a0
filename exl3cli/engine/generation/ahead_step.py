"""Decode steps launched before the previous step's tokens are read back (the
generator's pipelined decode).

A decode-only step on the fixed-shape runner (decode_step.py) samples its tokens on the
device (batch_sampling.sample_on_device) and starts copying them to pinned host memory:
a `Flight`. Landing it (`AheadSteps._land`) first launches the step after it, fed with
those device tokens (`DecodeRunner.run(rows, ids)`: the token goes straight from the
sampler's output into the next step's static input buffer), and only then waits for the
flight's own tokens. The host's work on step N's tokens (stop strings, EOS, budgets,
detokenizing, events) then runs while the GPU runs step N+1, and step N+2 is queued
before N+1 ends: the GPU does not wait for the host between decode steps.

Exact semantics: a step is launched ahead only when its outcome cannot depend on what
the host has not read yet (`_ahead_jobs`): the same jobs as the step in flight (every
active one), nobody queued who could join, no prompt to take in, no drafts (a drafting
job only while its drafting is backed off, or while its drafter's `peek` finds
nothing: `_peeks_dry`; when it finds something, the step waits for the token in
flight and asks again with it, `_peeks_after`, and still launches at once if that
finds nothing), no constraint, no host-side sampler
(penalties, seeds, plugins: batch_sampling.batchable). A job whose budget ends with
the token in flight is not in the next step (as without launching ahead); when a queued
job would take the slot it frees, that step is synchronous instead. A job that stops on the token read back (EOS, a stop string, a cancel) is retired at once;
the step already launched for it wrote that one token's key/value into its last,
uncommitted cache slot (pages freed with the job: never registered as a reusable
prefix) and its sampled token is dropped. Everything else takes the synchronous step,
whose successor verify_ahead.py may still launch before the host's text work on it
(and a landing that launches nothing hands its tokens there too: `_take_before_text`).
The launch path makes no synchronising call (batch_sampling.sample_on_device).

`EXL3_ASYNC_STEP=0` (or `Generator(async_step=False)`) never launches ahead: each decode
step is read back before the next one starts (the A/B baseline of
bench/gpu_generator.sh's "async" stage). Greedy and seeded jobs get the same tokens
either way. What differs is where a step falls: a job submitted while a step is in
flight joins one step later, and a job that stops leaves its row in the step already
launched, so the other jobs' rows may run on another path or bucket that step (the
same tokens up to float rounding), and unseeded sampling draws over one more row.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from exl3cli.engine.generation.batch_sampling import sample_on_device, to_device
from exl3cli.envvars import switch

if TYPE_CHECKING:
    from collections.abc import Callable

    from exl3cli.engine.generation.decode_step import DecodeRunner
    from exl3cli.engine.generation.draft_policy import PlainStepClock
    from exl3cli.engine.generation.jobs import ActiveJob, GeneratorEvent, JobHandle

ASYNC_ENV = "EXL3_ASYNC_STEP"


@dataclass
class StepReport:
    """What one step did (for schedulers, tests and benchmarks)."""

    decode_tokens: int = 0  # decoding jobs fed (one pending token each)
    draft_tokens: int = 0  # draft tokens fed after them for verification
    prefill_tokens: int = 0
    jobs: int = 0
    finished: int = 0
    job_ids: list[int] = field(default_factory=list)  # the jobs fed in this pass


def async_step_default() -> bool:
    """EXL3_ASYNC_STEP: "1" (the default) launches decode steps ahead, "0" does not."""
    return switch(ASYNC_ENV, True)


def _peeks_dry(job: ActiveJob) -> bool:
    """Whether a drafting job's drafter (one with `peek(history, count)`: a cheap guess
    at what `propose` would say, without side effects; the `ngram` drafter has it) finds
    nothing on the text known now. Its lookup at the step to launch then happens one
    step late, on this text: when that finds a draft, the step after drafts on the whole
    text; when not, the lookup at the token in flight is skipped. So on text that does
    not repeat the job runs ahead like plain decoding (run 56: a synchronous step per
    lookup made n-gram drafting 0.95x at 16 jobs on free text), and a repetition is
    found a token or two late."""
    count = job.draft_room(ahead=1)  # the step to launch is the one after the flight's
    return count <= 0 or not job.drafter.peek(job.history, count)


def _peeks_after(job: ActiveJob, token: int) -> bool:
    """Whether `job`'s drafter, whose peek on the known text found something, still
    finds a draft once the token in flight (`token`, just read back) is added: what the
    synchronous step's `propose` would see. When not (free text: a repeated pair of
    tokens that the token in flight does not continue; 6 of run 58's 59 passes at 16
    jobs), the next step is launched right away without drafts, as it would have run."""
    if token in job.eos_ids:
        return False  # the job ends with it: no next step to draft for
    return bool(job.drafter.peek([*job.history, token], job.draft_room(ahead=1)))


class Flight:
    """A decode step on its way: its jobs (in row order), their tokens sampled on the
    device and being copied to the host, when it started, and its report."""

    def __init__(self, jobs: list[ActiveJob], tokens: torch.Tensor, start: int,
                 report: StepReport):
        self.jobs, self.tokens, self.start, self.report = jobs, tokens, start, report
        self.timed = True  # False: a graph was captured in it (not a plain step's time)
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._ready: Any = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = tokens, None

    def read(self) -> list[int]:
        """The tokens on the host (waits for this step only, not for later ones)."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()


class AheadSteps:
    """The Generator's pipelined decode steps (module docstring). Mixed into Generator,
    whose state it uses: the attributes below, `_deliver` and `_adapters_for`."""

    if TYPE_CHECKING:
        async_step: bool
        launched_ahead: int
        launched_late: int
        max_batch: int
        decode: DecodeRunner
        draft_cost: bool
        plain_clock: PlainStepClock
        step_observers: list[Callable[[StepReport], None]]
        _active: list[ActiveJob]
        _queue: deque[JobHandle]
        _flight: Flight | None
        _landed_ns: int

        def _deliver(self, active: ActiveJob, events: list[GeneratorEvent],
                     report: StepReport) -> None: ...

        def _adapters_for(self, rows: list[tuple[ActiveJob, int]]) -> Any: ...

        def _take_before_text(self, jobs: list[ActiveJob], tokens: list[int],
                              elapsed: int, report: StepReport) -> bool: ...

    def _launch(self, jobs: list[ActiveJob], logits: torch.Tensor, start: int,
                report: StepReport) -> Flight | None:
        """Sample a decode step's rows on the device and start copying the tokens back;
        None when a row needs its own sampler on the host (constraints, penalties...)."""
        if any(job.handle.job.constraint is not None or not job.batched for job in jobs):
            return None
        tokens = sample_on_device(logits, [job.sampler for job in jobs], checked=True,
                                  greedy=self.decode.greedy)
        if tokens is None:
            return None
        return Flight(jobs, tokens, start, report)

    def _ahead_jobs(self, jobs: list[ActiveJob]) -> tuple[list[ActiveJob], list[ActiveJob]]:
        """The jobs of the step after `jobs`' current one, when it may start before
        their tokens are known ([] when not): pipelining on, the same jobs (every active
        one), nobody to admit or prefill, no constraints or host-side samplers, no
        drafts. A job whose budget ends with its current token is left out (it has no
        next step), unless a queued job would take its place at once.
        Also the drafting jobs whose peek found something on the text known now: when
        there are any, the step may start only once their tokens in flight are read and
        their drafters find nothing with them either (`_peeks_after`)."""
        if not self.async_step or not jobs:
            return [], []
        if {id(job) for job in jobs} != {id(job) for job in self._active}:
            return [], []
        going, peeked = [], []
        for job in jobs:
            if job.prefilling or job.handle.job.constraint is not None or not job.batched:
                return [], []
            # A drafting job may run ahead while its drafting is paused (backed off), or
            # when its drafter can say at once that it has nothing (`_peeks_dry`).
            if job.drafter is not None and job.produced + 2 > job.backoff.paused_until:
                if getattr(job.drafter, "peek", None) is None:
                    return [], []
                if not _peeks_dry(job):
                    peeked.append(job)
            if job.produced + 2 <= job.budget:
                going.append(job)
        if self._queue and len(going) < self.max_batch:
            return [], []  # a queued job joins the next step (a slot is free or frees now)
        if not self.decode.fits([(job.table, 0) for job in going]):
            return [], []
        return going, peeked

    def _land(self, flight: Flight) -> StepReport:
        """Read back `flight`'s tokens (after launching the step that follows it, when
        it may start now) and hand them to their jobs."""
        alive = {id(job) for job in self._active}
        live = [i for i, job in enumerate(flight.jobs) if id(job) in alive]
        jobs = [flight.jobs[i] for i in live]
        following = None
        timed = flight.timed
        going, peeked = self._ahead_jobs(jobs)
        tokens: list[int] | None = None
        late = False
        if going and peeked:  # wait for their tokens, then look again with them
            tokens = flight.read()
            row = {id(job): i for i, job in enumerate(flight.jobs)}
            if any(_peeks_after(job, tokens[row[id(job)]]) for job in peeked):
                going = []  # a draft: the next step is synchronous and drafts
            late = True
        if going:
            start = time.perf_counter_ns()
            captures = self.decode.captures
            kept = {id(job) for job in going}
            rows = [i for i in live if id(flight.jobs[i]) in kept]
            ids = flight.tokens if len(rows) == len(flight.jobs) else flight.tokens.index_select(
                0, to_device(rows, flight.tokens.device))
            with self._adapters_for([(job, 1) for job in going]):
                logits = self.decode.run([(job.table, None) for job in going], ids)
            following = self._launch(going, logits, start, StepReport(
                decode_tokens=len(going), jobs=len(going),
                job_ids=[job.handle.id for job in going]))
            timed = timed and self.decode.captures == captures
            if following is not None:
                following.timed = self.decode.captures == captures
                self.launched_ahead += 1
                self.launched_late += late
        if tokens is None:
            tokens = flight.read()
        now = time.perf_counter_ns()
        # Steps in flight overlap: each job is charged from the later of its launch and
        # the previous read-back, so its eval_duration is the wall time it took.
        elapsed = now - max(flight.start, self._landed_ns)
        self._landed_ns = now
        if timed and self.draft_cost:
            self.plain_clock.observe(len(flight.jobs), elapsed)
        report = flight.report
        if following is None and self._take_before_text(  # verify_ahead.py
                [flight.jobs[i] for i in live], [tokens[i] for i in live], elapsed, report):
            return report
        continuing = {id(job) for job in following.jobs} if following is not None else set()
        for i in live:
            job = flight.jobs[i]
            events = job.after_forward([], None, elapsed, tokens[i])
            self._deliver(job, events, report)
            if id(job) in continuing and job.pending_token is not None:
                job.table.commit([job.pending_token])  # already fed to the next step
                job.pending_token = None
        alive = {id(job) for job in self._active}
        if following is not None and not any(id(job) in alive for job in following.jobs):
            following = None  # every job of it ended: nothing to read back
        self._flight = following
        for observer in self.step_observers:
            observer(report)
        return report
