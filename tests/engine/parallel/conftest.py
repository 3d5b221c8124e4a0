"""Shared pieces of the tensor-parallel and layer-split tests: greedy runs of three
jobs (two short prompts and one long enough for a prefill chunk next to decoding
rows) through the generator, the same way for every model."""

from __future__ import annotations

from typing import Any

from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.generation.sampling import build_sampler
from exl3cli.engine.text.tokenizer import Tokenizer

PROMPTS = ([5, 6, 7, 8], [9, 10, 11], list(range(20, 60)))


def greedy_texts(model: Any, folder: Any, tokens: int = 8, **generator: Any) -> list[list[int]]:
    """Each job's generated token ids (continuous batching over the paged cache)."""
    tokenizer = Tokenizer.from_folder(folder)
    gen = Generator(model, tokenizer, max_batch=4, num_ctx=128, max_prefill_tokens=16,
                    **generator)
    handles = [gen.submit(GenerationJob(list(p), sampler=build_sampler({"temperature": 0}),
                                        num_predict=tokens, ignore_eos=True))
               for p in PROMPTS]
    gen.run_until_done()
    return [list(h.token_ids) for h in handles]
