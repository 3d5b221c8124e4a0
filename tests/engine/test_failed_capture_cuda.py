"""A CUDA graph capture that fails must not break what comes after it (`-m cuda`).

torch's CUDAGraph.capture_end raises before its bookkeeping when a capture is
invalidated, leaving the device's default random generator marked as capturing: every
later CUDA random op outside a capture then fails ("Offset increment outside graph
capture encountered unexpectedly"). That op is the batched sampler's draw
(batch_sampling.draw_rows), so before decode_step.recover_from_failed_capture one failed
capture in `exl3 serve` failed every later sampled request of every model on the GPU.
"""

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

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_model(tmp_path_factory.mktemp("m"), "tiny", bits=4.0, seed=5)


def _jobs(vocab: int, count: int, options: dict) -> list[GenerationJob]:
    rng = random.Random(count)
    return [GenerationJob([rng.randrange(10, vocab // 2) for _ in range(12)], dict(options),
                          num_predict=20, ignore_eos=True) for _ in range(count)]


def _decode(generator: Generator, jobs: list[GenerationJob]) -> list[list[int]]:
    handles = [generator.submit(job) for job in jobs]
    generator.run_until_done()
    while generator._flight is not None:
        generator.step()
    return [list(h.token_ids) for h in handles]


def test_sampling_and_later_captures_work_after_a_failed_capture(folder):
    model = load_causal_lm(folder, device="cuda", dtype=torch.float32)
    tokenizer = Tokenizer.from_folder(folder)
    vocab = model.config.vocab_size
    plain_forward = model.forward
    failed = [0]

    def fail_first_capture(*args, **kwargs):
        out = plain_forward(*args, **kwargs)
        if torch.cuda.is_current_stream_capturing() and not failed[0]:
            failed[0] += 1
            out.sum().item()  # a read-back: not permitted while a stream captures
        return out

    model.forward = fail_first_capture
    generator = Generator(model, tokenizer, decode_mode="graph", num_ctx=512, max_batch=4)
    greedy = _decode(generator, _jobs(vocab, 1, {"temperature": 0}))
    assert failed[0] == 1 and generator.decode.capture_failures == 1
    assert generator.decode.mode == "graph" and len(greedy[0]) == 20

    torch.randn(8, device="cuda")  # the default generator is usable outside captures
    # Unseeded sampled jobs draw from the default generator, batched, in other buckets
    # whose captures must now succeed.
    sampled = _decode(generator, _jobs(vocab, 3, {"temperature": 0.9, "top_k": 40}))
    assert [len(tokens) for tokens in sampled] == [20, 20, 20]
    assert generator.decode.capture_failures == 1 and generator.decode.captures >= 1
    assert all(0 <= t < vocab for tokens in sampled for t in tokens)
