"""The generator on the GPU (`-m cuda`): decode steps replayed from CUDA graphs with the
paged-attention kernel against the generator's general path ("off"), on synthetic EXL3
models (fused GEMM kernels)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from exl3cli.convert.synthetic import write_synthetic_model
from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.text.tokenizer import Tokenizer
from tests.fixtures.beside import count_beside_steps

pytestmark = pytest.mark.cuda
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tiny = write_synthetic_model(tmp_path_factory.mktemp("tiny"), "tiny", bits=4.0, seed=3)
    smol = write_synthetic_model(tmp_path_factory.mktemp("smol"), "smollm2-135m", bits=4.0,
                                 num_layers=2, seed=5)
    return {"tiny": tiny, "smollm2-135m": smol}


def _jobs(vocab: int, count: int, seed: int) -> list[GenerationJob]:
    rng = random.Random(seed)
    return [GenerationJob([rng.randrange(10, vocab // 2) for _ in range(rng.choice(
        [3, 40, 255, 256, 300, 600]))], GREEDY, num_predict=rng.randrange(20, 70),
        ignore_eos=True) for _ in range(count)]


def _run(model, tokenizer, jobs, mode, **settings):
    generator = Generator(model, tokenizer, decode_mode=mode, num_ctx=1024, **settings)
    assert generator.decode.mode == mode
    handles = [generator.submit(job) for job in jobs[:-2]]
    for _ in range(5):
        generator.step()
    handles += [generator.submit(job) for job in jobs[-2:]]
    generator.run_until_done()
    assert generator.pool.pages_in_use == 0
    return [h.token_ids for h in handles], generator


@pytest.fixture
def prompts_apart(monkeypatch):
    """Prompt tokens on the general path only (EXL3_PROMPT_BESIDE=0): a prompt chunk
    riding beside decode rows on the graph step reads the chunk's own keys and values
    back from the cache, as decoding does, where the general path attends to them
    before they are stored, so with a quantized cache the two paths differ by that
    cache's rounding (and the batches of the two modes differ in composition)."""
    monkeypatch.setenv("EXL3_PROMPT_BESIDE", "0")


@pytest.mark.parametrize("cache", ["fp16", "q8"])
def test_graph_steps_give_the_general_paths_tokens_in_float32(folders, cache, prompts_apart):
    # float32 activations: the two paths differ only in summation order.
    model = load_causal_lm(folders["tiny"], device="cuda", dtype=torch.float32)
    tokenizer = Tokenizer.from_folder(folders["tiny"])
    jobs = _jobs(model.config.vocab_size, 7, seed=1)
    want, _ = _run(model, tokenizer, jobs, "off", max_batch=5, kv_cache_type=cache)
    got, generator = _run(model, tokenizer, jobs, "graph", max_batch=5, kv_cache_type=cache)
    assert generator.decode.mode == "graph" and generator.decode.graph_count >= 3
    assert got == want


def test_prompts_beside_decode_rows_on_graph_steps_give_the_general_paths_tokens(
        folders, monkeypatch):
    # float32 and an fp16 cache: a prompt chunk on the graph step (step_forward.
    # prompt_beside) reads back exactly the keys and values the general path used.
    model = load_causal_lm(folders["tiny"], device="cuda", dtype=torch.float32)
    tokenizer = Tokenizer.from_folder(folders["tiny"])
    jobs = _jobs(model.config.vocab_size, 7, seed=1)
    monkeypatch.setenv("EXL3_PROMPT_BESIDE", "0")
    want, _ = _run(model, tokenizer, jobs, "off", max_batch=5)
    monkeypatch.setenv("EXL3_PROMPT_BESIDE", "1")
    beside = count_beside_steps(monkeypatch)
    got, generator = _run(model, tokenizer, jobs, "graph", max_batch=5)
    assert generator.prompt_beside and beside["steps"] > 0
    assert got == want


@pytest.mark.parametrize("cache", ["fp16", "q4", "k8v4"])
def test_graph_steps_with_the_kernels_in_bfloat16(folders, cache, prompts_apart):
    model = load_causal_lm(folders["smollm2-135m"], device="cuda", dtype=torch.bfloat16)
    tokenizer = Tokenizer.from_folder(folders["smollm2-135m"])
    jobs = _jobs(model.config.vocab_size, 6, seed=2)
    want, _ = _run(model, tokenizer, jobs, "off", max_batch=4, kv_cache_type=cache)
    got, generator = _run(model, tokenizer, jobs, "graph", max_batch=4, kv_cache_type=cache)
    assert generator.decode.mode == "graph"
    # bfloat16 and another summation order: greedy paths may part where two logits tie
    # to bfloat16 precision (test_one_step_logits_match_the_general_path bounds the
    # difference); every job runs its full length and starts identically.
    assert [len(g) for g in got] == [job.num_predict for job in jobs]
    assert [w[:1] for w in want] == [g[:1] for g in got]


def test_one_step_logits_match_the_general_path(folders, prompts_apart):
    model = load_causal_lm(folders["smollm2-135m"], device="cuda", dtype=torch.bfloat16)
    tokenizer = Tokenizer.from_folder(folders["smollm2-135m"])
    for cache in ("fp16", "q4"):
        logits = {}
        for mode in ("off", "graph"):
            generator = Generator(model, tokenizer, decode_mode=mode, num_ctx=1024,
                                  max_batch=3, kv_cache_type=cache)
            seen = []
            if mode == "graph":  # decode-only steps go straight to the fixed-shape runner
                run = generator.decode.run

                def spy(rows, ids=None, seen=seen, run=run):
                    logits = run(rows, ids)
                    seen.append(logits.float().clone())
                    return logits

                generator.decode.run = spy
            else:
                forward = generator._forward

                def spy(fed, seen=seen, forward=forward):
                    result = forward(fed)
                    if all(len(tokens) == 1 and not a.prefilling for a, tokens in fed):
                        seen.append(result[0].float().clone())
                    return result

                generator._forward = spy
            for job in _jobs(model.config.vocab_size, 3, seed=4):
                job.num_predict = 3
                generator.submit(job)
            generator.run_until_done()
            logits[mode] = seen[0]  # the first decode-only step: same inputs in both
        want, got = logits["off"], logits["graph"]
        error = (got - want).norm() / want.norm()
        assert error < 2e-2, (cache, float(error))


def test_one_jobs_graphs_are_captured_at_load_and_reused(folders):
    # float32: the graph and the general path agree to the token.
    model = load_causal_lm(folders["tiny"], device="cuda", dtype=torch.float32)
    tokenizer = Tokenizer.from_folder(folders["tiny"])
    generator = Generator(model, tokenizer, decode_mode="graph", num_ctx=1024, max_batch=4)
    warmed = generator.decode.graph_count
    assert warmed == 2  # one row over one page and over two
    job = _jobs(model.config.vocab_size, 1, seed=4)[0]
    job.num_predict = 40
    got = generator.submit(job)
    generator.run_until_done()
    plain = Generator(model, tokenizer, decode_mode="off", num_ctx=1024, max_batch=4)
    want = plain.submit(job)
    plain.run_until_done()
    assert got.token_ids == want.token_ids
    # A short prompt's decode steps ran on the captured (1, 1) or (1, 2) graphs.
    assert generator.decode.graph_count == warmed or len(job.prompt) > 2 * 256
