"""A draft model whose own forwards cost as much as the target's plain steps is paused
at once and probed rarely (draft_gate.py), at one job and at sixteen, and the text is
plain greedy's; one that is cheap keeps drafting. Time is injected: a fake clock each
forward advances (the target's plain and verify passes, the draft model's forwards)."""

from __future__ import annotations

import math
import random
import types

import pytest
import torch
from exl3_plugins.drafters import ModelDrafter

from exl3cli.engine.generation import draft_gate, verify_ahead
from exl3cli.engine.generation import generator as generator_module
from exl3cli.engine.generation.batch_sampling import sample_and_pick, sample_rows
from exl3cli.engine.generation.draft_gate import (
    MAX_PROBE_INTERVAL,
    PROBE_DRAFTS,
    TIME_FIRST,
    DraftForwardCost,
)
from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.generation.sampling import build_sampler
from exl3cli.engine.generation.speculative import VerifyingBatch, verify, verify_picks

GREEDY = {"temperature": 0}
MS = 1_000_000


def test_a_draft_forward_as_slow_as_a_plain_step_pauses_and_is_probed_rarely(monkeypatch):
    clock = types.SimpleNamespace(now=0)
    monkeypatch.setattr(draft_gate, "time", types.SimpleNamespace(perf_counter_ns=lambda: clock.now))
    cost = DraftForwardCost()
    assert cost.decide(1, 1, MS) == (TIME_FIRST, 0)  # never timed: time a forward first
    cost.observe(1, MS)  # as slow as the target's plain step: no acceptance can pay
    cap, pause = cost.decide(1, 1, MS)
    # A probe (up to two draft forwards) loses 2 plain steps: under 3% of the pause.
    assert cap == 0 and pause == math.ceil(2 / 0.03) and cost.pauses == 1
    # Another request asking 10 plain steps into the pause waits out the rest of it:
    # no probe of its own (each request probing at once lost 0.70x on the H200, run 53).
    clock.now += 10 * MS
    assert cost.decide(1, 1, MS) == (0, pause - 10) and cost.probes == 0
    clock.now += (pause - 10) * MS
    assert cost.decide(1, 1, MS) == (TIME_FIRST, 0)  # the pause ended: time it again
    assert cost.decide(1, 1, MS) == (0, 2 * pause)  # still slow: twice as long
    pauses = [2 * pause]
    for _ in range(20):  # probe, pause, probe, pause...
        clock.now += pauses[-1] * MS
        assert cost.decide(1, 1, MS) == (TIME_FIRST, 0)
        pauses.append(cost.decide(1, 1, MS)[1])
    assert pauses[1] == 4 * pause and max(pauses) == pauses[-1] == MAX_PROBE_INTERVAL
    assert cost.probes == 21 and cost.pauses == 22
    # A probe that finds the forward cheap (the device was busy, say) ends the back-off.
    clock.now += MAX_PROBE_INTERVAL * MS
    assert cost.decide(1, 1, MS) == (TIME_FIRST, 0)
    for _ in range(8):
        cost.observe(1, MS // 10)
    assert cost.decide(1, 1, MS) == (None, 0)
    # Slow again later: the back-off starts over from its first pause.
    cost.observe(1, 2 * MS)
    cost.observe(1, 2 * MS)
    assert cost.forward_ns(1) > MS
    assert cost.decide(1, 1, MS)[1] == math.ceil(2 * cost.forward_ns(1) / MS / 0.03)


def test_the_bound_is_the_batch_share_of_a_plain_step():
    """A draft forward over G of B jobs pays only below G / B plain steps: the other
    jobs wait for it too."""
    cost = DraftForwardCost()
    cost.observe(16, MS // 2)
    assert cost.decide(16, 16, MS) == (None, 0)  # all 16 draft: half a step is cheap
    cost.observe(4, MS // 2)
    assert cost.decide(4, 16, MS)[0] == 0  # 4 of 16: a quarter of a step at most


def test_one_timed_size_implies_a_loss_at_the_others():
    """Timed over 2 jobs at 40 plain steps: over 1 job it costs at least 20 (half), over
    16 at least 40; both pause without a probe of their own. Only a forward that could
    be cheap enough is probed."""
    cost = DraftForwardCost()
    cost.observe(2, 40 * MS)
    assert cost.decide(1, 1, MS) == (0, math.ceil(2 * 20 / 0.03))  # the probe: 2 x 20 steps
    assert cost.decide(16, 16, MS)[0] == 0 and cost.probes == 0
    fast = DraftForwardCost()
    fast.observe(16, MS)  # 16 jobs at one plain step: 1 job may cost as little as 1/16
    assert fast.decide(1, 1, MS) == (TIME_FIRST, 0)


def test_catch_up_forwards_are_not_a_draft_forwards_cost():
    cost = DraftForwardCost()
    clock = types.SimpleNamespace(now=0)
    original = draft_gate.time
    draft_gate.time = types.SimpleNamespace(perf_counter_ns=lambda: clock.now)
    try:
        with cost.timing(3, short=False):  # a job's prompt, or a pause's tokens
            clock.now += 7 * MS
        assert cost.forward_ns(3) is None and cost.take_catch_up() == 7 * MS
        assert cost.take_catch_up() == 0
        with cost.timing(3, short=True):
            clock.now += MS
        assert cost.forward_ns(4) == MS  # 3 and 4 jobs: one size class
    finally:
        draft_gate.time = original


def test_greedy_picks_read_back_together_verify_like_the_sampler():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(12, 50, generator=gen)
    logits[7, 9] = logits[7, 4] = logits[7].max() + 1  # a tie: the first index wins
    samplers = [build_sampler(GREEDY), build_sampler({"temperature": 0.7, "seed": 1})]
    drawn, picks = sample_and_pick(logits, [0, 1], samplers, [[], []], [range(2, 6), range(6, 12)])
    assert drawn == sample_rows(logits[:2], [build_sampler(GREEDY), build_sampler(
        {"temperature": 0.7, "seed": 1})], [[], []])
    assert picks == [logits[2:6].argmax(-1).tolist(), logits[6:12].argmax(-1).tolist()]
    assert picks[1][1] == 4
    sampler = build_sampler(GREEDY)
    for draft in ([], [3], picks[1][:3], picks[1][:5], [picks[1][0], 1, 2, 3, 4]):
        rows = logits[6 : 6 + len(draft) + 1]
        assert verify_picks(draft, picks[1]) == verify(sampler, rows, draft, [1, 2])


class _Clocked:
    """A model whose forward advances `clock.now`: `verify_ns` for a target pass with
    drafts (a VerifyingBatch), else `plain_ns` (a target step, or a draft forward)."""

    def __init__(self, model, clock, plain_ns: int, verify_ns: int | None = None):
        self.inner, self._clock = model, clock
        self._plain_ns, self._verify_ns = plain_ns, verify_ns or plain_ns
        self.config, self.layers = model.config, model.layers
        self.dtype, self.device = model.dtype, model.device

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, input_ids, cache=None, **kwargs):
        verifying = isinstance(cache, VerifyingBatch)
        self._clock.now += self._verify_ns if verifying else self._plain_ns
        return self.inner.forward(input_ids, cache, **kwargs)


def _prompts(count: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 400) for _ in range(rng.randrange(8, 40))] for _ in range(count)]


def _run(text_model, monkeypatch, prompts, tokens, draft_ns=None, draft=None):
    """(token ids per job, fake time of the whole run, the draft model's cost record);
    `draft`: a draft model of an earlier run (its cost record lives on)."""
    clock = types.SimpleNamespace(now=0)
    fake = types.SimpleNamespace(perf_counter_ns=lambda: clock.now)
    for module in (generator_module, verify_ahead):  # the step's clocks
        monkeypatch.setattr(module, "time", fake)
    monkeypatch.setattr(draft_gate, "time", fake)
    target = _Clocked(text_model.model, clock, MS, verify_ns=11 * MS // 10)
    if draft is not None:
        draft._clock = clock
    elif draft_ns:
        draft = _Clocked(text_model.model, clock, draft_ns)
    generator = Generator(target, text_model.tokenizer, max_batch=len(prompts), num_ctx=512,
                          decode_mode="off", draft_cost=True)
    handles = [generator.submit(GenerationJob(
        p, GREEDY, num_predict=tokens, ignore_eos=True,
        drafter=ModelDrafter(draft) if draft else None, draft_tokens=4 if draft else 0))
        for p in prompts]
    generator.run_until_done()
    cost = handles[0].job.drafter.forward_cost if draft else None
    return handles, clock.now, cost


@pytest.mark.parametrize("jobs", [1, 16])
def test_a_draft_model_as_big_as_its_target_is_paused_and_never_slower(
        text_model, monkeypatch, jobs):
    prompts = _prompts(jobs)
    tokens = 96 if jobs == 1 else 40
    plain, plain_ns, _ = _run(text_model, monkeypatch, prompts, tokens)
    # The target's own weights draft (every draft would be kept), yet k draft forwards
    # of a plain step each cannot beat the k + 1 plain steps they replace.
    drafted, drafted_ns, cost = _run(text_model, monkeypatch, prompts, tokens, draft_ns=MS)
    assert [h.token_ids for h in drafted] == [h.token_ids for h in plain]
    # One forward over scratch rows timed it before any draft: paused at once, the
    # next probe ceil(2 / 0.03) tokens later; the run costs that one forward more.
    assert cost.pauses >= 1 and cost.forward_ns(jobs) == MS
    assert all(h.final.draft_count == 0 for h in drafted)
    assert drafted_ns <= plain_ns + 2 * MS


def test_without_a_timing_of_its_own_a_drafter_probes_two_positions(
        text_model, monkeypatch):
    """A batched drafter without `time_forward` drafts PROBE_DRAFTS positions to be
    timed (one forward catches up the prompt, the next is timed), then pauses; its
    probes draft PROBE_DRAFTS positions too."""
    monkeypatch.setattr(ModelDrafter, "time_forward", None)
    prompts = _prompts(1)
    plain, plain_ns, _ = _run(text_model, monkeypatch, prompts, 96)
    drafted, drafted_ns, cost = _run(text_model, monkeypatch, prompts, 96, draft_ns=MS)
    assert [h.token_ids for h in drafted] == [h.token_ids for h in plain]
    # The first draft, and one probe ceil(2 / 0.03) = 67 tokens after it.
    assert drafted[0].final.draft_accepted == drafted[0].final.draft_count == 2 * PROBE_DRAFTS
    assert cost.pauses == 2 and drafted_ns <= plain_ns + 2 * MS


def test_a_cheap_draft_model_keeps_drafting(text_model, monkeypatch):
    prompts = _prompts(1)
    plain, plain_ns, _ = _run(text_model, monkeypatch, prompts, 96)
    drafted, drafted_ns, cost = _run(text_model, monkeypatch, prompts, 96, draft_ns=MS // 10)
    assert [h.token_ids for h in drafted] == [h.token_ids for h in plain]
    assert cost.pauses == 0 and drafted[0].final.draft_accepted >= 70  # of 96
    assert drafted_ns < 0.5 * plain_ns


def test_a_process_that_timed_its_draft_model_once_does_not_draft_where_it_cannot_pay(
        text_model, monkeypatch):
    """A draft forward of 5 plain steps (an eager draft model for a graphed target):
    timed once over 2 jobs (the first request pays one scratch forward), it is not
    drafted with at 1 job or at 16, nor timed again: those runs take the plain steps'
    time exactly."""
    draft = _Clocked(text_model.model, types.SimpleNamespace(now=0), 5 * MS)
    _run(text_model, monkeypatch, _prompts(2), 8, draft=draft)
    for jobs in (1, 16):
        prompts = _prompts(jobs)
        plain, plain_ns, _ = _run(text_model, monkeypatch, prompts, 40)
        drafted, drafted_ns, cost = _run(text_model, monkeypatch, prompts, 40, draft=draft)
        assert [h.token_ids for h in drafted] == [h.token_ids for h in plain]
        assert all(h.final.draft_count == 0 for h in drafted)
        assert drafted_ns == plain_ns
    # The first request timed it (over 2 jobs) and paused; the others paused untimed.
    assert cost.probes == 0 and cost.pauses == 3
    assert cost.forward_ns(1) is None and cost.forward_ns(16) is None


def test_a_request_during_another_requests_pause_does_not_probe(text_model, monkeypatch):
    """The pause is the draft model's, process-wide: a request that arrives while it
    lasts (a daemon's next client) drafts nothing and times nothing, taking exactly the
    plain steps' time. Before, every new request probed at once: one scratch forward
    each (58 ms for the 2.0 bpw SmolLM2 on the H200: 0.70x on a 64-token answer)."""
    draft = _Clocked(text_model.model, types.SimpleNamespace(now=0), MS)
    _run(text_model, monkeypatch, _prompts(1), 8, draft=draft)  # timed once, then paused
    plain, plain_ns, _ = _run(text_model, monkeypatch, _prompts(1), 40)
    drafted, drafted_ns, cost = _run(text_model, monkeypatch, _prompts(1), 40, draft=draft)
    assert [h.token_ids for h in drafted] == [h.token_ids for h in plain]
    assert drafted[0].final.draft_count == 0 and cost.probes == 0
    assert drafted_ns == plain_ns


def test_the_first_decode_step_of_a_drafting_batch_is_a_timed_plain_step(text_model):
    """Without a plain step's time at its batch size no drafting pass could be judged:
    the first decode step is plain (and timed), the next one drafts."""
    from tests.fixtures.drafters import OracleDrafter

    prompt = _prompts(1)[0]
    plain = Generator(text_model.model, text_model.tokenizer, max_batch=1, num_ctx=512,
                      decode_mode="off")
    answer = plain.submit(GenerationJob(prompt, GREEDY, num_predict=12, ignore_eos=True))
    answer.text()
    generator = Generator(text_model.model, text_model.tokenizer, max_batch=1, num_ctx=512,
                          decode_mode="off", draft_cost=True)
    handle = generator.submit(GenerationJob(
        prompt, GREEDY, num_predict=12, ignore_eos=True,
        drafter=OracleDrafter(prompt, answer.token_ids), draft_tokens=4))
    assert generator.step().prefill_tokens == len(prompt)
    assert generator.plain_clock.plain_ns(1) is None
    assert generator.step().draft_tokens == 0
    assert generator.plain_clock.plain_ns(1) is not None
    assert generator.step().draft_tokens == 4
    generator.run_until_done()
    assert handle.token_ids == answer.token_ids
