"""Speculative decoding in the generator: the same text, fewer forward passes."""

from __future__ import annotations

import random

import pytest

from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.generation.speculative import make_drafter
from exl3cli.engine.generation.textmodel import TextModel

GREEDY = {"temperature": 0}


def _prompts(seed: int, count: int) -> list[list[int]]:
    # Repetitive prompts (a phrase said several times), as in quoting or editing: the
    # ngram drafter has something to find, and greedy answers of a random model loop.
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(3, 400) for _ in range(rng.randrange(3, 12))]
        filler = [rng.randrange(3, 400) for _ in range(rng.randrange(0, 40))]
        prompts.append(filler + phrase * rng.randrange(2, 6) + phrase[: rng.randrange(1, 3)])
    return prompts


def _run(text_model, jobs: list[GenerationJob], max_batch: int):
    # Acceptance-only back-off: pass counts here must not depend on this machine's timing
    # (the cost back-off has its own tests, test_draft_cost.py).
    generator = Generator(text_model.model, text_model.tokenizer, max_batch=max_batch,
                          num_ctx=1024, draft_cost=False)
    before = generator.pool.available
    handles = [generator.submit(job) for job in jobs]
    passes = 0
    while generator.has_work:
        passes += generator.step().jobs > 0
    assert generator.pool.pages_in_use == 0 and generator.pool.available == before
    return handles, passes


def _jobs(prompts, lengths, drafted: bool) -> list[GenerationJob]:
    return [GenerationJob(p, GREEDY, num_predict=n,
                          drafter=make_drafter("ngram") if drafted else None,
                          draft_tokens=4 if drafted else 0)
            for p, n in zip(prompts, lengths, strict=True)]


def test_greedy_text_is_identical_with_and_without_drafts(text_model):
    prompts = _prompts(1, 16)
    lengths = [random.Random(i).randrange(1, 60) for i in range(16)]
    plain, plain_passes = _run(text_model, _jobs(prompts, lengths, False), max_batch=16)
    drafted, drafted_passes = _run(text_model, _jobs(prompts, lengths, True), max_batch=16)
    for a, b in zip(plain, drafted, strict=True):
        assert b.token_ids == a.token_ids
        assert b.final.done_reason == a.final.done_reason
        assert b.final.eval_count == a.final.eval_count
    assert all(h.final.draft_count == 0 for h in plain)
    drafts = sum(h.final.draft_count for h in drafted)
    kept = sum(h.final.draft_accepted for h in drafted)
    assert 0 < kept <= drafts
    # Drafts were kept, so the same text took fewer forward passes.
    assert drafted_passes < plain_passes


def test_each_job_alone_matches_and_drafts_are_accepted(text_model):
    prompts = _prompts(2, 4)
    for prompt in prompts:
        (plain,), plain_passes = _run(text_model, _jobs([prompt], [48], False), 1)
        (drafted,), passes = _run(text_model, _jobs([prompt], [48], True), 1)
        assert drafted.token_ids == plain.token_ids
        assert passes <= plain_passes


def test_jobs_with_and_without_drafts_share_steps(text_model):
    prompts = _prompts(3, 8)
    lengths = [30] * 8
    mixed = [GenerationJob(p, GREEDY, num_predict=30,
                           drafter=make_drafter("ngram:2") if i % 2 else None, draft_tokens=3)
             for i, p in enumerate(prompts)]
    plain, _ = _run(text_model, _jobs(prompts, lengths, False), max_batch=8)
    got, _ = _run(text_model, mixed, max_batch=8)
    assert [h.token_ids for h in got] == [h.token_ids for h in plain]


def test_cancelled_drafting_jobs_return_their_pages(text_model):
    generator = Generator(text_model.model, text_model.tokenizer, max_batch=4, num_ctx=1024)
    before = generator.pool.available
    handles = [generator.submit(job) for job in _jobs(_prompts(4, 4), [200] * 4, True)]
    for _ in range(6):
        generator.step()
    for handle in handles:
        handle.cancel()
    generator.run_until_done()
    assert generator.pool.pages_in_use == 0 and generator.pool.available == before


def test_ngram_jobs_on_the_run_ahead_path_keep_text_and_pages_through_cancels(text_model):
    """n-gram jobs now run ahead between lookups (ahead_step._peeks_dry): with steps in
    flight, some jobs drafting, some cancelled mid-way and new ones admitted, the jobs
    that finish say what plain greedy says and every page comes back."""
    prompts = _prompts(8, 6)
    lengths = [70] * 6
    plain, _ = _run(text_model, _jobs(prompts, lengths, False), max_batch=4)
    generator = Generator(text_model.model, text_model.tokenizer, max_batch=4, num_ctx=1024,
                          decode_mode="static", draft_cost=False)
    before = generator.pool.available
    handles = [generator.submit(job) for job in _jobs(prompts, lengths, True)]
    steps = in_flight = 0
    cancelled: set[int] = set()
    while generator.has_work or generator._flight is not None:
        generator.step()
        steps += 1
        in_flight += generator._flight is not None
        if steps in (9, 23) and not handles[steps % 6].done:
            handles[steps % 6].cancel()  # jobs 3 and 5, whether in flight or not
            cancelled.add(steps % 6)
    assert cancelled
    for i, (got, want) in enumerate(zip(handles, plain, strict=True)):
        if i in cancelled:
            assert got.final.cancelled
            assert got.token_ids == want.token_ids[: len(got.token_ids)]
        else:
            assert got.token_ids == want.token_ids
    assert sum(h.final.draft_accepted for h in handles) > 0 and in_flight > 0
    assert generator.pool.pages_in_use == 0 and generator.pool.available == before


@pytest.mark.slow
def test_smollm2_ngram_drafts_keep_the_text_and_save_passes(tmp_path):
    from exl3cli.store.pull import pull_model
    from exl3cli.store.store import ModelStore

    store = ModelStore(tmp_path / "store")
    pull_model(store, "smollm2")
    model = TextModel.load(store.model_folder("smollm2"), device="cpu")
    passage = ("The quick brown fox jumps over the lazy dog while the farmer watches "
               "from the porch and the sun sets behind the old red barn.")
    asks = [f"Repeat this sentence exactly: {passage}",
            f"Rewrite this sentence with 'cat' instead of 'fox': {passage}",
            "Write a Python function that returns the sum of a list of numbers."]
    prompts = [model.tokenizer.encode(model.chat_template.render([{"role": "user", "content": a}]),
                                      add_bos=False) for a in asks]
    lengths = [40] * len(prompts)
    plain, plain_passes = _run(model, _jobs(prompts, lengths, False), max_batch=3)
    drafted, passes = _run(model, _jobs(prompts, lengths, True), max_batch=3)
    assert [h.token_ids for h in drafted] == [h.token_ids for h in plain]
    kept = sum(h.final.draft_accepted for h in drafted)
    assert kept >= 20  # the repeated passage is drafted from the prompt
    assert passes < plain_passes
