"""The step after a read-back step (a pass with drafts) is launched before that step's
text work (generation/verify_ahead.py): the text, tokens, counts and stop reasons are
the synchronous path's (`async_step=False`), with stop strings, EOS and budgets met
inside accepted drafts, a cancel while such a step is in flight, and many jobs."""

from __future__ import annotations

import random

import pytest
from exl3_plugins.drafters import NgramDrafter

from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.generation.verify_ahead import VerifyFlight
from exl3cli.errors import InvalidSetting
from tests.fixtures.drafters import OracleDrafter, PeekingDrafter

GREEDY = {"temperature": 0}


def _prompts(count: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(6, 30))] for _ in range(count)]


def _generator(text_model, async_step: bool, max_batch: int = 8) -> Generator:
    return Generator(text_model.model, text_model.tokenizer, max_batch=max_batch,
                     num_ctx=512, decode_mode="static", draft_cost=False,
                     async_step=async_step)


def _answers(text_model, prompts, tokens: int) -> list[list[int]]:
    generator = _generator(text_model, False)
    handles = [generator.submit(GenerationJob(p, GREEDY, num_predict=tokens, ignore_eos=True))
               for p in prompts]
    generator.run_until_done()
    return [h.token_ids for h in handles]


def _run(text_model, jobs, async_step: bool, cancel_at: int | None = None):
    """(per job: token ids, text, done_reason, eval_count, drafts kept; the generator)."""
    generator = _generator(text_model, async_step)
    handles = [generator.submit(job) for job in jobs]
    steps = 0
    while generator.has_work:
        generator.step()
        steps += 1
        if steps == cancel_at:
            assert isinstance(generator._flight, VerifyFlight)  # its rows in flight
            generator.cancel(handles[0])
    assert generator.pool.pages_in_use == 0 and generator.pool.reserved == 0
    assert generator._flight is None and generator._gathered is None  # nothing left over
    results = [(h.token_ids, "".join(e.text for e in h.events.queue),
                h.final.done_reason, h.final.eval_count, h.final.draft_accepted)
               for h in handles]
    return results, generator


def _drafting(prompts, answers, tokens: int, **kwargs) -> list[GenerationJob]:
    return [GenerationJob(p, GREEDY, num_predict=tokens, drafter=OracleDrafter(p, a),
                          draft_tokens=3, **kwargs)
            for p, a in zip(prompts, answers, strict=True)]


def test_drafting_passes_launch_before_the_text_work_with_the_same_results(text_model):
    prompts = _prompts(6)
    answers = _answers(text_model, prompts, 40)
    jobs = _drafting(prompts, answers, 40, ignore_eos=True)
    expected, sync = _run(text_model, jobs, False)
    got, ahead = _run(text_model, _drafting(prompts, answers, 40, ignore_eos=True), True)
    assert got == expected
    assert [r[0] for r in got] == answers and all(r[4] > 20 for r in got)
    assert sync.launched_before_text == 0
    assert ahead.launched_before_text >= 8  # every pass but those where a job ends


def test_a_stop_string_inside_accepted_drafts_ends_the_job_there(text_model):
    prompts = _prompts(3, seed=8)
    answers = _answers(text_model, prompts, 30)
    text = text_model.tokenizer.decode(answers[1])
    stop = text[len(text) // 2: len(text) // 2 + 2]

    def jobs():
        return [GenerationJob(p, GREEDY, num_predict=30, ignore_eos=True,
                              drafter=OracleDrafter(p, a), draft_tokens=4,
                              stop=[stop] if i == 1 else [])
                for i, (p, a) in enumerate(zip(prompts, answers, strict=True))]

    expected, _ = _run(text_model, jobs(), False)
    got, ahead = _run(text_model, jobs(), True)
    assert got == expected and ahead.launched_before_text > 0
    assert got[1][2] == "stop" and got[1][3] < 30 and stop not in got[1][1]
    assert [r[2] for r in (got[0], got[2])] == ["length", "length"]


def test_eos_and_budgets_inside_drafts_take_the_synchronous_path(text_model, monkeypatch):
    prompts = _prompts(3, seed=11)
    answers = _answers(text_model, prompts, 24)
    monkeypatch.setattr(text_model.tokenizer, "eos_token_ids", {answers[0][9]})

    def jobs():
        return [GenerationJob(p, GREEDY, num_predict=n, drafter=OracleDrafter(p, a),
                              draft_tokens=4)
                for p, a, n in zip(prompts, answers, (24, 24, 13), strict=True)]

    expected, _ = _run(text_model, jobs(), False)
    got, ahead = _run(text_model, jobs(), True)
    assert got == expected and ahead.launched_before_text > 0
    assert got[0][2] == "stop" and got[0][3] <= 10
    assert got[2][2] == "length" and got[2][3] == 13


def test_a_job_cancelled_with_a_pass_in_flight_harms_no_one(text_model):
    prompts = _prompts(4, seed=5)
    answers = _answers(text_model, prompts, 40)
    expected, _ = _run(text_model, _drafting(prompts, answers, 40, ignore_eos=True), False)
    got, ahead = _run(text_model, _drafting(prompts, answers, 40, ignore_eos=True), True,
                      cancel_at=4)
    assert ahead.launched_before_text > 0
    assert got[0][2] == "stop" and got[0][3] < 40  # cancelled
    assert got[1:] == expected[1:]


def test_sixteen_jobs_some_drafting_some_not(text_model):
    prompts = _prompts(16, seed=21)
    answers = _answers(text_model, prompts, 32)

    def jobs():
        return [GenerationJob(p, GREEDY, num_predict=32, ignore_eos=True,
                              drafter=OracleDrafter(p, a) if i % 2 else None,
                              draft_tokens=3 if i % 2 else 0)
                for i, (p, a) in enumerate(zip(prompts, answers, strict=True))]

    generator = _generator(text_model, True, max_batch=16)
    handles = [generator.submit(job) for job in jobs()]
    generator.run_until_done()
    assert [h.token_ids for h in handles] == answers
    assert generator.launched_before_text > 5


def test_a_landing_whose_peek_finds_a_draft_launches_the_pass_before_its_text(text_model):
    """Plain steps in flight, then a drafter's peek finds something: the landing takes
    its tokens, launches the pass with drafts, and only then does its text work."""
    prompts = _prompts(3, seed=9)
    answers = _answers(text_model, prompts, 60)

    def jobs():
        return [GenerationJob(p, GREEDY, num_predict=60, ignore_eos=True, draft_tokens=4,
                          drafter=PeekingDrafter(p, a, hits=range(20, 40)))
            for p, a in zip(prompts, answers, strict=True)]


    expected, _ = _run(text_model, jobs(), False)
    got, ahead = _run(text_model, jobs(), True)
    assert got == expected and [r[0] for r in got] == answers
    assert all(r[4] >= 12 for r in got) and ahead.launched_ahead > 20
    assert ahead.launched_before_text >= 3


def test_the_ngram_drafter_on_repeating_text_gives_the_synchronous_results(text_model):
    rng = random.Random(4)
    passages = [[rng.randrange(3, 300) for _ in range(12)] for _ in range(4)]
    prompts = [p * 3 for p in passages]  # text that repeats: the n-gram drafter drafts

    def jobs():
        return [GenerationJob(p, GREEDY, num_predict=48, ignore_eos=True,
                              drafter=NgramDrafter(), draft_tokens=4) for p in prompts]

    expected, _ = _run(text_model, jobs(), False)
    got, ahead = _run(text_model, jobs(), True)
    # (the drafts kept may differ: steps in flight find a repetition a token late)
    assert [r[:4] for r in got] == [r[:4] for r in expected]
    assert sum(r[4] for r in got) > 0 and ahead.launched_before_text > 0


def test_the_switch(text_model, monkeypatch):
    prompts = _prompts(2, seed=13)
    answers = _answers(text_model, prompts, 20)
    monkeypatch.setenv("EXL3_VERIFY_AHEAD", "0")
    got, off = _run(text_model, _drafting(prompts, answers, 20, ignore_eos=True), True)
    assert off.launched_before_text == 0 and [r[0] for r in got] == answers
    monkeypatch.setenv("EXL3_VERIFY_AHEAD", "later")
    with pytest.raises(InvalidSetting, match="EXL3_VERIFY_AHEAD"):
        _generator(text_model, True)


def test_a_lone_job_stopped_by_its_text_leaves_no_step_behind(text_model):
    (prompt,) = _prompts(1, seed=8)
    (answer,) = _answers(text_model, [prompt], 30)
    text = text_model.tokenizer.decode(answer)
    stop = text[len(text) // 2: len(text) // 2 + 2]

    def jobs():
        return [GenerationJob(prompt, GREEDY, num_predict=30, ignore_eos=True, stop=[stop],
                              drafter=OracleDrafter(prompt, answer), draft_tokens=4)]

    expected, _ = _run(text_model, jobs(), False)
    got, ahead = _run(text_model, jobs(), True)  # _run: no flight or gathered step left
    assert got == expected and got[0][2] == "stop" and ahead.launched_before_text > 0
