"""Verification passes (speculative decoding) on the fixed-shape decode step: a job
verifying k drafts feeds 1 + k rows of one page table (decode_step.DecodeRunner.run_feeds).
On the CPU "static" mode runs exactly the step a CUDA graph replays; its greedy tokens
must equal the general path's ("off") and plain decoding's, float32, for mixed batches
(verifying, plain and draftless jobs; jobs joining and leaving; drafts across page
boundaries), and nothing but accepted tokens may reach the page tables."""

from __future__ import annotations

import random

import pytest
import torch

from exl3cli.engine.generation.decode_step import DecodeRunner
from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.generation.speculative import VerifyingBatch, make_drafter
from exl3cli.engine.kvcache.paged_attention import PagedBatch
from exl3cli.engine.kvcache.paged_cache import PagePool, PageTable
from tests.fixtures.drafters import OracleDrafter

GREEDY = {"temperature": 0}


class _Nothing:
    """A drafter that never proposes: its job feeds one token a step."""

    def propose(self, history: list[int], count: int) -> list[int]:
        return []


def _prompts(seed: int, count: int) -> list[list[int]]:
    # Repetitive prompts (the ngram drafter finds matches), some ending near a page
    # boundary (256) so that a pass's drafts cross into the next page.
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        phrase = [rng.randrange(3, 400) for _ in range(rng.randrange(3, 10))]
        body = phrase * rng.randrange(2, 5)
        if i % 3 == 0:
            filler = [rng.randrange(3, 400) for _ in range(253 - len(body))]
            body = filler + body
        prompts.append(body + phrase[:2])
    return prompts


def _jobs(prompts, drafted: bool) -> list[GenerationJob]:
    jobs = []
    for i, prompt in enumerate(prompts):
        drafter = None
        if drafted and i % 4 != 3:  # every fourth job decodes plainly
            drafter = _Nothing() if i % 4 == 2 else make_drafter("ngram")
        jobs.append(GenerationJob(prompt, GREEDY, num_predict=12 + 7 * (i % 5),
                                  drafter=drafter, draft_tokens=4 if drafter else 0))
    return jobs


def _run(text_model, jobs, mode: str, late: int = 2, **settings):
    generator = Generator(text_model.model, text_model.tokenizer, num_ctx=1024,
                          decode_mode=mode, draft_cost=False, **settings)
    assert generator.decode.mode == mode
    paths = {"fixed": 0, "general": 0}
    run_feeds, forward = generator.decode.run_feeds, generator.model.forward

    def counted_feeds(feeds):
        paths["fixed"] += 1
        return run_feeds(feeds)

    def counted_forward(ids, cache=None, **kwargs):
        paths["general"] += isinstance(cache, VerifyingBatch)
        return forward(ids, cache, **kwargs)

    generator.decode.run_feeds = counted_feeds
    generator.model.forward = counted_forward
    try:
        handles = [generator.submit(job) for job in jobs[:-late]]
        prefill_steps = 0
        for _ in range(3):
            prefill_steps += generator.step().prefill_tokens > 0
        handles += [generator.submit(job) for job in jobs[-late:]]  # join mid-way
        while generator.has_work:
            prefill_steps += generator.step().prefill_tokens > 0
    finally:
        del generator.model.forward
    assert generator.pool.pages_in_use == 0
    return [h.token_ids for h in handles], paths, prefill_steps, handles


@pytest.mark.parametrize("cache", ["fp16", "q4"])
def test_fixed_verify_gives_the_general_paths_and_plain_tokens(text_model, cache):
    prompts = _prompts(5, 9)
    settings = {"max_batch": 6, "kv_cache_type": cache, "max_prefill_tokens": 300}
    plain, _, _, _ = _run(text_model, _jobs(prompts, False), "off", **settings)
    general, general_paths, _, _ = _run(text_model, _jobs(prompts, True), "off", **settings)
    fixed, paths, prefill_steps, handles = _run(text_model, _jobs(prompts, True), "static",
                                                **settings)
    assert general == plain and fixed == plain
    assert general_paths["fixed"] == 0 and general_paths["general"] > 0
    # Verify passes ran on the fixed-shape step; the general path only took the steps
    # where a joining job's prompt came in alongside.
    assert paths["fixed"] > paths["general"] and paths["general"] <= prefill_steps
    assert sum(h.final.draft_accepted for h in handles) > 0


def test_verify_rows_of_more_than_max_batch_jobs_use_row_buckets(text_model):
    prompts = _prompts(6, 3)
    jobs = [GenerationJob(p, GREEDY, num_predict=20, drafter=make_drafter("ngram"),
                          draft_tokens=6) for p in prompts]
    want, _, _, _ = _run(text_model, [GenerationJob(p, GREEDY, num_predict=20)
                                      for p in prompts], "off", late=1, max_batch=3)
    got, paths, _, _ = _run(text_model, jobs, "static", late=1, max_batch=3)
    assert got == want and paths["fixed"] > 0


def test_run_feeds_writes_every_row_and_commits_nothing(text_model):
    model = text_model.model
    config = model.config
    pool = PagePool(6, len(model.layers), config.num_kv_heads, config.head_dim, model.dtype,
                    model.device)
    runner = DecodeRunner(model, pool, max_batch=2, num_ctx=1024, mode="static")
    prompts = ([5, 6, 7], [8] * 254)  # the second one's drafts cross into its next page
    tables = []
    for prompt in prompts:
        table = PageTable(pool)
        assert table.admit(prompt, 300)
        model.forward(torch.tensor([prompt]), PagedBatch(pool, [table], [prompt]))
        tables.append(table)
    feeds = [(tables[0], [9, 10]), (tables[1], [11, 12, 13, 14])]
    snapshot = [keys.clone() for keys in pool.keys]
    logits = runner.run_feeds(feeds)
    assert logits.shape == (6, config.vocab_size)
    assert [t.length for t in tables] == [3, 254]  # nothing committed
    assert len(tables[1].pages) == 2  # the page of position 256 was allocated first
    size = pool.page_size
    written = {tables[0].pages[0] * size + 3, tables[0].pages[0] * size + 4}
    written |= {tables[1].all_slots(258)[p] for p in range(254, 258)}
    for layer, keys in enumerate(pool.keys):
        changed = set((keys != snapshot[layer]).flatten(1).any(-1).nonzero().flatten().tolist())
        assert written <= changed <= written | {pool.scratch_page * size}
    # Row j's logits are those of the general path fed the same tokens.
    expected = []
    for table, tokens in feeds:
        batch = VerifyingBatch(pool, [table], [tokens], [True])
        expected.append(model.forward(torch.tensor([tokens]), batch, last_logits_only=True)[0])
    torch.testing.assert_close(logits, torch.cat(expected), rtol=1e-4, atol=1e-4)
    assert [t.length for t in tables] == [3, 254]


def test_drafts_are_shortened_so_a_pass_fits_the_fixed_step(text_model):
    prompts = _prompts(7, 3)
    want, _, _, _ = _run(text_model, [GenerationJob(p, GREEDY, num_predict=24)
                                      for p in prompts], "off", late=1, max_batch=3)
    generator = Generator(text_model.model, text_model.tokenizer, num_ctx=1024, max_batch=3,
                          decode_mode="static", draft_cost=False)
    generator.decode.max_rows = 8  # 3 jobs of 1 + 6 tokens would be 21 rows
    handles = [generator.submit(GenerationJob(p, GREEDY, num_predict=24,
                                              drafter=OracleDrafter(p, answer), draft_tokens=6))
               for p, answer in zip(prompts, want, strict=True)]
    rows = []
    while generator.has_work:
        report = generator.step()
        if report.draft_tokens and not report.prefill_tokens:
            rows.append(report.decode_tokens + report.draft_tokens)
    assert [h.token_ids for h in handles] == want
    assert rows and max(rows) == 8  # shortened to fit, never over
    assert all(h.final.draft_accepted == h.final.draft_count for h in handles)


@pytest.mark.cuda
def test_graph_mode_is_kept_with_drafting_jobs_and_gives_offs_tokens(tmp_path):
    """On the GPU verification passes replay CUDA graphs (keyed by row count like decode
    steps); float32 activations, so both paths differ in summation order only."""
    from exl3cli.convert.synthetic import write_synthetic_model
    from exl3cli.engine.models.loader import load_causal_lm
    from exl3cli.engine.text.tokenizer import Tokenizer

    folder = write_synthetic_model(tmp_path / "tiny", "tiny", bits=4.0, seed=3)
    model = load_causal_lm(folder, device="cuda", dtype=torch.float32)
    tokenizer = Tokenizer.from_folder(folder)
    rng = random.Random(4)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(10, vocab // 2) for _ in range(length)]
               for length in (3, 40, 250, 300)]

    def run(mode: str, answers=None):
        generator = Generator(model, tokenizer, num_ctx=1024, max_batch=4, decode_mode=mode,
                              draft_cost=False)
        feeds = []
        run_feeds = generator.decode.run_feeds
        generator.decode.run_feeds = lambda f: feeds.append(len(f)) or run_feeds(f)
        handles = [generator.submit(GenerationJob(
            p, GREEDY, num_predict=40, ignore_eos=True,
            drafter=OracleDrafter(p, answers[i]) if answers and i != 1 else None,  # job 1: plain
            draft_tokens=4 if answers and i != 1 else 0)) for i, p in enumerate(prompts)]
        generator.run_until_done()
        assert generator.decode.mode == mode
        return [h.token_ids for h in handles], feeds, generator, handles

    want, _, _, _ = run("off")
    drafted_off, off_feeds, _, _ = run("off", want)
    got, feeds, generator, handles = run("graph", want)
    assert drafted_off == want and got == want
    assert not off_feeds and feeds  # verify passes took the fixed-shape step
    assert generator.decode.mode == "graph" and generator.decode.graph_count >= 3
    assert sum(h.final.draft_accepted for h in handles) > 40
