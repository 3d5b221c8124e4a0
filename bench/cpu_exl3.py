"""EXL3 on the CPU: resident memory and speed of one CPU weight mode, one process per
mode so each RSS figure is its own (bench/NOTES-cpu-exl3.md).

    python3 bench/cpu_exl3.py MODEL_FOLDER [--modes exl3,fp32,int8] [--threads 1]
        [--prompt-tokens 512] [--new-tokens 64] [--repeats 3]

Per mode: the process's resident memory (anonymous + file-backed, from
/proc/self/status) before and after `load_causal_lm`, and at the end of one prompt +
generation with its paged cache still held, as a ratio to the folder's size plus that
cache (issue 15: within 1.15x); prompt and generation tok/s on the paged cache (cpu_decode.py's
timer: what the generator runs). A synthetic folder (bench/synthetic_model.py) is
enough: speed and memory do not depend on the weights' values.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch


def rss_mib() -> tuple[float, float]:
    """(anonymous, file-backed) resident MiB of this process."""
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            found[key] = int(value.split()[0]) / 1024
    return found["RssAnon"], found["RssFile"]


def held_rss(model, prompt: torch.Tensor, new_tokens: int) -> tuple[float, float, float]:
    """(anon, file, cache) MiB at the end of one prompt + generation, the paged cache
    still held (what a loaded model with one conversation holds)."""
    from exl3cli.engine.kvcache.paged_attention import PagedBatch
    from exl3cli.engine.kvcache.paged_cache import PagePool, PageTable, pages_for

    config, total = model.config, prompt.shape[1] + new_tokens + 1
    pool = PagePool(pages_for(total), len(model.layers), config.num_kv_heads,
                    config.head_dim, model.dtype, model.device)
    table, ids = PageTable(pool), prompt[0].tolist()
    table.admit(ids, total)
    logits = model(prompt, PagedBatch(pool, [table], [ids]), last_logits_only=True)
    for _ in range(new_tokens):
        token = int(logits[0, -1].argmax())
        logits = model(torch.tensor([[token]]), PagedBatch(pool, [table], [[token]]),
                       last_logits_only=True)
    cache = sum(t.numel() * t.element_size() for t in pool.keys + pool.values) / 2**20
    return (*rss_mib(), cache)


def time_both(model, prompt: torch.Tensor, new_tokens: int) -> tuple[float, float, float, float]:
    """cpu_decode.time_ours with two clocks: (prompt, generation) tok/s over wall time,
    then over the process's CPU time (user + system of all its threads: what a shared
    machine's other jobs do not inflate, bench/NOTES-cpu-exl3.md)."""
    from exl3cli.engine.kvcache.paged_attention import PagedBatch
    from exl3cli.engine.kvcache.paged_cache import PagePool, PageTable, pages_for

    config, total = model.config, prompt.shape[1] + new_tokens + 1
    pool = PagePool(pages_for(total), len(model.layers), config.num_kv_heads,
                    config.head_dim, model.dtype, model.device)
    table, ids = PageTable(pool), prompt[0].tolist()
    table.admit(ids, total)
    wall, cpu = time.perf_counter(), time.process_time()
    logits = model(prompt, PagedBatch(pool, [table], [ids]), last_logits_only=True)
    prompt_wall, prompt_cpu = time.perf_counter() - wall, time.process_time() - cpu
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(new_tokens):
        token = int(logits[0, -1].argmax())
        logits = model(torch.tensor([[token]]), PagedBatch(pool, [table], [[token]]),
                       last_logits_only=True)
    gen_wall, gen_cpu = time.perf_counter() - wall, time.process_time() - cpu
    n = prompt.shape[1]
    return n / prompt_wall, new_tokens / gen_wall, n / prompt_cpu, new_tokens / gen_cpu


def one_mode(args: argparse.Namespace) -> None:
    from cpu_decode import best_of

    from exl3cli.engine.models.loader import load_causal_lm

    if args.threads:
        torch.set_num_threads(args.threads)
    folder = Path(args.model)
    anon0, file0 = rss_mib()
    model = load_causal_lm(folder, "cpu", torch.float32, cpu_weights=args.mode,
                           num_ctx=args.prompt_tokens + args.new_tokens)
    anon1, file1 = rss_mib()
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 2**20
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens),
                           generator=torch.Generator().manual_seed(0))
    anon2, file2, cache = held_rss(model, prompt, args.new_tokens)
    held = anon2 - anon0 + file2 - file0
    time_both(model, prompt[:, :16], 4)  # warm-up
    prompt_rate, gen_rate, prompt_cpu, gen_cpu = best_of(args.repeats, time_both, model,
                                                         prompt, args.new_tokens)
    print(f"{args.mode:5s} threads={torch.get_num_threads()} file {size:7.1f} MiB | load "
          f"+{anon1 - anon0:6.1f} anon +{file1 - file0:6.1f} file MiB | cache held "
          f"{cache:5.1f} MiB: +{anon2 - anon0:6.1f} anon +{file2 - file0:6.1f} file MiB = "
          f"{held / (size + cache):.2f}x (file + cache) | prompt "
          f"{prompt_rate:7.1f} tok/s  generation {gen_rate:6.1f} tok/s | per CPU-second: "
          f"prompt {prompt_cpu:7.1f} generation {gen_cpu:6.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--modes", default="exl3,fp32,int8")
    parser.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # one child
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.mode:
        one_mode(args)
        return
    passed = [a for a in sys.argv[1:]]
    for mode in args.modes.split(","):
        subprocess.run([sys.executable, __file__, *passed, "--mode", mode], check=True)


if __name__ == "__main__":
    main()
