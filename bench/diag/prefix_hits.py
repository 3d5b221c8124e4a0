"""Prefix-cache hits against a first run, and a fresh batch of the same prompt, on tiny
Gemma 3 and Llama models (a device diagnostic for the served "same as solo" counts):

    PYTHONPATH=$PWD python3 bench/diag/prefix_hits.py cuda graph float16

One line per model: how many of six prefix-hit copies, and of six fresh copies, give the
first run's greedy tokens."""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

import torch

from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.text.tokenizer import Tokenizer
from tests.fixtures.tiny_model import write_tiny_model
from tests.fixtures.tiny_tokenizer import write_tiny_tokenizer


def _same(generator: Generator, prompt: list[int], reference: list[int]) -> int:
    handles = [generator.submit(GenerationJob(list(prompt), {"temperature": 0}, num_predict=40,
                                              ignore_eos=True)) for _ in range(6)]
    generator.run_until_done()
    return sum(list(h.token_ids) == reference for h in handles)


def main(device: str, mode: str, dtype_name: str) -> None:
    dtype = getattr(torch, dtype_name)
    root = Path(tempfile.mkdtemp())
    for case in ("gemma3", "llama"):
        folder = write_tiny_model(root / case, case, vocab_size=400, max_position_embeddings=1024)
        write_tiny_tokenizer(folder)
        model = load_causal_lm(folder, device=device, dtype=dtype)
        tokenizer = Tokenizer.from_folder(folder)
        rng = random.Random(3)
        prompt = [rng.randrange(3, 400) for _ in range(300)]
        generator = Generator(model, tokenizer, max_batch=8, num_ctx=1024, decode_mode=mode)
        first = generator.submit(GenerationJob(list(prompt), {"temperature": 0}, num_predict=40,
                                               ignore_eos=True))
        generator.run_until_done()
        reference = list(first.token_ids)
        hits = _same(generator, prompt, reference)
        fresh = _same(Generator(model, tokenizer, max_batch=8, num_ctx=1024, decode_mode=mode),
                      prompt, reference)
        print(f"{case} {device} {mode} {dtype_name}: prefix hits {hits}/6 same, "
              f"fresh batch {fresh}/6 same")


if __name__ == "__main__":
    main(*sys.argv[1:4])
