"""The draft model's one-token forwards as its own fixed-shape steps replayed from CUDA
graphs (plugins/drafters.py `_SharedDraftCache.forward`, `-m cuda`): the drafts equal
the general path's (EXL3_DRAFT_STEPS=0) in float32, and speculative text stays the
target's greedy text."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from exl3_plugins.drafters import ModelDrafter

from exl3cli.convert.synthetic import write_synthetic_model
from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.text.tokenizer import Tokenizer

pytestmark = pytest.mark.cuda
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_model(tmp_path_factory.mktemp("d"), "tiny", bits=4.0, seed=9)


def test_graphed_draft_steps_propose_what_the_general_path_proposes(folder, monkeypatch):
    monkeypatch.setenv("EXL3_DRAFT_STEPS", "1")
    stepped_model = load_causal_lm(folder, device="cuda", dtype=torch.float32)
    stepped = [ModelDrafter(stepped_model) for _ in range(3)]
    monkeypatch.setenv("EXL3_DRAFT_STEPS", "0")
    plain_model = load_causal_lm(folder, device="cuda", dtype=torch.float32)
    plain = [ModelDrafter(plain_model) for _ in range(3)]
    vocab = stepped_model.config.vocab_size
    rng = random.Random(4)
    histories = [[rng.randrange(10, vocab // 2) for _ in range(rng.randrange(5, 40))]
                 for _ in range(3)]
    for _ in range(6):
        counts = [rng.randrange(1, 5) for _ in histories]
        got = stepped[0].propose_batch(stepped, histories, counts)
        assert got == plain[0].propose_batch(plain, histories, counts)
        histories = [h + d[: rng.randrange(len(d) + 1)] + [rng.randrange(10, vocab // 2)]
                     for h, d in zip(histories, got, strict=True)]
    runner = stepped[0].cache.runner
    assert runner is not None and runner.mode == "graph" and runner.graph_count >= 1

    tokenizer = Tokenizer.from_folder(folder)
    target = load_causal_lm(folder, device="cuda", dtype=torch.float32)

    def run(draft: bool) -> list[list[int]]:
        generator = Generator(target, tokenizer, max_batch=4, num_ctx=512, draft_cost=False)
        handles = [generator.submit(GenerationJob(
            list(h), GREEDY, num_predict=24, ignore_eos=True,
            drafter=ModelDrafter(stepped_model) if draft else None,
            draft_tokens=3 if draft else 0)) for h in histories]
        generator.run_until_done()
        return [list(h.token_ids) for h in handles]

    assert run(True) == run(False)
