"""The step after a read-back step launched before that step's text work.

A plain decode step is launched before the one in flight is read back (ahead_step.py).
A pass with drafts cannot be: the tokens it accepts decide what the next step feeds,
and the drafter proposes from them. What can wait is the host's text work on those
tokens (detokenizing, stop strings, events), which for 16 jobs takes about as long as
a SmolLM2 step on the H200 (run 60: a drafted pass of 16 jobs ~1.37 ms over an
overlapped plain step). So once a step's tokens are read back, `VerifyAhead` takes
them into each job first (ActiveJob.outcome / advance: history, counts, cache, the
pending token; no text), builds the next step (Generator._gather, drafts included)
and launches it: a plain step as an ahead_step `Flight`, a pass with drafts as a
`VerifyFlight` (its greedy picks and plain samples drawn on the device and copied
back); only then does the text work (ActiveJob.text_after) run, while the device
computes. The next `step()` lands the flight as the synchronous path would have
finished it.

Exact semantics, as ahead_step's: this happens only when nothing the host has not done
can change the next step: the same jobs (every active one), nobody queued who could
join, no prompt to take in, no constraint, every sampler on the device, and no job
ending on its tokens (EOS, budget; then the synchronous path takes the step). A stop
string found in the text work ends its job there (the tokens after it are taken
back), and the job is retired at once; the rows the launched step holds for it wrote
keys and values past its committed length (pages freed with it) and are dropped when
the step lands. A next step that cannot be launched (the general path, a sampler on
the host) is kept as gathered and run by the next `step()` (`_gathered`), so nothing
is gathered twice. `EXL3_VERIFY_AHEAD=0` turns this off alone (read when a generator
is made: `verify_ahead_default`), `EXL3_ASYNC_STEP=0` with the rest of the pipelining.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from exl3cli.engine.generation import step_forward
from exl3cli.engine.generation.ahead_step import Flight, StepReport
from exl3cli.engine.generation.batch_sampling import launch_sample_and_pick, split_picks
from exl3cli.envvars import switch

if TYPE_CHECKING:
    from collections import deque
    from collections.abc import Callable

    from exl3cli.engine.generation.decode_step import DecodeRunner
    from exl3cli.engine.generation.jobs import ActiveJob, GeneratorEvent, JobHandle
    from exl3cli.engine.generation.step_forward import Fed


VERIFY_AHEAD_ENV = "EXL3_VERIFY_AHEAD"


def verify_ahead_default() -> bool:
    """EXL3_VERIFY_AHEAD: "1" (the default) launches the step after a read-back step
    before its text work, "0" does not (InvalidSetting on anything else)."""
    return switch(VERIFY_AHEAD_ENV, True)


class VerifyFlight(Flight):
    """A step with drafts on its way: what each job fed, its logits rows, and the
    layout of the values copied back ([plain samples of `due`..., picks of `picking`...])."""

    def __init__(self, fed: Fed, rows: list[Any], due: list[int], picking: list[int],
                 values: torch.Tensor, start: int, report: StepReport, catch_up_ns: int):
        super().__init__([active for active, _ in fed], values, start, report)
        self.fed, self.rows, self.due, self.picking = fed, rows, due, picking
        self.catch_up_ns = catch_up_ns

    def outcome(self) -> tuple[dict[int, int], dict[int, list[int]]]:
        """({index in fed: token}, {index: picks}) as step_forward.sample_rows gives."""
        values = self.read()
        tokens = dict(zip(self.due, values[: len(self.due)], strict=True))
        groups = [range(self.rows[i].start, self.rows[i].stop) for i in self.picking]
        picks = dict(zip(self.picking, split_picks(values[len(self.due):], groups), strict=True))
        return tokens, picks


class VerifyAhead:
    """Generator's read-back steps (module docstring). Mixed into Generator, whose
    state and methods it uses (below)."""

    if TYPE_CHECKING:
        async_step: bool
        verify_ahead: bool
        launched_before_text: int
        max_batch: int
        decode: DecodeRunner
        draft_cost: bool
        step_observers: list[Callable[[StepReport], None]]
        _active: list[ActiveJob]
        _queue: deque[JobHandle]
        _flight: Flight | None
        _landed_ns: int
        _catch_up_ns: int
        _gathered: tuple[Fed, StepReport, int] | None

        def _deliver(self, active: ActiveJob, events: list[GeneratorEvent],
                     report: StepReport) -> None: ...

        def _adapters_for(self, rows: list[tuple[ActiveJob, int]]) -> Any: ...

        def _gather(self, report: StepReport) -> Fed: ...

        def _time_step(self, fed: Fed, report: StepReport, took_ns: int,
                       before: list[tuple[int, bool]]) -> None: ...

        def _launch(self, jobs: list[ActiveJob], logits: torch.Tensor, start: int,
                    report: StepReport) -> Flight | None: ...

    def _finish_step(self, fed: Fed, logits: torch.Tensor | None, rows: list[Any],
                     read: tuple[dict[int, int], dict[int, list[int]]], start: int,
                     began: int, timed: bool, report: StepReport) -> StepReport:
        """A step whose tokens are on the host (`read`: sample_rows' dicts): each job
        takes them (and its text), then the step is timed; with the step after it
        launched first when it may be (module docstring)."""
        tokens_of, picks_of = read
        now = time.perf_counter_ns()
        elapsed = now - start
        before = [(active.produced, active.verifying) for active, _ in fed]
        taken = self._outcomes(fed, report, tokens_of, picks_of)
        if taken is None:
            for i, (row, (active, tokens)) in enumerate(zip(rows, fed, strict=True)):
                host = i in tokens_of or i in picks_of
                events = active.after_forward(tokens, None if host or logits is None
                                              else logits[row], elapsed,
                                              tokens_of.get(i), picks_of.get(i))
                self._deliver(active, events, report)
            if self.draft_cost and timed:
                self._time_step(fed, report, time.perf_counter_ns() - began, before)
        else:
            for (active, tokens), outcome in zip(fed, taken, strict=True):
                active.advance(tokens, outcome, elapsed)
            if self.draft_cost and timed:
                self._time_step(fed, report, time.perf_counter_ns() - began, before)
            self._landed_ns = time.perf_counter_ns()
            self._launch_next()
            for active, _ in fed:  # the text work, while the next step runs
                self._deliver(active, active.text_after(), report)
            self._drop_ended()
        for observer in self.step_observers:
            observer(report)
        return report

    def _take_before_text(self, jobs: list[ActiveJob], tokens: list[int], elapsed: int,
                          report: StepReport) -> bool:
        """A landed plain step (ahead_step.Flight) that launched nothing after it (a
        drafter's peek found something, say): when it may, the step after it (with
        its drafts) is launched before this one's text work; False when not (the
        landing then finishes as before)."""
        fed: Fed = [(job, []) for job in jobs]
        taken = self._outcomes(fed, report, dict(enumerate(tokens)), {})
        if taken is None:
            return False
        for job, outcome in zip(jobs, taken, strict=True):
            job.advance([], outcome, elapsed)
        self._flight = None
        self._launch_next()
        for job in jobs:
            self._deliver(job, job.text_after(), report)
        self._drop_ended()
        for observer in self.step_observers:
            observer(report)
        return True

    def _drop_ended(self) -> None:
        """Forget the step launched (or gathered) before the text work when every job
        of it has ended in that work (stop strings): nothing of it is to be read."""
        alive = {id(active) for active in self._active}
        if self._flight is not None and not any(id(job) in alive for job in self._flight.jobs):
            self._flight = None
        if self._gathered is not None and not any(id(active) in alive
                                                  for active, _ in self._gathered[0]):
            self._gathered = None

    def _outcomes(self, fed: Fed, report: StepReport, tokens_of: dict[int, int],
                  picks_of: dict[int, list[int]]) -> list[list[int]] | None:
        """Each job's tokens when the step after this one may be launched before their
        text work (module docstring), else None."""
        if not (self.async_step and self.verify_ahead and self.decode.enabled) or \
                report.prefill_tokens:
            return None
        if {id(active) for active, _ in fed} != {id(active) for active in self._active}:
            return None
        if self._queue and len(fed) < self.max_batch:
            return None  # a queued job joins the next step
        taken = []
        for i, (active, _) in enumerate(fed):
            tokens = active.outcome(tokens_of.get(i), picks_of.get(i)) if active.batched else None
            if tokens is None:
                return None
            taken.append(tokens)
        return taken

    def _launch_next(self) -> None:
        """Gather the next step and launch it (a Flight or a VerifyFlight), or keep it
        gathered for the next `step()` when it cannot be launched."""
        report = StepReport()
        began = time.perf_counter_ns()
        fed = self._gather(report)
        if not fed:
            return
        report.jobs = len(fed)
        report.job_ids = [active.handle.id for active, _ in fed]
        launchable = not report.prefill_tokens and all(
            active.batched and not active.prefilling for active, _ in fed)
        start = self._landed_ns  # charged from the read-back before it (its gather too)
        captures = self.decode.captures
        if launchable and step_forward.decode_only(self.decode, fed):
            with self._adapters_for([(active, 1) for active, _ in fed]):
                logits = self.decode.run([(active.table, tokens[0]) for active, tokens in fed])
            for active, tokens in fed:
                active.table.commit(tokens)
            flight = self._launch([active for active, _ in fed], logits, start, report)
            if flight is not None:
                flight.timed = self.decode.captures == captures
                self._flight = flight
                self.launched_before_text += 1
                return
            # not reached: every sampler batches; read it back now, as _step would
            self._finish_step(fed, logits, list(range(len(fed))), step_forward.sample_rows(
                fed, logits, list(range(len(fed)))), start, began, False, report)
            return
        picking = [i for i, (active, _) in enumerate(fed) if active.verifying]
        if not (launchable and step_forward.verify_fixed(self.decode, fed)
                and all(fed[i][0].sampler.greedy for i in picking)):
            self._gathered = (fed, report, began)
            return
        catch_up = self._catch_up_ns
        with self._adapters_for([(active, len(tokens)) for active, tokens in fed]):
            logits, rows = step_forward.forward_fixed(self.decode, fed)
        due = [i for i in range(len(fed)) if i not in set(picking)]
        values = launch_sample_and_pick(
            logits, [rows[i] for i in due], [fed[i][0].sampler for i in due],
            [range(rows[i].start, rows[i].stop) for i in picking])
        flight = VerifyFlight(fed, rows, due, picking, values, start, report, catch_up)
        flight.timed = self.decode.captures == captures
        self._flight = flight
        self.launched_before_text += 1

    def _land_verify(self, flight: VerifyFlight) -> StepReport:
        """Read back a VerifyFlight and finish its step for the jobs still running."""
        self._flight = None
        tokens_of, picks_of = flight.outcome()
        alive = {id(active) for active in self._active}
        keep = [i for i, (active, _) in enumerate(flight.fed) if id(active) in alive]
        fed = [flight.fed[i] for i in keep]
        rows = [flight.rows[i] for i in keep]
        read = ({j: tokens_of[i] for j, i in enumerate(keep) if i in tokens_of},
                {j: picks_of[i] for j, i in enumerate(keep) if i in picks_of})
        report = flight.report
        report.jobs, report.job_ids = len(fed), [active.handle.id for active, _ in fed]
        self._catch_up_ns = flight.catch_up_ns
        start = max(flight.start, self._landed_ns)
        return self._finish_step(fed, None, rows, read, start, start, flight.timed, report)
