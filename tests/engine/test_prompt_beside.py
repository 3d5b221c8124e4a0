"""A prompt's last tokens beside decoding jobs, in one fixed-shape step
(step_forward.prompt_beside), on the CPU: the "static" step is what a CUDA graph
replays. A refilling queue (jobs admitted while others decode) must give every job the
tokens the general path gives it, return every page, and still send prompts that do not
fit the step's rows down the general path."""

from __future__ import annotations

import random

import pytest

from exl3cli.engine.generation import step_forward
from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.errors import InvalidSetting

GREEDY = {"temperature": 0}


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]


def _queue(text_model, prompts, budgets, monkeypatch, beside: bool, drafts: bool = False,
           max_rows: int | None = None):
    """Every job through a 3-slot generator; returns (token ids, fixed-shape steps that
    took prompt tokens, general-path steps that took prompt tokens beside decode rows)."""
    monkeypatch.setenv("EXL3_PROMPT_BESIDE", "1" if beside else "0")
    calls = {"fixed": 0, "general": 0}
    fixed, general = step_forward.forward_fixed, step_forward.PagedBatch

    def counted_fixed(decode, fed):
        calls["fixed"] += any(active.prefilling for active, _ in fed)
        return fixed(decode, fed)

    def counted_general(pool, tables, tokens):  # prompt chunks beside decode rows
        calls["general"] += any(len(t) > 1 for t in tokens) and any(len(t) == 1 for t in tokens)
        return general(pool, tables, tokens)

    monkeypatch.setattr(step_forward, "forward_fixed", counted_fixed)
    monkeypatch.setattr(step_forward, "PagedBatch", counted_general)
    generator = Generator(text_model.model, text_model.tokenizer, max_batch=3, num_ctx=512,
                          decode_mode="static", draft_cost=False)
    if max_rows is not None:
        generator.decode.max_rows = max_rows
    before = generator.pool.available
    from exl3cli.engine.generation.speculative import make_drafter

    handles = [generator.submit(GenerationJob(
        p, GREEDY, num_predict=n, ignore_eos=True,
        drafter=make_drafter("ngram:2") if drafts else None, draft_tokens=3 if drafts else 0))
        for p, n in zip(prompts, budgets, strict=True)]
    generator.run_until_done()
    while generator._flight is not None:
        generator.step()
    assert generator.pool.pages_in_use == 0 and generator.pool.available == before
    return [h.token_ids for h in handles], calls["fixed"], calls["general"]


def test_short_prompts_ride_beside_decode_rows_with_the_same_text(text_model, monkeypatch):
    # Short prompts and budgets that end at different steps: jobs join one at a time.
    prompts = _prompts(3, [9, 14, 6, 11, 20, 7, 13])
    budgets = [12, 30, 18, 25, 9, 22, 16]
    want, fixed, general = _queue(text_model, prompts, budgets, monkeypatch, beside=False)
    assert fixed == 0 and general > 0  # before: every admission took the general path
    got, fixed, general = _queue(text_model, prompts, budgets, monkeypatch, beside=True)
    assert got == want
    assert fixed >= 4  # the four jobs admitted while others decode
    assert general == 0


def test_drafting_jobs_and_prompts_share_a_fixed_step(text_model, monkeypatch):
    base = _prompts(5, [10, 12, 8])
    prompts = [p * 3 for p in base] + [p * 2 for p in base]  # repeats: n-gram drafts
    budgets = [20, 34, 26, 30, 18, 24]
    want, _, _ = _queue(text_model, prompts, budgets, monkeypatch, beside=False)
    got, fixed, _ = _queue(text_model, prompts, budgets, monkeypatch, beside=True,
                           drafts=True)
    assert got == want and fixed >= 2


def test_a_longer_prompt_rides_in_chunks_and_a_long_one_takes_the_general_path(
        text_model, monkeypatch):
    rows = Generator(text_model.model, text_model.tokenizer, max_batch=3, num_ctx=512,
                     decode_mode="static").decode.max_rows
    assert rows < 150 <= step_forward.BESIDE_MAX_PROMPT < 300
    # The fourth job joins with 150 tokens: more than one step's rows, in chunks.
    prompts = _prompts(7, [8, 9, 7, 150])
    budgets = [10, 60, 40, 10]
    want, _, _ = _queue(text_model, prompts, budgets, monkeypatch, beside=False)
    got, fixed, general = _queue(text_model, prompts, budgets, monkeypatch, beside=True)
    assert got == want and general == 0 and fixed >= 150 // rows + 1
    # With 300 tokens it is one chunk on the general path, as before.
    prompts = _prompts(8, [8, 9, 7, 300])
    want, _, general_before = _queue(text_model, prompts, budgets, monkeypatch, beside=False)
    got, fixed, general = _queue(text_model, prompts, budgets, monkeypatch, beside=True)
    assert got == want and general == general_before == 1 and fixed == 0


def test_short_prompts_waiting_together_ride_beside_in_turn(text_model, monkeypatch):
    """Two jobs end at one step and two 150-token prompts wait: 300 tokens together, more
    than BESIDE_MAX_PROMPT, but each is short, so they ride beside the decoding job one
    after the other (Generator.beside_in_turn) instead of one general-path step;
    EXL3_BESIDE_IN_TURN=0 restores that step."""
    assert 150 <= step_forward.BESIDE_MAX_PROMPT < 300
    prompts = _prompts(11, [8, 9, 7, 150, 150])
    budgets = [70, 10, 10, 12, 12]  # the second and third end together
    want, _, _ = _queue(text_model, prompts, budgets, monkeypatch, beside=False)
    got, fixed, general = _queue(text_model, prompts, budgets, monkeypatch, beside=True)
    assert got == want and general == 0 and fixed >= 300 // 64
    monkeypatch.setenv("EXL3_BESIDE_IN_TURN", "0")
    got, fixed, general = _queue(text_model, prompts, budgets, monkeypatch, beside=True)
    assert got == want and general == 1


def test_a_long_prompt_behind_short_ones_waits_for_a_general_step_of_its_own(
        text_model, monkeypatch):
    """A short prompt rides beside; the 300-token one behind it is not cut into a
    beside step's leftover rows (which would send that step down the general path with
    both): it takes the general path once it is first."""
    prompts = _prompts(12, [8, 9, 7, 40, 300])
    budgets = [70, 10, 10, 12, 12]
    want, _, _ = _queue(text_model, prompts, budgets, monkeypatch, beside=False)
    got, fixed, general = _queue(text_model, prompts, budgets, monkeypatch, beside=True)
    assert got == want and fixed >= 1 and general == 1


def test_a_prompt_that_would_trickle_in_over_many_steps_takes_the_general_path(
        text_model, monkeypatch):
    """With 12 rows and 2 jobs decoding, 10 rows are left: 40 prompt tokens ride in 4
    steps; 41 would need 5 (Generator.BESIDE_STEPS = 4) and take the general path."""
    from exl3cli.engine.generation.generator import BESIDE_STEPS

    assert BESIDE_STEPS == 4
    for length, rides in ((40, True), (41, False)):
        prompts = _prompts(length, [8, 9, 7, length])
        budgets = [6, 80, 80, 10]  # the fourth joins after the first, beside two jobs
        want, _, _ = _queue(text_model, prompts, budgets, monkeypatch, beside=False,
                            max_rows=12)
        got, fixed, general = _queue(text_model, prompts, budgets, monkeypatch, beside=True,
                                     max_rows=12)
        assert got == want
        assert (fixed, general) == ((4, 0) if rides else (0, 1)), (length, fixed, general)


def test_a_bad_setting_is_refused_when_the_generator_is_made(text_model, monkeypatch):
    monkeypatch.setenv("EXL3_PROMPT_BESIDE", "sometimes")
    with pytest.raises(InvalidSetting, match="EXL3_PROMPT_BESIDE"):
        Generator(text_model.model, text_model.tokenizer, max_batch=2, num_ctx=256,
                  decode_mode="static")


class OracleDrafter:
    """Proposes what the plain run said next (every draft is kept): rows fill up."""

    def __init__(self, prompt, answer):
        self.prompt, self.answer = list(prompt), list(answer)

    def propose(self, history, count):
        done = len(history) - len(self.prompt)
        return self.answer[done:done + count]


def test_drafts_are_shortened_so_a_short_prompt_rest_rides_with_them(text_model,
                                                                     monkeypatch):
    """Drafting jobs fill the step's rows; a job joining with a short prompt then took
    the general path (run 13 on the H200: 16 jobs x 5 rows leave no room in 64). Now
    the drafts are cut to leave the prompt its rows, and the text stays plain greedy's."""
    prompts = _prompts(11, [9, 7, 10, 5])
    budgets = [40, 6, 40, 30]
    want, _, _ = _queue(text_model, prompts, budgets, monkeypatch, beside=False)

    fixed = step_forward.forward_fixed
    shared = {"steps": 0}

    def counted_fixed(decode, fed):  # fixed-shape steps with a prompt chunk and drafts
        shared["steps"] += (any(active.prefilling for active, _ in fed)
                            and any(active.verifying for active, _ in fed))
        return fixed(decode, fed)

    monkeypatch.setattr(step_forward, "forward_fixed", counted_fixed)

    def run(beside: bool):
        monkeypatch.setenv("EXL3_PROMPT_BESIDE", "1" if beside else "0")
        shared["steps"] = 0
        generator = Generator(text_model.model, text_model.tokenizer, max_batch=3,
                              num_ctx=512, decode_mode="static", draft_cost=False)
        generator.decode.max_rows = 12  # 3 jobs x (1 + 3 drafts): a full step
        handles = [generator.submit(GenerationJob(
            p, GREEDY, num_predict=n, ignore_eos=True, drafter=OracleDrafter(p, a),
            draft_tokens=3)) for p, a, n in zip(prompts, want, budgets, strict=True)]
        while generator.has_work or generator._flight is not None:
            generator.step()
        assert generator.pool.pages_in_use == 0
        assert sum(h.final.draft_accepted for h in handles) > 20
        return [h.token_ids for h in handles], shared["steps"]

    got, beside_steps = run(True)
    assert got == want and beside_steps >= 1
    got, beside_steps = run(False)
    assert got == want and beside_steps == 0
