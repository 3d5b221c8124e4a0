"""A drafter's own forward cost: the draft model's passes are judged before they run.

A drafter that runs a model (plugins/drafters.py's `model`) spends one draft forward per
drafted position, for all its jobs at once, before the target verifies. A pass with k
drafts then takes at least k draft forwards plus a target pass, and emits at most k + 1
tokens per job; the plain steps it replaces take one target step per token. So when a
draft forward over G drafting jobs costs at least G / B target plain steps of the
B-job batch (f >= p * G / B), no acceptance can make drafting pay: the loss is certain
(run 9 on the H200: SmolLM2 2.0 bpw drafting for SmolLM2 fp16, eager draft forwards of
~70-200 plain steps a pass, 0.07-0.33x even though the per-job rule paused every job
after two judged passes: those two passes were most of a 64-token answer).

`DraftForwardCost` is one per draft model, process-wide (shared by every job and
generator that drafts with it, so a verdict outlives the request that paid for it):

- the drafter times its forwards (`timing(jobs, short)`; the read-back of the drafted
  tokens is the sync), forwards over short feeds only (a catch-up after a pause, or a
  job's prompt, is prefill, not a draft forward's cost: `take_catch_up`, which the
  generator leaves out of the pass it charges), per batch size class;
- `decide(drafting, batch, plain_ns)` is asked before each drafting step, for the jobs
  of the drafter that may draft: no cap (draft as each job's back-off says), TIME_FIRST
  (a size class never timed, and the probe after a pause: the drafter's
  `time_forward(jobs)` times one forward over one-token scratch rows, no job's text
  caught up, then it is asked again; a drafter without it drafts PROBE_DRAFTS
  positions: one forward may catch up, the next is timed), or a certain loss (measured at this
  size, or implied by another: a forward over more jobs never costs less, nor more
  than proportionally more; so once a process timed its draft model at one batch
  size, a loss at any other needs no probe): every one of those
  jobs pauses (DraftBackoff.pause_for, so paused jobs take the generator's fast plain
  path) for `interval` tokens, at least long enough that the probe's loss stays under
  PROBE_OVERHEAD of the paused time, doubled per probe that confirms it (up to
  MAX_PROBE_INTERVAL); a probe that finds the forward cheap enough ends the back-off.
  The pause is the size class's, in time (its tokens at the plain step's rate): a job
  that asks during it (another request) is paused for the rest of it without a probe
  of its own; the first to ask after it probes.

Where drafting may pay (f below the bound) the per-job and batch rules of draft_policy
judge the whole pass (draft forwards included) as before.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

from exl3cli.engine.generation.draft_policy import PROBE_OVERHEAD, size_class, smooth_into

SHORT_FEED = 4  # tokens per job at most in a draft forward that is timed
PROBE_DRAFTS = 2  # positions a probe drafts: one forward may catch up, the next is timed
TIME_FIRST = -1  # `decide`: time a forward (the drafter's `time_forward`), then ask again
FIRST_INTERVAL = 16  # tokens paused before the first probe, at least
MAX_PROBE_INTERVAL = 4096


class Timed:
    """What `DraftForwardCost.timing` yields: `discard()` when the forward was not a
    steady-state one (it captured a CUDA graph)."""

    def __init__(self) -> None:
        self.discarded = False

    def discard(self) -> None:
        self.discarded = True


class DraftForwardCost:
    """One draft model's forward time per batch size class, and its skip schedule."""

    def __init__(self) -> None:
        self._ns: dict[int, float] = {}
        self._interval: dict[int, int] = {}  # size class -> the last pause (tokens)
        # Size class -> when its pause ends (perf_counter ns): process-wide, so a request
        # that arrives during another's pause waits out the rest of it instead of probing.
        self._resume_ns: dict[int, int] = {}
        self.pauses = 0  # pauses for a certain loss, and probes after them (benchmarks)
        self.probes = 0
        self.catch_up_ns = 0  # time of the long-feed forwards since `take_catch_up`

    @contextmanager
    def timing(self, jobs: int, short: bool, scratch: bool = False) -> Iterator[Timed]:
        """Around one draft forward over `jobs` jobs (and its read-back); recorded when
        every feed was `short` (at most SHORT_FEED tokens), else counted as catch-up.
        A `scratch` forward (the drafter's `time_forward`: rows of no job) is both
        recorded and left out of the step's charge, like catch-up. One that calls
        `.discard()` on what this yields (it captured a CUDA graph) is not recorded, and
        left out of the charge."""
        timed = Timed()
        start = time.perf_counter_ns()
        yield timed
        elapsed = time.perf_counter_ns() - start
        if short and not timed.discarded:
            self.observe(jobs, elapsed)
        if scratch or not short or timed.discarded:
            self.catch_up_ns += elapsed

    def take_catch_up(self) -> int:
        """The time the draft model spent taking in text (a job's prompt, the tokens of
        a pause) since the last call: the generator leaves it out of the pass it judges,
        as it leaves out the target's prompt chunks."""
        spent, self.catch_up_ns = self.catch_up_ns, 0
        return spent

    def observe(self, jobs: int, elapsed_ns: int) -> None:
        smooth_into(self._ns, jobs, elapsed_ns)

    def forward_ns(self, jobs: int) -> float | None:
        return self._ns.get(size_class(jobs))

    def decide(self, drafting: int, batch: int, plain_ns: float | None
               ) -> tuple[int | None, int]:
        """(positions the `drafting` jobs of this drafter may draft at a step of `batch`
        decoding jobs whose plain step takes `plain_ns`: None for no cap, 0 for none;
        tokens every one of them pauses for, 0 for none) (module docstring)."""
        if drafting <= 0 or plain_ns is None or plain_ns <= 0:
            return None, 0
        key = size_class(drafting)
        now = time.perf_counter_ns()
        resume = self._resume_ns.get(key)
        if resume is not None:
            if now < resume:  # paused (for another job, maybe): the rest of that pause
                return 0, max(1, math.ceil((resume - now) / plain_ns))
            del self._resume_ns[key]  # the pause ended: time the forward again
            self.probes += 1
            return TIME_FIRST, 0
        bound = plain_ns * drafting / max(batch, drafting)
        forward = self._ns.get(key)
        if forward is None:  # never timed at this size: what other sizes say, else time it
            forward = self._lower_bound(key)
            if forward is None or forward < bound:
                return TIME_FIRST, 0
        elif forward < bound:
            self._interval.pop(key, None)
            return None, 0
        interval = self._interval.get(key)
        if interval is None:
            # The probe's loss in plain steps: one scratch forward (or PROBE_DRAFTS
            # draft forwards, whose verify pass emits at least a plain step's token).
            loss = PROBE_DRAFTS * forward / bound
            interval = min(MAX_PROBE_INTERVAL,
                           max(FIRST_INTERVAL, math.ceil(loss / PROBE_OVERHEAD)))
        else:
            interval = min(MAX_PROBE_INTERVAL, 2 * interval)
        self._interval[key] = interval
        self._resume_ns[key] = now + math.ceil(interval * plain_ns)
        self.pauses += 1
        return 0, interval

    def _lower_bound(self, key: int) -> float | None:
        """The least a forward over `key` jobs can cost, from the sizes timed: never less
        than over fewer jobs, nor less than its share of one over more."""
        known = [ns * min(1.0, key / other) for other, ns in self._ns.items()]
        return max(known) if known else None
