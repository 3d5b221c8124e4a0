"""Two models decoding with CUDA graphs in two threads (`-m cuda`), as `exl3 serve` runs
two loaded models: one model's graph capture must not break the other's. Run 46 (two
models served together) lost its graphs to "operation not permitted when stream is
capturing": torch.cuda.graph synchronizes the device and empties the allocator's cache
as it begins, and every capture shared one class-wide stream. Here model A holds its
first capture open while model B starts decoding (and capturing); both must keep their
graphs and give the tokens each gives alone."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch

from exl3cli.convert.synthetic import write_synthetic_model
from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.text.tokenizer import Tokenizer

pytestmark = pytest.mark.cuda
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return [write_synthetic_model(tmp_path_factory.mktemp(f"m{seed}"), "tiny", bits=4.0,
                                  seed=seed) for seed in (3, 4)]


def _jobs(vocab: int, seed: int) -> list[GenerationJob]:
    rng = random.Random(seed)
    return [GenerationJob([rng.randrange(10, vocab // 2) for _ in range(rng.choice([5, 40]))],
                          GREEDY, num_predict=24, ignore_eos=True) for _ in range(3)]


def _decode(model, tokenizer, jobs) -> tuple[list[list[int]], Generator]:
    generator = Generator(model, tokenizer, decode_mode="graph", num_ctx=512, max_batch=4)
    handles = [generator.submit(job) for job in jobs]
    generator.run_until_done()
    while generator._flight is not None:
        generator.step()
    return [list(h.token_ids) for h in handles], generator


def test_a_capture_in_one_thread_survives_another_models_decode(folders):
    models = [load_causal_lm(f, device="cuda", dtype=torch.float32) for f in folders]
    tokenizers = [Tokenizer.from_folder(f) for f in folders]
    jobs = [_jobs(m.config.vocab_size, 11 + i) for i, m in enumerate(models)]
    solo = [_decode(m, t, j)[0] for m, t, j in zip(models, tokenizers, jobs, strict=True)]

    capturing = threading.Event()
    plain_forward = models[0].forward

    def slow_first_capture(*args, **kwargs):
        out = plain_forward(*args, **kwargs)
        if torch.cuda.is_current_stream_capturing() and not capturing.is_set():
            capturing.set()  # model B starts now, while this capture is still open
            time.sleep(0.5)
        return out

    models[0].forward = slow_first_capture
    results: dict[int, tuple[list[list[int]], Generator]] = {}
    errors: list[BaseException] = []

    def work(index: int) -> None:
        try:
            if index == 1:
                assert capturing.wait(30), "model A never captured"
            results[index] = _decode(models[index], tokenizers[index], jobs[index])
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert capturing.is_set()
    for index in (0, 1):
        tokens, generator = results[index]
        assert generator.decode.capture_failures == 0, index
        assert generator.decode.mode == "graph" and generator.decode.captures >= 1, index
        assert tokens == solo[index], index
