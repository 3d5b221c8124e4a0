"""Drafting backs off when its passes cost more than the plain steps they save, even
with every draft accepted, and keeps drafting when they pay (draft_policy.py). Time is
injected: a fake clock that each forward pass advances by what such a pass costs."""

from __future__ import annotations

import math
import types

import pytest

from exl3cli.engine.generation import generator as generator_module
from exl3cli.engine.generation import verify_ahead
from exl3cli.engine.generation.draft_policy import (
    FIRST_BATCH_PAUSE,
    MIN_COST_PASSES,
    DraftBackoff,
    PlainStepClock,
    charge_step,
)
from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.generation.speculative import VerifyingBatch
from tests.fixtures.drafters import OracleDrafter

GREEDY = {"temperature": 0}
PROMPT = [5, 9, 14, 3, 77, 120, 8, 19, 33, 250, 41, 7]


def test_slow_passes_pause_drafting_despite_full_acceptance():
    backoff = DraftBackoff()
    backoff.record(4, 4, produced=5)  # every draft kept: acceptance is no reason to stop
    assert backoff.pauses == 0
    backoff.record_cost(5, pass_ns=30_000, plain_ns=1_000, produced=5)  # gain 5/30
    assert backoff.cost_pauses == 1 and not backoff.may_draft(6)
    # The probe loses 25 plain steps; the pause keeps that under 3% of the paused time.
    assert backoff.pause == math.ceil(25 / 0.03) and backoff.paused_until == 5 + backoff.pause
    # A probe that pays (5 tokens in 2 plain steps' time) ends the back-off.
    produced = backoff.paused_until
    backoff.record(4, 4, produced)
    backoff.record_cost(5, pass_ns=2_000, plain_ns=1_000, produced=produced)
    assert backoff.pause == 0 and backoff.may_draft(produced + 1)


def test_passes_that_pay_keep_drafting_and_marginal_ones_pause_briefly():
    backoff = DraftBackoff()
    for produced in range(5, 500, 5):
        backoff.record(4, 4, produced)
        backoff.record_cost(5, pass_ns=1_300, plain_ns=1_000, produced=produced)
    assert backoff.pauses == 0 and backoff.may_draft(500)
    # 2 tokens per pass at 2.2x a plain step: a loss, but a small one: judged over
    # MIN_COST_PASSES passes, then a short pause.
    marginal = DraftBackoff()
    for n in range(MIN_COST_PASSES):
        assert marginal.cost_pauses == 0
        marginal.record_cost(2, pass_ns=2_200, plain_ns=1_000, produced=10 + 2 * n)
    assert marginal.cost_pauses == 1 and marginal.pause == max(8, math.ceil(0.2 / 0.03))


def test_one_pass_that_kept_nothing_is_not_a_verdict():
    # Run 27 on the H200 (one job, grounded prompts): passes at 1.08x a plain step that
    # kept 4 of 4 drafts, now and then one that kept none; pausing at each of those lost
    # a quarter of the speed-up. The window's gain stays far above 1.
    backoff = DraftBackoff()
    produced = 0
    for n in range(40):
        kept = 0 if n % 5 == 2 else 4
        backoff.record(4, kept, produced)
        produced += kept + 1
        backoff.record_cost(kept + 1, pass_ns=1_080, plain_ns=1_000, produced=produced)
    assert backoff.cost_pauses == 0 and backoff.may_draft(produced)
    # Passes that keep nothing, one after another, are a verdict after MIN_COST_PASSES.
    failing = DraftBackoff()
    for n in range(MIN_COST_PASSES):
        assert failing.cost_pauses == 0
        failing.record_cost(1, pass_ns=1_080, plain_ns=1_000, produced=n + 1)
    assert failing.cost_pauses == 1 and not failing.may_draft(MIN_COST_PASSES + 1)
    # After a run of good passes the decayed sums turn the verdict within a few dozen
    # failing passes (each loses only 0.08 of a plain step).
    for n in range(40):
        backoff.record_cost(1, pass_ns=1_080, plain_ns=1_000, produced=produced + n)
        if backoff.cost_pauses:
            break
    assert backoff.cost_pauses == 1 and n >= MIN_COST_PASSES


def test_cost_is_not_charged_twice_after_an_acceptance_pause():
    backoff = DraftBackoff(min_rate=0.25)
    for produced in (1, 2, 3):
        backoff.record(4, 0, produced)
    assert backoff.pauses == 1
    backoff.record_cost(1, pass_ns=10_000, plain_ns=1_000, produced=3)
    assert backoff.pauses == 1 and backoff.cost_pauses == 0


def test_plain_step_clock_asks_for_a_timing_when_missing_or_stale():
    clock = PlainStepClock(stale_after=3)
    assert clock.wants_plain(1) and clock.plain_ns(1) is None
    clock.observe(1, 1_000)
    assert not clock.wants_plain(1) and clock.plain_ns(1) == 1_000
    clock.observe(1, 2_000)
    assert clock.plain_ns(1) == 1_500  # a running average
    assert clock.wants_plain(3) and clock.plain_ns(4) is None  # 3 and 4 jobs: one class
    for _ in range(3):
        clock.drafted(1)
    assert clock.wants_plain(1)


class _Timed:
    """The model, with each forward advancing `clock.now`: `verify_ns` for a pass with
    drafts (a VerifyingBatch), `plain_ns` otherwise."""

    def __init__(self, model, clock, plain_ns: int, verify_ns: int):
        self._inner, self._clock = model, clock
        self._plain_ns, self._verify_ns = plain_ns, verify_ns

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def forward(self, input_ids, cache=None, **kwargs):
        self._clock.now += self._verify_ns if isinstance(cache, VerifyingBatch) else self._plain_ns
        return self._inner.forward(input_ids, cache, **kwargs)


def _drafted_run(text_model, monkeypatch, verify_ns: int, answer: list[int]):
    clock = types.SimpleNamespace(now=0)
    fake = types.SimpleNamespace(perf_counter_ns=lambda: clock.now)
    for module in (generator_module, verify_ahead):  # the step's clocks
        monkeypatch.setattr(module, "time", fake)
    model = _Timed(text_model.model, clock, plain_ns=1_000_000, verify_ns=verify_ns)
    generator = Generator(model, text_model.tokenizer, max_batch=1, num_ctx=512,
                          decode_mode="off", draft_cost=True)
    handle = generator.submit(GenerationJob(PROMPT, GREEDY, num_predict=len(answer),
                                            drafter=OracleDrafter(PROMPT, answer), draft_tokens=4))
    generator.step()
    (active,) = generator._active
    generator.run_until_done()
    return handle, active.backoff


@pytest.fixture(scope="module")
def answer(text_model):
    generator = Generator(text_model.model, text_model.tokenizer, max_batch=1, num_ctx=512,
                          decode_mode="off")
    handle = generator.submit(GenerationJob(PROMPT, GREEDY, num_predict=120))
    handle.text()
    assert handle.final.eval_count == 120  # no EOS: every run below emits 120 tokens
    return handle.token_ids


def test_a_job_backs_off_when_passes_are_slow_even_with_every_draft_kept(
        text_model, monkeypatch, answer):
    handle, backoff = _drafted_run(text_model, monkeypatch, 30_000_000, answer)
    assert handle.token_ids == answer
    assert handle.final.draft_accepted == handle.final.draft_count > 0  # all kept
    # One untimed pass, one timed plain step, one judged pass: then paused for good.
    assert backoff.cost_pauses == 1 and handle.final.draft_count <= 8
    assert backoff.paused_tokens > 100


def test_a_job_keeps_drafting_when_passes_pay(text_model, monkeypatch, answer):
    handle, backoff = _drafted_run(text_model, monkeypatch, 1_500_000, answer)
    assert handle.token_ids == answer
    assert backoff.pauses == 0
    # After the prefill's token: one plain step timing the reference, then 4 drafts
    # kept a pass (the last pass drafts what the budget leaves): 23 * 4 + 2.
    assert handle.final.draft_accepted == 94


def _fake_jobs(count: int) -> list:
    return [types.SimpleNamespace(produced=10, drafter=object(), backoff=DraftBackoff())
            for _ in range(count)]


def test_a_batch_whose_drafting_does_not_pay_pauses_every_job():
    """Every job of a pass waits for it: a job whose own drafts pay (2 tokens in 1.5
    plain steps) pauses too when the batch emits less than plain steps would."""
    clock = PlainStepClock()
    clock.observe(4, 1_000)
    jobs = _fake_jobs(4)
    fed = [(job, [1, 2, 3]) for job in jobs]
    before = [(job.produced, True) for job in jobs]
    for job, emitted in zip(jobs, (2, 1, 1, 1), strict=True):
        job.produced += emitted
    charge_step(clock, fed, True, 1_500, before)  # batch: 5 tokens in 1.5 steps of 4
    assert jobs[0].backoff.cost_pauses == 0  # its own gain, 2 / 1.5, pays
    assert all(not job.backoff.may_draft(job.produced) for job in jobs)
    assert jobs[0].backoff.paused_until == jobs[0].produced + FIRST_BATCH_PAUSE
    # The probe after the pause fails again: the pause doubles; one that pays resets it.
    before = [(job.produced, True) for job in jobs]
    for job in jobs:
        job.produced += 1
    charge_step(clock, fed, True, 1_500, before)
    assert jobs[0].backoff.paused_until == jobs[0].produced + 2 * FIRST_BATCH_PAUSE
    paying = _fake_jobs(4)
    before = [(job.produced, True) for job in paying]
    for job in paying:
        job.produced += 3
    charge_step(clock, [(job, [1, 2, 3]) for job in paying], True, 1_500, before)
    assert all(job.backoff.may_draft(job.produced) for job in paying)
    assert clock.batch_pause(4, True) == 0


def test_one_job_is_judged_by_its_own_rule_only():
    clock = PlainStepClock()
    clock.observe(1, 1_000)
    job = _fake_jobs(1)[0]
    before = [(job.produced, True)]
    job.produced += 2
    charge_step(clock, [(job, [1, 2, 3])], True, 1_500, before)
    assert job.backoff.may_draft(job.produced) and job.backoff.pauses == 0


def test_a_batch_whose_drafts_are_mostly_rejected_pauses_every_job():
    """Past one job a drafted pass is synchronous: a batch keeping few of its drafts
    (free text) pauses even where its tokens per plain-step time look paying, and
    before any plain step was timed; one keeping most of them drafts on."""
    for timed in (True, False):
        clock = PlainStepClock()
        if timed:
            clock.observe(4, 1_000)
        jobs = _fake_jobs(4)
        before = [(job.produced, True) for job in jobs]
        for job, emitted in zip(jobs, (2, 1, 1, 1), strict=True):
            job.produced += emitted  # 1 of 8 drafts kept: 5 tokens in one plain step
        charge_step(clock, [(job, [1, 2, 3]) for job in jobs], True, 1_000, before)
        assert all(not job.backoff.may_draft(job.produced) for job in jobs), timed
        assert jobs[0].backoff.paused_until == jobs[0].produced + FIRST_BATCH_PAUSE
    clock = PlainStepClock()
    jobs = _fake_jobs(4)
    before = [(job.produced, True) for job in jobs]
    for job, emitted in zip(jobs, (3, 2, 2, 1), strict=True):
        job.produced += emitted  # 4 of 8 kept
    charge_step(clock, [(job, [1, 2, 3]) for job in jobs], True, 1_000, before)
    assert all(job.backoff.may_draft(job.produced) for job in jobs)
    # The share is a running one: a bad pass after good ones is not yet a verdict.
    before = [(job.produced, True) for job in jobs]
    for job in jobs:
        job.produced += 1
    charge_step(clock, [(job, [1, 2, 3]) for job in jobs], True, 1_000, before)
    assert all(job.backoff.may_draft(job.produced) for job in jobs)
    before = [(job.produced, True) for job in jobs]
    for job in jobs:
        job.produced += 1
    charge_step(clock, [(job, [1, 2, 3]) for job in jobs], True, 1_000, before)
    assert not any(job.backoff.may_draft(job.produced) for job in jobs)


def _budgeted_pass(emitted: tuple[int, ...], queued: bool) -> list:
    """Four jobs (budgets 64, 64, 64, 70: the last has the longest rest) in one timed
    drafting pass of 1.1 plain steps, emitting `emitted`; returns the jobs."""
    clock = PlainStepClock()
    clock.observe(4, 1_000)
    jobs = _fake_jobs(4)
    for job, budget in zip(jobs, (64, 64, 64, 70), strict=True):
        job.budget = budget
    before = [(job.produced, True) for job in jobs]
    for job, count in zip(jobs, emitted, strict=True):
        job.produced += count
    charge_step(clock, [(job, [1, 2, 3]) for job in jobs], True, 1_100, before,
                queued=queued)
    return jobs


def test_with_nobody_queued_a_batch_is_judged_by_its_slowest_job():
    """Three jobs keep every draft, the one with the longest rest keeps none: the batch
    emits 2.3x plain steps' tokens but ends no sooner, so with nobody queued it pauses;
    with jobs queued (freed slots refill) it drafts on."""
    for queued in (False, True):
        jobs = _budgeted_pass((3, 3, 3, 1), queued)
        assert all(job.backoff.may_draft(job.produced) for job in jobs) == queued
    # The slowest job keeping its drafts pays, whoever else does not.
    jobs = _budgeted_pass((1, 2, 1, 3), queued=False)
    assert all(job.backoff.may_draft(job.produced) for job in jobs)
