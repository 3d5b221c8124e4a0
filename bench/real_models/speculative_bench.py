"""Speculative decoding on a real model: drafters x job counts x prompt sets.

For each prompt set (input-grounded: edit a passage, continue a quoted list, rewrite
code with one change; and free answers), each job count and each drafter (none, the
`ngram` drafter, a draft model folder), greedy jobs run in one generator; measured on
the decode steps only (steps that take no prompt tokens): tokens/s (all jobs), decode
passes, draft tokens kept per pass, the cost of a pass against a plain step, the
speed-up over no drafting, and whether every text equals the undrafted one. Steps that
captured a CUDA graph (once per row-count bucket and generator) are left out of the
times, counted in `capture_steps` (the draft model's own step graphs too). Each row
also keeps its slowest passes, the median pass and how many passes ran ahead of their
read-back (drafted and plain run). EXL3_DRAFT_COST=0 turns the cost back-off off (the
raw pass cost); by default drafting pauses where its passes do not pay, and a draft
model whose own forward costs more than drafting can save is not drafted with
(engine/generation/draft_gate.py; `gate` in each row: its pauses, probes and the
draft forward's ms per batch size).

    python bench/real_models/speculative_bench.py TARGET --draft-model DRAFT_FOLDER \
        --jobs 1,16,16x48 --tokens 64 --k 4 --device cuda --out spec.json

SxN rows: N jobs through S slots (a refilling queue: what a daemon sees), lengths 3/4,
1 and 5/4 of --tokens in turn, timed by every step (prompts too); `prompt_steps` and
`prompt_s` say what the admissions took, `differs_at` where a text left the plain one.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.generation.speculative import make_drafter
from exl3cli.engine.generation.textmodel import TextModel

PASSAGE = ("The old lighthouse stood on the northern cliff for two hundred years. Every "
           "night its keeper climbed the ninety steps, trimmed the wick and polished the "
           "great lens, so that the fishing boats could find the harbour in the dark.")
LIST = ("Shopping list: 1. two loaves of bread 2. a dozen eggs 3. one litre of milk "
        "4. a bag of apples 5. three tins of tomatoes 6. a jar of honey")
CODE = ("def total_price(items):\n    total = 0\n    for item in items:\n"
        "        total += item.price * item.quantity\n    return total\n")
SETS = {
    "grounded": [
        f"Rewrite this passage, changing 'northern' to 'southern' and 'ninety' to "
        f"'eighty', and keep everything else the same:\n\n{PASSAGE}",
        f"Copy this list exactly, then add a seventh item:\n\n{LIST}",
        f"Rename the function to compute_total and change nothing else:\n\n{CODE}",
    ],
    "free": [
        "Why is the sky blue? Answer in a few sentences.",
        "Give three tips for sleeping better.",
        "What is the difference between a virus and a bacterium?",
    ],
}


def _run(text_model: TextModel, prompts: list[list[int]], tokens: list[int], drafter: str | None,
         k: int, device: str, slots: int | None = None) -> dict[str, Any]:
    # The previous run's generator (its graphs and pools) is freed here, not by a
    # collection in the middle of this run's timed steps.
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
    generator = Generator(text_model.model, text_model.tokenizer,
                          max_batch=slots or len(prompts), num_ctx=1024)
    handles = [generator.submit(GenerationJob(
        p, {"temperature": 0}, num_predict=n, ignore_eos=True,
        drafter=make_drafter(drafter) if drafter else None,
        draft_tokens=k if drafter else 0)) for p, n in zip(prompts, tokens, strict=True)]
    cache = getattr(handles[0].job.drafter, "cache", None)  # a draft model's shared cache

    def captured() -> int:  # graphs of the target's steps and of the draft model's
        return generator.decode.captures + getattr(cache, "captures", 0)

    decode_s, wall_s, passes, drafted_passes, capture_steps = 0.0, 0.0, 0, 0, 0
    prompt_steps, prompt_s = 0, 0.0  # steps that took prompt tokens (a queue's admissions)
    steps: list[tuple[float, int, int, int, int, int, int]] = []  # per decode pass (below)
    while generator.has_work:
        captures = captured()
        ahead, late = generator.launched_ahead, generator.launched_late
        early = generator.launched_before_text
        start = time.perf_counter()
        report = generator.step()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if captured() != captures:
            capture_steps += 1  # a CUDA graph captured (once per bucket): not steady state
            continue
        wall_s += seconds  # every step, prompts too (what a queue's rows are timed by)
        if report.prefill_tokens:
            prompt_steps += 1
            prompt_s += seconds
        if report.decode_tokens and not report.prefill_tokens:
            decode_s += seconds
            passes += 1
            drafted_passes += report.draft_tokens > 0
            steps.append((round(seconds * 1e3, 3), len(steps), report.jobs,
                          report.draft_tokens, generator.launched_ahead - ahead,
                          generator.launched_late - late,
                          generator.launched_before_text - early))
    produced = sum(len(h.token_ids) for h in handles)
    cost = getattr(handles[0].job.drafter, "forward_cost", None)  # a draft model's gate
    return {
        "gate": None if cost is None else {
            "pauses": cost.pauses, "probes": cost.probes,
            "forward_ms": {jobs: round(cost.forward_ns(jobs) / 1e6, 3)
                           for jobs in (1, 2, 4, 8, 16) if cost.forward_ns(jobs)}},
        # where the time went: the slowest passes (ms, pass, jobs, drafts, launched
        # ahead, launched late, launched before text), the median pass, how many passes
        # ran ahead of their read-back, how many of those after waiting for a token to
        # look again (ahead_step._peeks_after), and how many launched the next step
        # before their text work (verify_ahead.py)
        "slowest": sorted(steps, reverse=True)[:4],
        "median_ms": sorted(s[0] for s in steps)[len(steps) // 2] if steps else None,
        "ahead_passes": sum(1 for s in steps if s[4]),
        "late_passes": sum(1 for s in steps if s[5]),
        "before_text_passes": sum(1 for s in steps if s[6]),
        "ids": [h.token_ids for h in handles], "tokens": produced, "decode_s": decode_s,
        "wall_s": wall_s, "prompt_steps": prompt_steps, "prompt_s": prompt_s,
        "passes": passes, "drafted_passes": drafted_passes, "capture_steps": capture_steps,
        "drafted": sum(h.final.draft_count for h in handles),
        "kept": sum(h.final.draft_accepted for h in handles),
    }


def _rate(run: dict[str, Any]) -> float:
    return round(run["tokens"] / run["decode_s"], 1) if run["decode_s"] else 0.0


def _differences(want: list[list[int]], runs: list[dict[str, Any]]) -> list[list[int]]:
    """[job, first token that differs] for each job of any run whose text is not
    `want`'s, earliest first (a near tie decided otherwise by another float order
    shows as one position, then another text)."""
    found: dict[int, int] = {}
    for run in runs:
        for job, (got, ref) in enumerate(zip(run["ids"], want, strict=True)):
            if got != ref:
                at = next((i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b),
                          min(len(got), len(ref)))
                found[job] = min(at, found.get(job, at))
    return sorted(([job, at] for job, at in found.items()), key=lambda item: item[1])


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return sorted(runs, key=_rate)[len(runs) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--jobs", default="1,16",
                        help="job counts; SxN: N jobs through S slots (a refilling queue, "
                             "timed by every step, prompts included)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of plain and drafted runs; each row keeps the median")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    text_model = TextModel.load(args.model, device=args.device, dtype=dtype)
    drafters = ["ngram"] + ([args.draft_model] if args.draft_model else [])
    rows = []
    # Warm-up: kernels, graphs and the draft model's load are not measured; nor is the
    # first timing of the draft model's forward (draft_gate.DraftForwardCost is per
    # process, as in a daemon: its first request pays one short draft).
    warm = [text_model.chat_prompt([{"role": "user", "content": SETS["free"][0]}])]
    for drafter in [None, *drafters]:
        _run(text_model, warm * 2, [8, 8], drafter, args.k, args.device)
    for set_name in args.sets.split(","):
        asks = [text_model.chat_prompt([{"role": "user", "content": a}]) for a in SETS[set_name]]
        for spec in args.jobs.split(","):
            slots, _, queued = spec.partition("x")  # "16x48": 48 jobs through 16 slots
            jobs = int(queued or slots)
            queue = int(slots) if queued else None
            prompts = [asks[i % len(asks)] for i in range(jobs)]
            # A queue's jobs ask for 3/4, 1 and 5/4 of --tokens in turn (a daemon's
            # requests end at different steps; equal lengths would admit in three waves)
            lengths = ([args.tokens * (3 + i % 3) // 4 for i in range(jobs)] if queued
                       else [args.tokens] * jobs)
            # --repeats rounds, plain and each drafter in turn (so a slow spell of the
            # host falls on all of them); each keeps its median-rate run
            runs: dict[str | None, list[dict[str, Any]]] = {d: [] for d in [None, *drafters]}
            for _ in range(args.repeats):
                for drafter in runs:
                    runs[drafter].append(_run(text_model, prompts, lengths, drafter,
                                              args.k, args.device, queue))
            if queue:  # jobs come and go: timed by every step, prompts included
                for run in (r for rs in runs.values() for r in rs):
                    run["decode_s"] = run["wall_s"]
            plain = _median_run(runs[None])
            plain_step = plain["decode_s"] / max(1, plain["passes"])
            for drafter in drafters:
                got = _median_run(runs[drafter])
                rate = got["tokens"] / got["decode_s"] if got["decode_s"] else None
                plain_rate = plain["tokens"] / plain["decode_s"] if plain["decode_s"] else None
                rows.append({
                    "set": set_name, "jobs": spec,
                    "drafter": "ngram" if drafter == "ngram" else "model:" + Path(drafter).name,
                    "plain_tok_s": round(plain_rate, 1) if plain_rate else None,
                    "tok_s": round(rate, 1) if rate else None,
                    "speedup": round(rate / plain_rate, 3) if rate and plain_rate else None,
                    "passes": got["passes"], "plain_passes": plain["passes"],
                    "kept_per_pass": round(got["kept"] / max(1, got["passes"]), 3),
                    "kept": got["kept"], "drafted": got["drafted"],
                    "drafted_passes": got["drafted_passes"],
                    "capture_steps": got["capture_steps"],
                    "pass_cost_vs_plain": round((got["decode_s"] / max(1, got["passes"]))
                                                / plain_step, 3) if plain_step else None,
                    "same_text": all(r["ids"] == plain["ids"]
                                     for r in runs[None] + runs[drafter]),
                    "rates": [_rate(r) for r in runs[drafter]],
                    "plain_rates": [_rate(r) for r in runs[None]],
                    "slowest": got["slowest"], "median_ms": got["median_ms"],
                    "plain_median_ms": plain["median_ms"], "ahead_passes": got["ahead_passes"],
                    "plain_ahead_passes": plain["ahead_passes"],
                    "late_passes": got["late_passes"],
                    "before_text_passes": got["before_text_passes"],
                    # steps that took prompt tokens: count and seconds (drafted, plain)
                    "prompt_steps": [got["prompt_steps"], plain["prompt_steps"]],
                    "prompt_s": [round(got["prompt_s"], 4), round(plain["prompt_s"], 4)],
                    # per job whose text differs: (job, first differing token)
                    "differs_at": _differences(plain["ids"], runs[None] + runs[drafter]),
                    "gate": got["gate"],  # draft_gate: pauses, probes, forward ms by size
                })
                row = rows[-1]
                print(f"{set_name:<9}{spec:>5} jobs {row['drafter']:<22} "
                      f"{row['plain_tok_s']} -> {row['tok_s']} tok/s  x{row['speedup']}  "
                      f"kept/pass {row['kept_per_pass']}  pass cost x{row['pass_cost_vs_plain']}"
                      f"  same {row['same_text']}", flush=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "device": args.device,
                                          "k": args.k, "tokens": args.tokens, "rows": rows},
                                         indent=1))
    return 0 if all(r["same_text"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
