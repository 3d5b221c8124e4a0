"""The generator's fixed-shape decode step (engine/generation/decode_step.py) against its general
paged path, on the CPU ("static" mode: exactly what a CUDA graph replays, run eagerly).

Both paths must give the same greedy tokens for concurrent jobs that join and leave
mid-way, cross page boundaries, and run in buckets with padding rows; for every cache
type; and for Gemma's sliding windows and soft-caps.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from exl3cli.engine.generation.decode_step import MAX_CAPTURE_FAILURES, DecodeRunner, bucket
from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.generation.textmodel import TextModel
from exl3cli.engine.kvcache.paged_attention import PagedBatch
from exl3cli.engine.kvcache.paged_cache import PagePool, PageTable
from tests.fixtures.tiny_model import write_tiny_model
from tests.fixtures.tiny_tokenizer import write_tiny_tokenizer

GREEDY = {"temperature": 0}


def _jobs(seed: int, count: int, page_size: int) -> list[GenerationJob]:
    rng = random.Random(seed)
    jobs = []
    for _ in range(count):
        # Prompts ending just before, at and after page boundaries.
        length = rng.choice([page_size - 2, page_size, page_size + 3, 2 * page_size - 1,
                             rng.randrange(3, 3 * page_size)])
        jobs.append(GenerationJob([rng.randrange(3, 300) for _ in range(length)], GREEDY,
                                  num_predict=rng.randrange(3, 12)))
    return jobs


def _run(model: TextModel, jobs: list[GenerationJob], mode: str, late: int, **settings):
    generator = Generator(model.model, model.tokenizer, decode_mode=mode, **settings)
    assert generator.decode.mode == mode
    handles = [generator.submit(job) for job in jobs[:-late]]
    for _ in range(4):
        generator.step()
    handles += [generator.submit(job) for job in jobs[-late:]]  # join mid-way
    generator.run_until_done()
    assert generator.pool.pages_in_use == 0
    return [handle.token_ids for handle in handles], generator


@pytest.mark.parametrize("cache", ["fp16", "q8", "q4", "k8v4"])
def test_fixed_step_gives_the_general_paths_tokens(text_model, cache):
    jobs = _jobs(3, 7, 256)
    settings = {"max_batch": 5, "num_ctx": 1024, "kv_cache_type": cache,
                "max_prefill_tokens": 200}
    expected, _ = _run(text_model, jobs, "off", 2, **settings)
    got, generator = _run(text_model, jobs, "static", 2, **settings)
    assert got == expected
    # Several buckets were used: batch padding and more than one page count.
    assert len(generator.decode._steps) >= 3


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma2-decode")
    write_tiny_model(folder, "gemma2", max_position_embeddings=1024,
                     attn_logit_softcapping=3.0, final_logit_softcapping=5.0)
    write_tiny_tokenizer(folder)
    return TextModel.load(folder, device="cpu")


def test_fixed_step_sliding_window_and_softcap(gemma):
    jobs = _jobs(4, 4, 256)
    settings = {"max_batch": 4, "num_ctx": 1024}
    expected, _ = _run(gemma, jobs, "off", 1, **settings)
    got, _ = _run(gemma, jobs, "static", 1, **settings)
    assert got == expected


def test_padding_rows_touch_only_the_scratch_page(text_model):
    model = text_model.model
    config = model.config
    pool = PagePool(6, len(model.layers), config.num_kv_heads, config.head_dim, model.dtype,
                    model.device)
    runner = DecodeRunner(model, pool, max_batch=4, num_ctx=512, mode="static")
    tables = []
    for prompt in ([5, 6, 7], [1, 2], [8] * 255):  # the third fills its page
        table = PageTable(pool)
        assert table.admit(prompt, 300)
        model.forward(torch.tensor([prompt]), PagedBatch(pool, [table], [prompt]))
        tables.append(table)
    snapshot = [keys.clone() for keys in pool.keys]
    logits = runner.run([(table, 9) for table in tables])  # 3 rows: a bucket of 4
    for table in tables:
        table.commit([9])
    assert logits.shape == (3, config.vocab_size)
    assert list(runner._steps) == [(4, 1)]
    size = pool.page_size
    written = {tables[0].pages[0] * size + 3, tables[1].pages[0] * size + 2,
               tables[2].pages[0] * size + 255}
    for layer, keys in enumerate(pool.keys):
        changed = set((keys != snapshot[layer]).flatten(1).any(-1).nonzero().flatten().tolist())
        assert written <= changed <= written | {pool.scratch_page * size}
    assert [table.length for table in tables] == [4, 3, 256]
    # The same step again: the third table's next token starts its second page.
    runner.run([(table, 10) for table in tables])
    for table in tables:
        table.commit([10])
    assert len(tables[2].pages) == 2 and tables[2].length == 257
    assert list(runner._steps) == [(4, 1), (4, 2)]


def test_bucket_sizes():
    assert [bucket(n, 64) for n in (1, 2, 3, 5, 16, 17, 64)] == [1, 2, 4, 8, 16, 32, 64]
    assert bucket(5, 6) == 6 and bucket(6, 6) == 6  # capped at the limit, never below n


def test_steps_launched_ahead_stop_where_the_general_path_stops(text_model):
    """Stop strings, EOS-less budgets and a cancel while a step is in flight: the
    pipelined decode (each step launched before the previous one's tokens are read)
    ends every job exactly where the general path does."""
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 40, 300)]
    plain = Generator(text_model.model, text_model.tokenizer, decode_mode="off", num_ctx=1024)
    texts = []
    for prompt in prompts:
        handle = plain.submit(GenerationJob(prompt, GREEDY, num_predict=30))
        texts.append(handle.text())
    stops = [text[len(text) // 2 : len(text) // 2 + 3] for text in texts]
    jobs = [GenerationJob(p, GREEDY, num_predict=30, stop=[stop]) for p, stop in zip(
        prompts, stops, strict=True)]
    expected = []
    for job in jobs:
        handle = plain.submit(job)
        expected.append((handle.text(), handle.final.done_reason, handle.final.eval_count))
    ahead = Generator(text_model.model, text_model.tokenizer, decode_mode="static",
                      num_ctx=1024, max_batch=4)
    handles = [ahead.submit(job) for job in jobs]
    doomed = ahead.submit(GenerationJob(prompts[0], GREEDY, num_predict=50))
    for _ in range(6):
        ahead.step()
    assert ahead._flight is not None  # a step is in flight while the host works
    doomed.cancel()
    ahead.run_until_done()
    got = [(h.text(), h.final.done_reason, h.final.eval_count) for h in handles]
    assert got == expected
    assert doomed.final.cancelled
    while ahead._flight is not None:
        ahead.step()
    assert ahead.pool.pages_in_use == 0


def test_graph_captures_of_two_runners_never_overlap(text_model, monkeypatch):
    # Two models' generators in two threads (`exl3 serve` with two loaded): torch.cuda.graph
    # synchronizes the device and empties the allocator's cache as a capture begins, which
    # breaks a capture another thread has open, so captures take a process-wide lock.
    # Here the capture itself is stood in for (no CUDA): each holds the lock, never two at once.
    runners = [Generator(text_model.model, text_model.tokenizer, decode_mode="static",
                         max_batch=2, num_ctx=256).decode for _ in range(2)]
    open_now, most, started = [0], [0], threading.Barrier(2)
    guard = threading.Lock()

    def stand_in(self, step):
        with guard:
            open_now[0] += 1
            most[0] = max(most[0], open_now[0])
        time.sleep(0.05)
        with guard:
            open_now[0] -= 1
        return ("graph", step), torch.zeros(1)

    monkeypatch.setattr(DecodeRunner, "_capture_alone", stand_in)

    def capture(runner: DecodeRunner) -> None:
        started.wait()
        for key in range(4):
            assert runner._capture((1, key), key) is not None

    threads = [threading.Thread(target=capture, args=(r,)) for r in runners]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert most[0] == 1
    assert [r.captures for r in runners] == [4, 4]
    assert [r.capture_failures for r in runners] == [0, 0]


def test_a_failed_capture_leaves_only_its_bucket_without_a_graph(text_model, monkeypatch):
    # Captures stood in for (no CUDA): the bucket whose capture failed runs eagerly from
    # then on and is not captured again; other buckets keep their graphs; after
    # MAX_CAPTURE_FAILURES failures the runner stops capturing ("static").
    runner = Generator(text_model.model, text_model.tokenizer, decode_mode="static",
                       max_batch=8, num_ctx=256).decode
    runner.mode, runner._rope_version = "graph", runner._version()
    attempts: list[tuple[int, int]] = []
    replays, eager = [0], [0]

    class Graph:
        def replay(self) -> None:
            replays[0] += 1

    def stand_in(self, key):
        attempts.append(key)
        if key[0] != 2:
            raise RuntimeError("operation not permitted when stream is capturing")
        return Graph(), torch.ones(1)

    def forward(key):
        eager[0] += 1
        return torch.zeros(1)

    monkeypatch.setattr(DecodeRunner, "_capture_alone", stand_in)
    monkeypatch.setattr(runner, "_forward", forward)
    assert runner._replay((1, 1), (1, 1)).item() == 0  # failed: this step eagerly
    assert runner._replay((1, 1), (1, 1)).item() == 0  # not captured again
    assert runner._replay((2, 1), (2, 1)).item() == 1  # another bucket: its graph
    assert runner._replay((2, 1), (2, 1)).item() == 1
    assert (attempts, replays[0], eager[0]) == ([(1, 1), (2, 1)], 2, 2)
    assert runner.mode == "graph" and runner.capture_failures == 1
    runner._replay((4, 1), (4, 1))
    assert runner.mode == "graph"
    runner._replay((8, 1), (8, 1))
    assert runner.capture_failures == MAX_CAPTURE_FAILURES == 3 and runner.mode == "static"
