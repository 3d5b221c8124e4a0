"""When a job drafts: speculative decoding backs off by itself while drafting does not pay.

A verification pass that keeps none of its drafts costs more than a plain step and
still emits one token, so a job whose drafts keep failing (free text under the
`ngram` drafter, a draft model that disagrees with the target) should stop drafting.
And a pass that keeps drafts can still lose when it costs more than the plain steps
it replaces (a verify pass on a slow path, a device where extra rows are not free).
`DraftBackoff` watches both:

- acceptance: a running rate (kept / drafted, an exponential average over
  verification passes); below `min_rate` drafting pauses;
- cost (`record_cost`, when the generator has timed a plain step at this batch size):
  a running gain, tokens the passes emitted over their wall time in plain-step units
  (both sums decayed by COST_DECAY per pass), i.e. tokens per plain-step time; below
  `min_gain` (1: plain decoding emits one token per step) drafting pauses, once
  MIN_COST_PASSES passes were judged or their loss passed MAX_EARLY_LOSS plain steps.
  One pass that kept nothing is not a verdict: at 1.08x a plain step it lost 0.08 of a
  step, and pausing for it cost run 27 a quarter of the one-job speed-up.
- the batch (`charge_step` -> `judge_batch`, past one job): a pass with drafts makes
  every job in it wait, so when the whole batch's running share of drafts kept or its
  tokens per plain-step time fall too low, every job of it pauses (`pause_for`).

A pause lasts `pause` tokens, after which one probe pass drafts again. Each failed
probe doubles the pause (up to `max_pause`); a probe that brings the measure back ends
the back-off. A pause for cost is at least long enough that the probe's loss (its
extra time over the plain steps it replaced) stays under `probe_overhead` of the
paused time, so a pass 30x a plain step is probed rarely (capped at `max_cost_pause`).
Paused steps are plain one-token steps, so they also take the generator's fast decode
path.

Public API: ``DraftBackoff(min_rate, first_pause, max_pause, min_gain)`` with
``may_draft(produced)``, ``record(drafted, kept, produced)``,
``record_cost(emitted, pass_ns, plain_ns, produced)``, ``paused_until`` and the
counters ``pauses`` / ``cost_pauses`` / ``paused_tokens``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Below about one kept draft in four a 4-token draft gains less than a verify pass
# costs over a plain step (bench/NOTES-speculative.md: a 5-token pass ~1.4x a plain one).
DEFAULT_MIN_RATE = 0.25
DEFAULT_FIRST_PAUSE = 8
DEFAULT_MAX_PAUSE = 128
SMOOTHING = 0.5  # weight of the newest pass in the running rate and gain
# A drafting pass must emit at least as many tokens as plain steps would in its time.
DEFAULT_MIN_GAIN = 1.0
PROBE_OVERHEAD = 0.03  # a cost probe may lose at most this share of the paused time
MAX_COST_PAUSE = 2048
COST_DECAY = 0.75  # weight of the older passes in the cost sums
MIN_COST_PASSES = 4  # passes judged together before a small loss pauses drafting
MAX_EARLY_LOSS = 2.0  # plain steps a window may lose before MIN_COST_PASSES is reached


@dataclass
class DraftBackoff:
    """Per-job drafting switch; positions are counted in the job's produced tokens."""

    min_rate: float = DEFAULT_MIN_RATE
    first_pause: int = DEFAULT_FIRST_PAUSE
    max_pause: int = DEFAULT_MAX_PAUSE
    min_gain: float = DEFAULT_MIN_GAIN
    probe_overhead: float = PROBE_OVERHEAD
    max_cost_pause: int = MAX_COST_PAUSE
    rate: float = 1.0  # running acceptance; optimistic start so the first drafts run
    cost_emitted: float = 0.0  # decayed tokens of the passes judged since the last verdict
    cost_steps: float = 0.0  # their decayed wall time, in plain steps
    cost_passes: int = 0  # passes judged since the last verdict
    paused_until: int = 0  # no drafts before this many tokens were produced
    pause: int = 0  # the current pause length (0: not backing off)
    pauses: int = 0  # how many times drafting was paused (for either reason)
    cost_pauses: int = 0  # of those, how many because drafting passes cost too much
    paused_tokens: int = 0  # tokens produced without drafting because of a pause

    def may_draft(self, produced: int) -> bool:
        """Whether the job may draft at the step after `produced` tokens."""
        if produced < self.paused_until:
            self.paused_tokens += 1
            return False
        return True

    def record(self, drafted: int, kept: int, produced: int) -> None:
        """A verification pass kept `kept` of `drafted` drafts; `produced` counts the
        job's tokens after it."""
        if drafted <= 0:
            return
        self.rate = (1 - SMOOTHING) * self.rate + SMOOTHING * (kept / drafted)
        if self.rate >= self.min_rate:
            if self.gain is None or self.gain >= self.min_gain:
                self.pause = 0  # drafting pays again
            return
        self._pause(produced, min(self.max_pause,
                                  self.pause * 2 if self.pause else self.first_pause))
        # The probe after the pause is judged on its own: start it from the threshold.
        self.rate = self.min_rate

    def record_cost(self, emitted: int, pass_ns: int, plain_ns: float, produced: int) -> None:
        """A drafting pass of this job emitted `emitted` tokens in `pass_ns` of wall
        time, where a plain step of the same batch takes `plain_ns`."""
        if emitted <= 0 or pass_ns <= 0 or plain_ns <= 0:
            return
        if produced < self.paused_until:
            return  # already paused (by acceptance) after this pass
        steps = pass_ns / plain_ns
        self.cost_emitted = COST_DECAY * self.cost_emitted + emitted
        self.cost_steps = COST_DECAY * self.cost_steps + steps
        self.cost_passes += 1
        if self.gain >= self.min_gain:
            if self.rate >= self.min_rate:
                self.pause = 0
            return
        if (self.cost_passes < MIN_COST_PASSES
                and self.cost_steps - self.cost_emitted < MAX_EARLY_LOSS):
            return  # a small loss over few passes: not yet a verdict
        # The probe's loss, in plain steps: what the pass took beyond the tokens it gave.
        loss = max(0.0, steps - emitted)
        floor = min(self.max_cost_pause, math.ceil(loss / self.probe_overhead))
        doubled = min(self.max_pause, self.pause * 2 if self.pause else self.first_pause)
        self._pause(produced, max(doubled, floor))
        self.cost_pauses += 1
        self._reset_cost()  # the probe is judged on its own

    @property
    def gain(self) -> float | None:
        """The running tokens per plain-step time of the passes judged since the last
        verdict (None before the first)."""
        return self.cost_emitted / self.cost_steps if self.cost_steps > 0 else None

    def _reset_cost(self) -> None:
        self.cost_emitted = self.cost_steps = 0.0
        self.cost_passes = 0

    def pause_for(self, produced: int, length: int) -> None:
        """Pause drafting for `length` tokens from `produced` (the batch-level gate,
        `charge_step`), unless a longer pause already runs."""
        if produced + length > self.paused_until:
            self._pause(produced, length)
            self.rate = self.min_rate  # the probe after the pause is judged on its own
            self._reset_cost()

    def _pause(self, produced: int, length: int) -> None:
        self.pause = max(1, length)
        self.paused_until = produced + self.pause
        self.pauses += 1


STALE_AFTER = 64  # drafting steps after which a batch size's plain step is timed again
# A pass with drafts makes every job in it wait for it, drafting or not: past one job,
# drafting pays only if the whole batch emits more per unit of time than plain steps
# (run 26 on the H200: 16 jobs at 0.69-0.86x with the per-job rule alone).
FIRST_BATCH_PAUSE = 16
BATCH_MIN_GAIN = 1.0
MAX_BATCH_PAUSE = 512
# Past one job a drafted pass also costs what its gain does not show: it is synchronous
# (its drafts need the tokens before it on the host), so the steps around it are not
# launched ahead, and every drafting job peeks at every step. A batch whose drafts are
# mostly rejected pays that for little: below this share of drafts kept (over the
# batch's drafted passes) every job of the batch pauses. Run 66 on the H200, 16 jobs of
# free text: 18 of 120 drafts kept, 0.94x; grounded text keeps ~73%.
BATCH_MIN_RATE = DEFAULT_MIN_RATE
# With nobody queued a batch's last token comes from its slowest job (the most tokens
# left), whoever else drafts well: a pass pays the batch only by what it takes off that
# job's rest, per plain-step time (`judge_batch`). Run 70, 16 jobs of free text: a few
# jobs kept drafts, the slowest none, and the run was 0.947x.


def size_class(jobs: int) -> int:
    """Batch sizes timed together: powers of two (the decode runner's buckets)."""
    return 1 << max(0, jobs - 1).bit_length()


def smooth_into(times: dict[int, float], jobs: int, elapsed_ns: int) -> bool:
    """Fold `elapsed_ns` into `times`' running figure for `jobs`' size class (SMOOTHING
    on the newest); False (nothing kept) for an empty or untimed observation."""
    if jobs <= 0 or elapsed_ns <= 0:
        return False
    key = size_class(jobs)
    old = times.get(key)
    times[key] = elapsed_ns if old is None else (1 - SMOOTHING) * old + SMOOTHING * elapsed_ns
    return True


def running(table: dict[int, float], jobs: int, measured: float) -> float:
    """Fold `measured` into `table`'s running figure for `jobs`' size class (SMOOTHING on
    the newest; the first is taken as it is) and return it."""
    key = size_class(jobs)
    old = table.get(key)
    table[key] = value = measured if old is None else (
        (1 - SMOOTHING) * old + SMOOTHING * measured)
    return value


class PlainStepClock:
    """The generator's wall time of a plain decode step, per batch size class: the
    reference `DraftBackoff.record_cost` compares drafting passes with. A size class
    never timed, or not timed for `stale_after` drafting steps (contexts grow, so do
    step times), asks for a plain step (`wants_plain`)."""

    def __init__(self, stale_after: int = STALE_AFTER):
        self.stale_after = stale_after
        self._ns: dict[int, float] = {}
        self._age: dict[int, int] = {}
        self._batch_gain: dict[int, float] = {}  # size class -> running batch gain
        self._batch_rate: dict[int, float] = {}  # size class -> running share kept
        self._batch_slowest: dict[int, float] = {}  # size class -> the slowest job's gain
        self._batch_pause: dict[int, int] = {}  # size class -> the last batch pause

    def batch_gain(self, jobs: int, measured: float) -> float:
        """The running gain of drafting passes over `jobs` jobs (tokens the whole batch
        emitted per plain-step time, over the plain step's `jobs`)."""
        return running(self._batch_gain, jobs, measured)

    def batch_rate(self, jobs: int, measured: float) -> float:
        """The running share of drafts kept in drafting passes over `jobs` jobs."""
        return running(self._batch_rate, jobs, measured)

    def batch_slowest(self, jobs: int, measured: float) -> float:
        """The running gain of the slowest job of drafting passes over `jobs` jobs
        (tokens taken off the longest rest per plain-step time)."""
        return running(self._batch_slowest, jobs, measured)

    def batch_pause(self, jobs: int, paying: bool) -> int:
        """The pause (tokens) every job of a batch whose drafting does not pay takes:
        FIRST_BATCH_PAUSE, doubled per failed probe up to MAX_BATCH_PAUSE; 0 (and the
        doubling reset) while it pays."""
        key = size_class(jobs)
        if paying:
            self._batch_pause[key] = 0
            return 0
        last = self._batch_pause.get(key, 0)
        pause = min(MAX_BATCH_PAUSE, last * 2 if last else FIRST_BATCH_PAUSE)
        self._batch_pause[key] = pause
        self._batch_gain.pop(key, None)  # the probe after the pause is judged on its own
        self._batch_rate.pop(key, None)
        self._batch_slowest.pop(key, None)
        return pause

    def observe(self, jobs: int, elapsed_ns: int) -> None:
        """A plain decode step over `jobs` jobs took `elapsed_ns`."""
        if smooth_into(self._ns, jobs, elapsed_ns):
            self._age[size_class(jobs)] = 0

    def plain_ns(self, jobs: int) -> float | None:
        return self._ns.get(size_class(jobs))

    def drafted(self, jobs: int) -> None:
        """A drafting step over `jobs` jobs ran (ages that size's plain time)."""
        key = size_class(jobs)
        self._age[key] = self._age.get(key, 0) + 1

    def wants_plain(self, jobs: int) -> bool:
        key = size_class(jobs)
        return key not in self._ns or self._age.get(key, 0) >= self.stale_after


def charge_step(clock: PlainStepClock, fed: Sequence[tuple[Any, list[int]]], drafted: bool,
                took_ns: int, before: Sequence[tuple[int, bool]], queued: bool = True) -> bool:
    """A decode step over `fed` [(ActiveJob, tokens)] took `took_ns` of wall time (read
    from clocks the generator reads anyway: its read-back is the sync). A plain step
    times plain steps of its size; a drafting step is charged to each job that verified
    (`before[i]`: its produced count before the step, and whether it verified).
    Past one job the batch is judged as a whole too (`judge_batch`; `queued`: jobs wait
    for a slot). Returns whether the next step should be a plain one, to time that size."""
    jobs = len(fed)
    if not drafted:
        clock.observe(jobs, took_ns)
        return False
    clock.drafted(jobs)
    plain = clock.plain_ns(jobs)
    if plain is not None:
        for (active, _), (produced, verifying) in zip(fed, before, strict=True):
            if verifying:
                active.backoff.record_cost(active.produced - produced, took_ns, plain,
                                           active.produced)
    if jobs > 1:
        judge_batch(clock, fed, took_ns, before, plain, queued)
    return clock.wants_plain(jobs)


def judge_batch(clock: PlainStepClock, fed: Sequence[tuple[Any, list[int]]], took_ns: int,
                before: Sequence[tuple[int, bool]], plain: float | None,
                queued: bool = True) -> None:
    """A drafting pass over several jobs: every job of it pauses drafting (the batch
    pause, doubling per failed probe) when the batch's running share of drafts kept is
    under BATCH_MIN_RATE, or, once a plain step of its size was timed, when the batch
    emits fewer tokens per plain-step time than plain steps would (BATCH_MIN_GAIN), or,
    with nobody `queued`, when its slowest job (the longest rest of its budget) gains
    less than that: tokens taken off the longest rest per plain-step time."""
    jobs = len(fed)
    drafts = kept = emitted = 0
    for (active, tokens), (produced, verifying) in zip(fed, before, strict=True):
        emitted += active.produced - produced
        if verifying:
            drafts += len(tokens) - 1
            kept += max(0, active.produced - produced - 1)
    paying = True
    if drafts:
        paying = clock.batch_rate(jobs, min(kept, drafts) / drafts) >= BATCH_MIN_RATE
    if plain is not None and took_ns > 0:
        gain = clock.batch_gain(jobs, emitted * plain / (jobs * took_ns))
        paying = paying and gain >= BATCH_MIN_GAIN
        if not queued:
            longest = max(active.budget - produced
                          for (active, _), (produced, _) in zip(fed, before, strict=True))
            left = max(active.budget - active.produced for active, _ in fed)
            slowest = clock.batch_slowest(jobs, (longest - left) * plain / took_ns)
            paying = paying and slowest >= BATCH_MIN_GAIN
    pause = clock.batch_pause(jobs, paying)
    if pause:
        for active, _ in fed:
            if active.drafter is not None:
                active.backoff.pause_for(active.produced, pause)


def fit_rows(fed: Sequence[tuple[Any, list[int]]], max_rows: int) -> int:
    """Shorten the longest drafts (ActiveJob.trim_draft, and the fed token lists) until
    the step's rows fit `max_rows`, so a pass stays on the fixed-shape step (16 jobs
    keep 3 drafts each of 64 rows rather than leave it); returns the drafts dropped. A
    shorter draft verifies the same way."""
    excess = sum(len(tokens) for _, tokens in fed) - max_rows
    dropped = 0
    while excess > 0:
        active, tokens = max(fed, key=lambda item: len(item[1]))
        if len(tokens) <= 1:
            break  # more jobs than rows: the general path takes the step
        tokens.pop()
        active.trim_draft(len(tokens) - 1)
        excess -= 1
        dropped += 1
    return dropped
