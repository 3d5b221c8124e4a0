"""Where one job's decode step spends its time on the GPU: kernel time by kind (GEMM,
Hadamard, attention, other), and the time the GPU waits for the host.

    python bench/decode_profile.py MODEL_FOLDER [--gen 48] [--prompt 128] [--kv fp16]
        [--mode graph] [--lora-rank R] [--json]

`--jobs` greedy jobs run through the generator (the path `run` and `serve` use) twice: a
warm-up, then under torch.profiler. Kernel times are summed from the profiler's CUDA
events inside the decode-only window; the GPU's busy time is the union of the
kernel intervals, and the rest of the window is host time the GPU waited for.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.text.tokenizer import Tokenizer

KINDS = (("gemm", ("gemm", "exl3_", "decode_kernel", "trellis")),
         ("hadamard", ("hadamard",)),
         ("attention", ("paged_attention", "combine_chunks", "attention", "softmax", "bmm")),
         ("sampling", ("argmax", "topk", "sort", "multinomial")))


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, needles in KINDS:
        if any(n in lowered for n in needles):
            return kind
    return "other"


def _short(name: str) -> str:
    """A kernel's name without its argument list: 'exl3::...::gemm_kernel<6, 2, 1>'."""
    return name.replace("(anonymous namespace)::", "").split("(")[0][:90]


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def profile(model: Any, tokenizer: Tokenizer, prompt: int, gen: int, kv: str,
            mode: str | None, jobs: int = 1, adapter: str | None = None) -> dict[str, Any]:
    generator = Generator(model, tokenizer, max_batch=jobs, num_ctx=prompt + gen + 8,
                          kv_cache_type=kv, decode_mode=mode, max_prefill_tokens=prompt * jobs)
    seeds = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, model.config.vocab_size // 2, (prompt,), generator=seeds).tolist()
               for _ in range(jobs)]

    def one_job(profiled: bool) -> tuple[int, float, Any]:
        for ids in prompts:
            generator.submit(GenerationJob(ids, {"temperature": 0}, num_predict=gen,
                                           ignore_eos=True, adapter=adapter))
        while generator.step().prefill_tokens:  # the prompt, not profiled
            pass
        activities = [torch.profiler.ProfilerActivity.CPU,
                      torch.profiler.ProfilerActivity.CUDA]
        prof = torch.profiler.profile(activities=activities) if profiled else None
        torch.cuda.synchronize()
        if prof is not None:
            prof.start()
        started, steps = time.perf_counter(), 0
        while generator.has_work:
            generator.step()
            steps += 1
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        if prof is not None:
            prof.stop()
        return steps, seconds, prof

    one_job(False)  # warm-up: graphs captured, kernels built
    steps, plain_s, _ = one_job(False)
    steps, window_s, prof = one_job(True)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        return {"mode": generator.decode.mode, "steps": steps, "error": "no CUDA kernels seen"}
    by_kind: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_kind[kind_of(e.name)] = by_kind.get(kind_of(e.name), 0.0) + e.time_range.elapsed_us()
        entry = by_name.setdefault(_short(e.name), [0.0, 0])
        entry[0] += e.time_range.elapsed_us()
        entry[1] += 1
    top = sorted(by_name.items(), key=lambda item: -item[1][0])[:24]
    busy = union_us([(e.time_range.start, e.time_range.end) for e in kernels])
    per_token = {k: v / steps for k, v in sorted(by_kind.items())}
    return {
        "mode": generator.decode.mode, "kv": kv, "jobs": jobs, "steps": steps,
        "async_step": generator.async_step,
        "adapter": adapter,
        "step_us": plain_s * 1e6 / steps, "kernel_us": per_token,
        "gpu_busy_us": busy / steps, "gpu_wait_us": (plain_s * 1e6 - busy) / steps,
        "kernels_per_step": len(kernels) / steps,
        "top_kernels": [{"name": name, "us_per_step": total / steps, "per_step": count / steps}
                        for name, (total, count) in top],
        "tok_s_profiled": jobs * steps / window_s, "tok_s": jobs * steps / plain_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--gen", type=int, default=48)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--kv", default="fp16")
    parser.add_argument("--mode", default=None, help="graph, static or off")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="every job with a random LoRA adapter of this rank")
    args = parser.parse_args(argv)
    model = load_causal_lm(args.model, device="cuda")
    tokenizer = Tokenizer.from_folder(args.model)
    adapter = None
    if args.lora_rank > 0:
        from generator_throughput import random_adapter
        adapter = random_adapter(model, args.lora_rank)
    result = profile(model, tokenizer, args.prompt, args.gen, args.kv, args.mode, args.jobs,
                     adapter)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"mode {result['mode']}, kv {result.get('kv')}: {result.get('step_us', 0):.0f} us/step "
              f"({result.get('tok_s', 0):.1f} tok/s), {result.get('kernels_per_step', 0):.0f} "
              f"kernels/step, GPU busy {result.get('gpu_busy_us', 0):.0f} us, waiting "
              f"{result.get('gpu_wait_us', 0):.0f} us; by kind (us/step): "
              + ", ".join(f"{k} {v:.0f}" for k, v in result.get("kernel_us", {}).items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
