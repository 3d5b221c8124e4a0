"""Decode steps launched before the previous step's tokens are read back
(engine/generation/ahead_step.py), on the CPU: the fixed-shape "static" step is what a
CUDA graph replays, and the ordering (launch N+1, then read N) is the same code.

With launching ahead on and off, every job must get the same tokens, text, end reason
and counts: greedy, seeded and unseeded sampling, stop strings, EOS mid-batch, budgets,
jobs joining and leaving."""

from __future__ import annotations

import random

import pytest
import torch

from exl3cli.engine.generation import ahead_step
from exl3cli.engine.generation.ahead_step import async_step_default
from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob

GREEDY = {"temperature": 0}


def _generator(text_model, async_step: bool, **settings) -> Generator:
    settings.setdefault("num_ctx", 256)
    settings.setdefault("max_batch", 4)
    generator = Generator(text_model.model, text_model.tokenizer, decode_mode="static",
                          async_step=async_step, **settings)
    assert generator.decode.mode == "static" and generator.async_step is async_step
    return generator


def _outcome(handle) -> tuple:
    final = handle.final
    return (handle.token_ids, handle.text(), final.done_reason, final.eval_count,
            final.prompt_eval_count)


def _run(text_model, jobs: list[GenerationJob], async_step: bool, late: int = 0,
         seed: int | None = None, **settings) -> tuple[list[tuple], Generator]:
    """Run `jobs` (the last `late` of them submitted after 3 steps: they join while
    others decode); `seed` seeds torch's global generator first (unseeded sampling)."""
    if seed is not None:
        torch.manual_seed(seed)
    generator = _generator(text_model, async_step, **settings)
    first = jobs[: len(jobs) - late]
    handles = [generator.submit(job) for job in first]
    for _ in range(3):
        generator.step()
    handles += [generator.submit(job) for job in jobs[len(first):]]
    generator.run_until_done()
    while generator._flight is not None:  # a step of jobs that all ended: read and dropped
        generator.step()
    assert generator.pool.pages_in_use == 0
    return [_outcome(handle) for handle in handles], generator


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]


def _same_both_ways(text_model, jobs, **kwargs) -> tuple[list[tuple], Generator]:
    expected, sync = _run(text_model, jobs, False, **kwargs)
    got, ahead = _run(text_model, jobs, True, **kwargs)
    assert got == expected
    assert sync.launched_ahead == 0
    return got, ahead


def test_greedy_jobs_joining_and_leaving_with_stop_strings(text_model):
    prompts = _prompts(1, [4, 9, 17, 6, 12])
    reference, _ = _run(text_model, [GenerationJob(p, GREEDY, num_predict=10)
                                     for p in prompts[:2]], False)
    text = reference[1][1]
    stop = text[len(text) // 2: len(text) // 2 + 2]  # met mid-way by job 1
    jobs = [GenerationJob(prompts[0], GREEDY, num_predict=10),
            GenerationJob(prompts[1], GREEDY, num_predict=10, stop=[stop]),
            GenerationJob(prompts[2], GREEDY, num_predict=4),  # leaves early
            GenerationJob(prompts[3], GREEDY, num_predict=12),  # these two join late
            GenerationJob(prompts[4], GREEDY, num_predict=7)]
    got, ahead = _same_both_ways(text_model, jobs, late=2)
    assert ahead.launched_ahead > 0
    assert got[1][2] == "stop" and got[1][3] < 10 and stop not in got[1][1]
    assert [outcome[3] for outcome in got[2:]] == [4, 12, 7]  # num_predict, exactly
    assert [outcome[2] for outcome in got[2:]] == ["length"] * 3


def test_eos_mid_batch(text_model, monkeypatch):
    prompts = _prompts(2, [5, 11, 8])
    jobs = [GenerationJob(p, GREEDY, num_predict=9) for p in prompts]
    reference, _ = _run(text_model, jobs, False)
    eos = reference[0][0][3]  # job 0's fourth token ends it from now on
    monkeypatch.setattr(text_model.tokenizer, "eos_token_ids", {eos})
    got, ahead = _same_both_ways(text_model, jobs)
    assert ahead.launched_ahead > 0
    assert got[0][2] == "stop" and got[0][3] <= 4
    assert any(outcome[2] == "length" and outcome[3] == 9 for outcome in got[1:])


def test_unseeded_sampling_draws_the_same_tokens_from_the_same_global_seed(text_model):
    # Batched on the device (temperature, top_k, top_p): one draw per step either way.
    options = {"temperature": 0.9, "top_k": 40, "top_p": 0.9}
    jobs = [GenerationJob(p, options, num_predict=8, ignore_eos=True)
            for p in _prompts(3, [6, 10, 3])]
    got, ahead = _same_both_ways(text_model, jobs, seed=11)
    assert ahead.launched_ahead > 0
    assert all(outcome[3] == 8 for outcome in got)


def test_seeded_sampling_takes_the_synchronous_step(text_model):
    # A seeded sampler draws on the host (batch_sampling.batchable): never launched ahead.
    jobs = [GenerationJob(p, {"temperature": 0.8, "seed": 5 + i}, num_predict=6)
            for i, p in enumerate(_prompts(4, [7, 5]))]
    _, ahead = _same_both_ways(text_model, jobs)
    assert ahead.launched_ahead == 0


def test_the_next_step_is_launched_before_the_tokens_are_read(text_model, monkeypatch):
    """The order of device work and read-backs: with launching ahead, each decode step
    (fed with the device tokens of the one before) starts before that one is read."""
    log: list[str] = []
    read = ahead_step.Flight.read

    def logged_read(self):
        log.append("read")
        return read(self)

    monkeypatch.setattr(ahead_step.Flight, "read", logged_read)
    for async_step in (True, False):
        log.clear()
        generator = _generator(text_model, async_step)
        run = generator.decode.run

        def logged_run(rows, ids=None, run=run):
            log.append("run ids" if ids is not None else "run")
            return run(rows, ids)

        generator.decode.run = logged_run
        generator.submit(GenerationJob(_prompts(5, [6])[0], GREEDY, num_predict=6))
        generator.run_until_done()
        decode = log[log.index("run"):]
        if async_step:  # tokens 2..6: the first decode step, then each launched ahead
            assert decode == ["run", "run ids", "read", "run ids", "read", "run ids",
                              "read", "run ids", "read", "read"]
        else:
            assert decode == ["run", "read"] * 5


def test_a_budget_ending_leaves_the_next_step_launched_ahead(text_model):
    # Job 0 ends on its budget while job 1 goes on: the step after job 0's last token
    # is launched ahead with job 1 alone (as the synchronous step has it).
    prompts = _prompts(8, [6, 6])
    jobs = [GenerationJob(prompts[0], GREEDY, num_predict=4, ignore_eos=True),
            GenerationJob(prompts[1], GREEDY, num_predict=12, ignore_eos=True)]
    got, ahead = _same_both_ways(text_model, jobs)
    assert [outcome[3] for outcome in got] == [4, 12]
    # Tokens 2..12 of job 1: 11 decode steps, every one but the first launched ahead.
    assert ahead.launched_ahead == 10


def test_the_steps_own_argmax_gives_the_same_tokens(text_model, monkeypatch):
    # EXL3_STEP_ARGMAX=1: the argmax in the step (two passes over 16-wide chunks of the
    # 400-token vocabulary); drawn rows still sample from the logits, after a copy.
    jobs = [GenerationJob(p, GREEDY, num_predict=8) for p in _prompts(6, [5, 9])]
    jobs.append(GenerationJob(_prompts(7, [4])[0], {"temperature": 0.8}, num_predict=8,
                              ignore_eos=True))
    want, plain = _run(text_model, jobs, True, seed=2)
    assert not plain.decode.step_argmax and plain.decode.greedy is None
    monkeypatch.setenv("EXL3_STEP_ARGMAX", "1")
    got, folded = _run(text_model, jobs, True, seed=2)
    assert got == want
    assert folded.decode.step_argmax and folded.decode.greedy is not None
    assert folded.launched_ahead > 0


def test_the_switch(monkeypatch):
    monkeypatch.delenv("EXL3_ASYNC_STEP", raising=False)
    assert async_step_default() is True
    monkeypatch.setenv("EXL3_ASYNC_STEP", "0")
    assert async_step_default() is False
    monkeypatch.setenv("EXL3_ASYNC_STEP", "1")
    assert async_step_default() is True
    monkeypatch.setenv("EXL3_ASYNC_STEP", "maybe")
    with pytest.raises(ValueError, match="EXL3_ASYNC_STEP"):
        async_step_default()
