"""Tensor parallel against one device, in one process tree: greedy equality and speed.

usage: python bench/tp_bench.py MODEL --tp 2 [--device cuda|cpu] [--jobs 1,16,64]
       [--gen 64] [--prompt 128]   -> one JSON object on stdout, a table on stderr.

1. TP=1 (the ordinary loader) and TP=N (tp_launch) greedy-decode the same prompts for
   `--gen` tokens; `equal` says whether every token matches.
2. Aggregate decode tok/s at each job count for TP=1 and TP=N (the generator, as
   `run` and `serve` use it; prompt `--prompt` random ids, `--gen` tokens each).
3. With EXL3_TP_PROFILE=1 (set here for one extra TP=N run at the largest job count):
   the time rank 0 spends inside data collectives as a fraction of the run's wall time
   (the all-reduce share of a step; devices synchronised around each collective, so
   the run itself is slower than step 2's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exl3cli.engine.generation.generator import Generator  # noqa: E402
from exl3cli.engine.generation.jobs import GenerationJob  # noqa: E402
from exl3cli.engine.generation.sampling import build_sampler  # noqa: E402
from exl3cli.engine.text.tokenizer import Tokenizer  # noqa: E402


def _jobs(model, tokenizer, prompts, gen, max_batch):
    generator = Generator(model, tokenizer, max_batch=max_batch,
                          num_ctx=max(len(p) for p in prompts) + gen + 8)
    handles = [generator.submit(GenerationJob(p, sampler=build_sampler({"temperature": 0}),
                                              num_predict=gen, ignore_eos=True))
               for p in prompts]
    start = time.perf_counter()
    generator.run_until_done()
    wall = time.perf_counter() - start
    return [list(h.token_ids) for h in handles], wall


def _prompts(count, length, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab - 10, (length,), generator=g).tolist() for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--device", default=None)
    parser.add_argument("--jobs", default="1,16,64")
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    args = parser.parse_args()
    from exl3cli.engine.generation.tp_launch import load_tensor_parallel
    from exl3cli.engine.models.loader import load_causal_lm

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = Tokenizer.from_folder(args.model)
    jobs = [int(j) for j in args.jobs.split(",")]
    out = {"model": str(args.model), "tp": args.tp, "device": device, "jobs": jobs}
    single = load_causal_lm(args.model, device=device)
    vocab = single.config.vocab_size
    check = _prompts(4, args.prompt, vocab, seed=7)
    ref, _ = _jobs(single, tokenizer, check, args.gen, 4)
    out["tp1"] = {n: _jobs(single, tokenizer, _prompts(n, args.prompt, vocab), args.gen,
                           n)[1] for n in jobs}
    del single
    if device == "cuda":
        torch.cuda.empty_cache()
    model = load_tensor_parallel(args.model, args.tp, device=device)
    try:
        got, _ = _jobs(model, tokenizer, check, args.gen, 4)
        out["equal"] = got == ref
        out["first_mismatch"] = next(([i, j] for i, (a, b) in enumerate(zip(ref, got, strict=False))
                                      for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        out["tpN"] = {n: _jobs(model, tokenizer, _prompts(n, args.prompt, vocab), args.gen,
                               n)[1] for n in jobs}
        group = model.group
        group.profile, group.collective_seconds = True, 0.0
        _, wall = _jobs(model, tokenizer, _prompts(jobs[-1], args.prompt, vocab), args.gen,
                        jobs[-1])
        out["allreduce_fraction"] = group.collective_seconds / wall
        out["collectives"] = group.collectives
        group.profile = False
    finally:
        model.close()
    rows = [f"jobs  TP=1 tok/s  TP={args.tp} tok/s  ratio"]
    for n in jobs:
        a, b = n * args.gen / out["tp1"][n], n * args.gen / out["tpN"][n]
        rows.append(f"{n:4d}  {a:10.1f}  {b:10.1f}  {b / a:5.2f}")
    rows.append(f"greedy TP=1 == TP={args.tp} for {args.gen} tokens: {out['equal']}; "
                f"all-reduce share of a {jobs[-1]}-job run: {out['allreduce_fraction']:.1%}")
    print("\n".join(rows), file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    os.environ.setdefault("EXL3_DECODE_MODE", "")
    main()
