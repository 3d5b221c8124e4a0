"""Aggregate generation tokens/s of the batched generator at several job counts, and the
KV cache memory per token of each cache type.

    python bench/generator_throughput.py MODEL_FOLDER [--jobs 1,8,32,128] [--gen 64]
        [--prompt 128] [--kv fp16,q4] [--device cuda] [--json]

With `--lora-rank R` every job runs with a random rank-R LoRA adapter on all seven
projections of every layer (engine/adapters/lora.py), to compare against the bare model.

N jobs with different random prompts are submitted at once (greedy, or sampled with
`--temperature`; `--gen` tokens each, never stopping early: `ignore_eos`); the figure
is decode tokens per second over the steps that only decode (after every prompt is in), so prompt processing does not
dilute it. Each job count is run once to warm up (kernels built, graphs captured),
then `--repeat` times; the median is reported, with the spread. Ratios are against
1 job in the same process.

`--jobs SxN` (e.g. 16x48): N jobs through S slots, a refilling queue (what a daemon
sees): the jobs ask for 3/4, 1 and 5/4 of `--gen` tokens in turn, so they end at
different steps and the queue's prompts join beside decoding jobs; the figure is then
every token generated over the whole run (prompts included), and `prompt_steps` /
`prompt_seconds` what the steps that took prompt tokens cost (A/B EXL3_PROMPT_BESIDE).

Each step is timed when the generator hands back its report, which is after that step's
tokens were read to the host: nothing is synchronized in between, so a decode step
launched ahead of its predecessor's read-back (engine/generation/ahead_step.py) overlaps
the host's work as it does in `run` and `serve`. `--sync-steps` (or
EXL3_BENCH_SYNC_STEPS=1) synchronizes the device after every report instead (how this
script timed steps before session 9: it drains the step launched ahead, so the host's
time between steps is added to every step). KV bytes/token is what the page pool allocates per token over all
layers (keys + values, codes + scales).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from exl3cli.engine.generation.generator import Generator, StepReport
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.text.tokenizer import Tokenizer


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Ids from the low half of the vocabulary: ordinary tokens, no specials at the top.
    return [torch.randint(10, vocab // 2, (length,), generator=gen).tolist()
            for _ in range(count)]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def new_generator(model: Any, tokenizer: Tokenizer, jobs: int, prompt: int, gen: int,
                  kv: str, queued: int | None = None) -> Generator:
    """One generator per measured configuration, kept across its runs as a server keeps
    it: CUDA graphs are captured in the warm-up run, not in the measured ones."""
    return Generator(model, tokenizer, max_batch=jobs, num_ctx=prompt + gen + gen // 4 + 8,
                     kv_cache_type=kv, max_queue=queued or jobs)


def parse_jobs(spec: str) -> tuple[int, int | None]:
    """'16' -> (16, None); '16x48' -> (16 slots, 48 jobs through them)."""
    slots, _, queued = spec.strip().partition("x")
    return int(slots), int(queued) if queued else None


def random_adapter(model: Any, rank: int, name: str = "bench") -> str:
    """Load a random rank-`rank` LoRA adapter on all attention and MLP projections."""
    from exl3cli.engine.adapters.lora import load_adapter
    from exl3cli.engine.adapters.peft import LoraPair, PeftAdapter

    config = model.config
    hidden, inter = config.hidden_size, config.intermediate_size
    dim = config.head_dim
    shapes = {"self_attn.q_proj": (hidden, config.num_heads * dim),
              "self_attn.k_proj": (hidden, config.num_kv_heads * dim),
              "self_attn.v_proj": (hidden, config.num_kv_heads * dim),
              "self_attn.o_proj": (config.num_heads * dim, hidden),
              "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter),
              "mlp.down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(rank)
    modules = {f"model.layers.{i}.{m}": LoraPair(
        torch.randn(rank, i_f, generator=gen) / i_f**0.5,
        torch.randn(o_f, rank, generator=gen) * 0.01)
        for i in range(config.num_layers) for m, (i_f, o_f) in shapes.items()}
    adapter = PeftAdapter(name=name, rank=rank, alpha=float(rank), rslora=False, scale=1.0,
                          target_modules=sorted({m.split(".")[-1] for m in shapes}),
                          modules=modules)
    load_adapter(model, adapter)
    return name


def run_jobs(generator: Generator, jobs: int, prompt: int, gen: int,
             seed: int, adapter: str | None = None, sync_steps: bool = False,
             temperature: float = 0.0, queued: int | None = None) -> dict[str, Any]:
    """One measured run: `jobs` concurrent jobs (greedy, or sampled at `temperature` with
    top_k 40 and top_p 0.9, unseeded: on the device); decode-only aggregate tok/s.
    `sync_steps`: the device synchronized after every step's report (module docstring)."""
    options: dict[str, Any] = ({"temperature": temperature, "top_k": 40, "top_p": 0.9}
                               if temperature > 0 else {"temperature": 0})
    model = generator.model
    steps: list[tuple[float, StepReport]] = []
    device = torch.device(model.device)

    def observe(report: StepReport) -> None:
        if sync_steps:
            _synchronize(device)
        steps.append((time.perf_counter(), report))

    generator.step_observers[:] = [observe]
    count = queued or jobs
    lengths = [gen * (3 + i % 3) // 4 for i in range(count)] if queued else [gen] * count
    for ids, length in zip(_prompts(count, prompt, model.config.vocab_size, seed), lengths,
                           strict=True):
        generator.submit(GenerationJob(ids, options, num_predict=length,
                                       ignore_eos=True, adapter=adapter))
    _synchronize(device)
    ahead = generator.launched_ahead
    started = time.perf_counter()
    generator.run_until_done()
    # Decode-only window: from the end of the last step that took prompt tokens.
    last_prefill = max((i for i, (_, r) in enumerate(steps) if r.prefill_tokens), default=-1)
    window_start = steps[last_prefill][0] if last_prefill >= 0 else started
    decode_steps = steps[last_prefill + 1:]
    tokens = sum(r.decode_tokens for _, r in decode_steps)
    seconds = (decode_steps[-1][0] - window_start) if decode_steps else float("nan")
    prefill_tokens = sum(r.prefill_tokens for _, r in steps)
    prefill_seconds = window_start - started
    total = time.perf_counter() - started
    if queued:  # a refilling queue: every token over the whole run, prompts included
        tokens, seconds = sum(lengths), total
        times = [t - (steps[i - 1][0] if i else started) for i, (t, _) in enumerate(steps)]
        prompt_steps = [dt for dt, (_, r) in zip(times, steps, strict=True) if r.prefill_tokens]
    else:
        prompt_steps = []
    return {
        "queued": queued, "prompt_steps": len(prompt_steps),
        "prompt_seconds": sum(prompt_steps),
        "prefill_tokens": prefill_tokens,
        "prefill_tokens_per_s": prefill_tokens / prefill_seconds if prefill_seconds > 0 else 0.0,
        "jobs": jobs, "kv": generator.cache_type.name, "decode_mode": generator.decode.mode,
        "graphs": generator.decode.graph_count, "decode_steps": len(decode_steps), "decode_tokens": tokens,
        "seconds": seconds, "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "kv_bytes_per_token": generator.pool.bytes_per_token(),
        "total_seconds": total,
        "async_step": generator.async_step, "sync_steps": sync_steps, "temperature": temperature,
        "launched_ahead": generator.launched_ahead - ahead,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--jobs", default="1,8,32,128")
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--kv", default="fp16,q4")
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="every job with a random LoRA adapter of this rank")
    parser.add_argument("--sync-steps", action="store_true",
                        default=os.environ.get("EXL3_BENCH_SYNC_STEPS", "0") == "1",
                        help="synchronize the device after every step (the old timing)")
    parser.add_argument("--temperature", type=float,
                        default=float(os.environ.get("EXL3_BENCH_TEMPERATURE", "0")),
                        help="sample at this temperature (top_k 40, top_p 0.9); 0: greedy")
    parser.add_argument("--stacks", type=float, default=0.0,
                        help="print every thread's Python stack to stderr every N seconds")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    if args.stacks > 0:
        # Every N seconds, every thread's Python stack on stderr: where a slow run is.
        faulthandler.dump_traceback_later(args.stacks, repeat=True, file=sys.stderr)

    def progress(what: str) -> None:
        # On stderr with the elapsed time, so a run cut short by a timeout still tells
        # whether loading, the warm-up (graph capture) or the measured runs took the time.
        print(f"[{time.perf_counter() - began:7.1f} s] {what}", file=sys.stderr, flush=True)

    model = load_causal_lm(args.model, device=args.device)
    progress(f"loaded {args.model.name} on {model.device}")
    adapter = random_adapter(model, args.lora_rank) if args.lora_rank > 0 else None
    tokenizer = Tokenizer.from_folder(args.model)
    rows = []
    for kv in args.kv.split(","):
        for jobs, queued in (parse_jobs(j) for j in args.jobs.split(",")):
            generator = new_generator(model, tokenizer, jobs, args.prompt, args.gen, kv,
                                      queued)
            warm = run_jobs(generator, jobs, args.prompt, args.gen, args.seed, adapter,
                            args.sync_steps, args.temperature, queued)
            progress(f"kv {kv} jobs {jobs}: warm-up {warm['total_seconds']:.1f} s "
                     f"({warm['decode_mode']}, {warm['graphs']} graphs)")
            runs = []
            for i in range(max(1, args.repeat)):
                runs.append(run_jobs(generator, jobs, args.prompt, args.gen,
                                     args.seed + 1 + i, adapter, args.sync_steps,
                                     args.temperature, queued))
                progress(f"kv {kv} jobs {jobs}: run {i + 1} {runs[-1]['total_seconds']:.1f} s, "
                         f"{runs[-1]['tokens_per_s']:.1f} tok/s decode, prompts "
                         f"{runs[-1]['prefill_tokens_per_s']:.0f} tok/s")
            for run in runs:
                run["kv"] = kv
            rates = sorted(r["tokens_per_s"] for r in runs)
            row = runs[len(runs) // 2] if len(runs) % 2 else runs[0]
            row = dict(row, tokens_per_s=statistics.median(rates), runs=rates)
            rows.append(row)
            base = next(r for r in rows if r["kv"] == kv)
            row["ratio_to_1_job"] = row["tokens_per_s"] / base["tokens_per_s"]
            if not args.json:
                name = f"{jobs}x{queued}" if queued else str(jobs)
                print(f"kv {kv:5s} jobs {name:>6}  {row['tokens_per_s']:9.1f} tok/s "
                      f"(runs {', '.join(f'{r:.0f}' for r in rates)}; "
                      f"{row['ratio_to_1_job']:5.2f}x 1 job)  "
                      f"KV {row['kv_bytes_per_token']:,.0f} B/token", flush=True)
    if args.json:
        print(json.dumps({"model": str(args.model), "device": str(model.device),
                          "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
