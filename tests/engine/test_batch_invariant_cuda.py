"""The batch-invariant mode on the GPU (`-m cuda`), on a synthetic EXL3 model of
SmolLM2-135M's shape (4.0 bpw; fused decode layer, fused GEMM, paged attention kernel,
the head): a row's logits bit-identical alone and beside 1..63 other rows, in graphs
and in static steps; and concurrent greedy jobs (same and different prompts, prefix
cache hits, jobs joining late) giving exactly each job's solo tokens in bfloat16, where
near-ties flip greedy tokens whenever any summation order changes (issue 11 item 2)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from exl3cli.convert.synthetic import write_synthetic_model
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.text.tokenizer import Tokenizer
from exl3cli.ops import batch_invariant as mode
from tests.fixtures.invariance import probe_logits, solo_and_together

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_model(tmp_path_factory.mktemp("smol"), "smollm2-135m", bits=4.0,
                                 num_layers=4, seed=11)


@pytest.fixture
def invariant_on():
    assert torch.cuda.is_available(), "cuda tests need a GPU"
    mode.set_batch_invariant(True)
    yield
    mode.set_batch_invariant(None)


@pytest.mark.parametrize("run_mode", ["graph", "static"])
@pytest.mark.parametrize("cache", ["fp16", "q4"])
def test_a_rows_logits_are_the_same_alone_and_in_batches(folder, invariant_on, run_mode,
                                                         cache):
    model = load_causal_lm(folder, device="cuda", dtype=torch.bfloat16)
    probe = [11, 503, 77, 4096, 12, 9000, 31]
    alone = probe_logits(model, probe, len(probe), seed=0, mode=run_mode, cache=cache)
    for rows in (len(probe) + 1, 9, 16, 33, 64):
        for last in (False, True):
            got = probe_logits(model, probe, rows, seed=rows, mode=run_mode, cache=cache,
                               probe_last=last, history=300 if rows in (16, 64) else 0)
            assert torch.equal(got, alone), (rows, last)
    # A decode row is a one-token chunk: the probe's next token alone and in a batch.
    one = probe_logits(model, probe[:1], 1, seed=1, mode=run_mode, cache=cache)
    assert torch.equal(one, alone[:1])


def _prompts(seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(10, vocab) for _ in range(37)]
    long = [rng.randrange(10, vocab) for _ in range(300)]
    others = [[rng.randrange(10, vocab) for _ in range(rng.choice([2, 20, 63, 64, 65, 130]))]
              for _ in range(8)]
    return [shared, long, *others[:4], shared, shared, long, *others[4:], shared, shared]


@pytest.mark.parametrize("max_batch", [16, 64])
def test_concurrent_greedy_jobs_give_exactly_the_solo_tokens(folder, invariant_on,
                                                             max_batch):
    model = load_causal_lm(folder, device="cuda", dtype=torch.bfloat16)
    tokenizer = Tokenizer.from_folder(folder)
    prompts = _prompts(max_batch, model.config.vocab_size)
    solo, together, generator = solo_and_together(model, tokenizer, prompts, 48,
                                                  max_batch=max_batch)
    assert generator.batch_invariant and generator.decode.mode == "graph"
    same = sum(a == b for a, b in zip(solo, together, strict=True))
    assert same == len(prompts), f"{same}/{len(prompts)} jobs gave their solo tokens"
    assert generator.pool.pages_in_use == 0
