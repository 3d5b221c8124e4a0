"""Batched sampling (engine/generation/batch_sampling.py) against each row's own Sampler."""

from __future__ import annotations

import random

import pytest
import torch

from exl3cli.engine.generation.batch_sampling import (
    argmax_rows,
    batchable,
    batched_probs,
    draw_rows,
    sample_rows,
)
from exl3cli.engine.generation.sampling import build_sampler

VOCAB = 300


def _reference_probs(sampler, logits):
    return torch.softmax(sampler.process(logits, []), dim=-1)


def _dense(probs, ids, vocab):
    out = torch.zeros(probs.shape[0], vocab)
    return out.scatter_add_(1, ids, probs)


def _options(rng):
    return {"temperature": rng.choice([0.3, 0.8, 1.0, 1.7]),
            "top_k": rng.choice([0, 1, 5, 40, VOCAB, 1000]),
            "top_p": rng.choice([0.1, 0.5, 0.9, 1.0]),
            "min_p": rng.choice([0.0, 0.05, 0.3])}


@pytest.mark.parametrize("seed", range(4))
def test_batched_distribution_equals_the_pipeline(seed):
    rng = random.Random(seed)
    samplers = [build_sampler(_options(rng)) for _ in range(12)]
    assert all(batchable(s) for s in samplers)
    logits = torch.randn(12, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4
    logits[0, :7] = 9.0  # ties at the top
    probs, ids = batched_probs(logits, samplers)
    got = _dense(probs, ids, VOCAB)
    for row, sampler in enumerate(samplers):
        expected = _reference_probs(sampler, logits[row])
        assert torch.allclose(got[row], expected, atol=1e-6), (row, sampler.options)


def test_rows_the_batch_cannot_take_use_their_own_sampler():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(9)) * 3
    histories = [[1, 2, 3]] * 5
    samplers = [
        build_sampler({"temperature": 0}),
        build_sampler({"temperature": 0, "repeat_penalty": 1.3}),  # penalties: own path
        build_sampler({"temperature": 0.7, "seed": 5}),  # seeded: own path, repeatable
        build_sampler({"temperature": 0.7, "typical_p": 0.5}),
        build_sampler({"temperature": 0.9, "top_k": 1}),  # batched, deterministic
    ]
    assert [batchable(s) for s in samplers] == [True, False, False, False, True]
    tokens = sample_rows(logits, samplers, histories)
    assert tokens[0] == int(logits[0].argmax())
    assert tokens[1] == build_sampler({"temperature": 0, "repeat_penalty": 1.3}).sample(
        logits[1], histories[1])
    assert tokens[2] == build_sampler({"temperature": 0.7, "seed": 5}).sample(
        logits[2], histories[2])
    assert tokens[4] == int(logits[4].argmax())


def test_batched_draws_follow_the_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]]).repeat(4000, 1)
    sampler = build_sampler({"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0})
    tokens = sample_rows(logits, [sampler] * 4000, [[]] * 4000)
    counts = torch.bincount(torch.tensor(tokens), minlength=5).float() / 4000
    assert torch.allclose(counts, torch.softmax(logits[0], -1), atol=0.03)


def test_wrapped_samplers_and_inactive_steps():
    from exl3cli.runtime.logprobs import LogprobRecorder

    plain = build_sampler({"temperature": 0.7})
    assert batchable(plain)  # DRY and XTC are off by default: the batch may take it
    assert not batchable(build_sampler({"temperature": 0.7, "dry_multiplier": 0.8}))
    assert not batchable(build_sampler({"temperature": 0.7, "xtc_probability": 0.5}))
    # A wrapper that records what it samples must see every row it samples.
    recorder = LogprobRecorder(build_sampler({"temperature": 0}), top=2)
    assert not batchable(recorder)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    tokens = sample_rows(logits, [recorder, plain], [[], []])
    assert tokens[0] == int(logits[0].argmax())
    assert [token for token, _, _ in recorder.take(5)] == [tokens[0]]


@pytest.mark.parametrize("vocab", [400, 128256, 151936, 1000, 37])
def test_argmax_in_two_passes_is_torch_argmax(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    logits[1] = 0.0  # every entry tied: the first
    logits[2, vocab // 3] = logits[2, vocab - 1] = 99.0  # ties across chunks
    logits[3, 1] = logits[3, 2] = 99.0  # ties inside one chunk
    logits[4] = float("-inf")
    assert torch.equal(argmax_rows(logits), torch.argmax(logits, dim=-1))
    rounded = logits[:1].to(torch.bfloat16).float()  # many near-ties
    assert torch.equal(argmax_rows(rounded), torch.argmax(rounded, dim=-1))


@pytest.mark.parametrize("shape", [(1, 40), (3, 400), (2, 128256), (4, 7)])
def test_draw_rows_is_torch_multinomial_without_its_host_checks(shape):
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        probs = torch.softmax(3 * torch.randn(*shape, generator=gen), dim=-1)
        if seed % 2:
            probs[:, shape[1] // 2:] = 0.0  # masked candidates
            probs = probs / probs.sum(-1, keepdim=True)
        torch.manual_seed(seed)
        want = torch.multinomial(probs, 1)[:, 0]
        after_want = torch.rand(3)  # the same random numbers were used up
        torch.manual_seed(seed)
        got = draw_rows(probs)
        assert torch.equal(got, want)
        assert torch.equal(torch.rand(3), after_want)
