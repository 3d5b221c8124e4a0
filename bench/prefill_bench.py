"""Our prompt ingestion (prefill) through the generator, per EXL3_PREFILL mode, in one
process: tok/s at each prompt length (one chunk per prompt, as ExLlamaV3's generator
with its 2048-token chunks), the last-token logits of each mode against "old", and a
torch.profiler table of one prompt per mode (GPU time by kernel, GPU busy vs wall).

    python bench/prefill_bench.py MODEL_FOLDER [--lengths 512,2048] [--modes old,fp32,fused,half]
        [--reps 5] [--profile 2048] [--json OUT.json]

Timing: `bench_speed`'s job loop (submit, step while prefilling, synchronize), the
median of `--reps` runs after a warm-up per (mode, length); fresh random prompts every
run (no prefix-cache hits).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_profile import _short, union_us  # noqa: E402

from exl3cli.cli.bench_speed import _Generators, _random_prompts, _run_jobs  # noqa: E402
from exl3cli.engine.generation.jobs import GenerationJob  # noqa: E402
from exl3cli.engine.models.loader import load_causal_lm  # noqa: E402
from exl3cli.engine.text.tokenizer import Tokenizer  # noqa: E402


def _prefill_seconds(generators: _Generators, gen: torch.Generator, length: int) -> float:
    generator = generators.get(1, length + 16, length)  # one chunk: the whole prompt
    prompts = _random_prompts(gen, generators.model.config.vocab_size, 1, length)
    return _run_jobs(generator, prompts, 1)[0]


def _last_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, last_logits_only=True)[0, -1].float()


# Kernel kinds of a prompt step, first match wins (cuBLAS names: nvjet / sm90_xmma / cutlass).
KINDS = (("decode", ("decode_kernel",)), ("hadamard+norm", ("hadamard", "norm")),
         ("attention", ("flash", "fmha", "attention", "softmax")),
         ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "sm90")))


def _kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, needles in KINDS if any(n in lowered for n in needles)),
                "other")


def _linear_flop(model: Any, tokens: int) -> float:
    """2 x tokens x the padded weights of every trellis linear but the head (one row)."""
    from exl3cli.engine.layers.linear import Exl3Linear

    return 2.0 * tokens * sum(m.padded_in * m.padded_out for m in model.modules()
                              if isinstance(m, Exl3Linear) and m.mode == "trellis"
                              and m is not model.lm_head)


def _profile(generators: _Generators, gen: torch.Generator, length: int) -> dict[str, Any]:
    generator = generators.get(1, length + 16, length)
    prompts = _random_prompts(gen, generators.model.config.vocab_size, 1, length)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    generator.submit(GenerationJob(prompts[0], {"temperature": 0}, num_predict=2,
                                   ignore_eos=True))
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:  # the prompt steps only
        start = time.perf_counter()
        while generator.prefilling:
            generator.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    while generator.has_work:
        generator.step()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        entry = by_name.setdefault(_short(e.name), [0.0, 0])
        entry[0] += e.time_range.elapsed_us()
        entry[1] += 1
    top = sorted(by_name.items(), key=lambda item: -item[1][0])[:20]
    by_kind: dict[str, float] = {}
    for name, (total, _count) in by_name.items():
        by_kind[_kind(name)] = by_kind.get(_kind(name), 0.0) + total / 1e3
    gemm_ms = by_kind.get("gemm", 0.0)
    flop = _linear_flop(generators.model, length)
    busy = union_us([(e.time_range.start, e.time_range.end) for e in kernels])
    return {"tokens": length, "wall_ms_profiled": wall * 1e3, "gpu_busy_ms": busy / 1e3,
            "kernels": len(kernels), "kernel_ms": sum(v[0] for v in by_name.values()) / 1e3,
            "by_kind_ms": by_kind, "linear_tflop": flop / 1e12,
            "gemm_tflop_s": flop / (gemm_ms * 1e-3) / 1e12 if gemm_ms else None,
            "top": [{"name": n, "ms": t / 1e3, "count": c} for n, (t, c) in top]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--modes", default="old,fp32,fused,half")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--profile", type=int, default=2048, help="0: no profile")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run, no profile")
    args = parser.parse_args(argv)
    lengths = [int(v) for v in args.lengths.split(",")]
    modes = args.modes.split(",")
    cuda = args.device.startswith("cuda")
    model = load_causal_lm(args.model, device=args.device)
    tokenizer = Tokenizer.from_folder(args.model)
    generators = _Generators(model, tokenizer, None)
    gen = torch.Generator().manual_seed(0)
    probe = torch.randint(10, model.config.vocab_size // 2, (1, max(lengths)), generator=gen)
    report: dict[str, Any] = {"model": str(args.model), "device": torch.cuda.get_device_name() if cuda else "cpu",
                              "dtype": str(model.dtype), "modes": {}}
    reference = None
    for mode in modes:
        os.environ["EXL3_PREFILL"] = mode
        row: dict[str, Any] = {"tok_s": {}, "runs_s": {}}
        for length in lengths:
            _prefill_seconds(generators, gen, length)  # warm-up: allocator, cuBLAS, graphs
            runs = [_prefill_seconds(generators, gen, length) for _ in range(args.reps)]
            row["runs_s"][length] = runs
            row["tok_s"][length] = length / statistics.median(runs)
        logits = _last_logits(model, probe.to(model.device))
        if reference is None:
            reference = logits
        row["logits_max_diff_vs_first"] = (logits - reference).abs().max().item()
        row["logits_scale"] = reference.abs().max().item()
        row["same_argmax_as_first"] = bool(logits.argmax() == reference.argmax())
        if args.profile and cuda:
            row["profile"] = _profile(generators, gen, args.profile)
        row["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        report["modes"][mode] = row
        print(f"[{time.strftime('%H:%M:%S')}] {mode}: "
              + ", ".join(f"{n}: {v:,.0f} tok/s" for n, v in row["tok_s"].items()), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    for mode, row in report["modes"].items():
        prof = row.get("profile")
        if prof:
            print(f"\n{mode}: {prof['tokens']} tokens, wall {prof['wall_ms_profiled']:.1f} ms "
                  f"(profiled), GPU busy {prof['gpu_busy_ms']:.1f} ms, {prof['kernels']} kernels")
            kinds = ", ".join(f"{k} {v:.1f}" for k, v in sorted(prof["by_kind_ms"].items()))
            rate = prof["gemm_tflop_s"]
            print(f"  by kind (ms): {kinds}; cuBLAS on {prof['linear_tflop']:.1f} TFLOP: "
                  + (f"{rate:.0f} TFLOP/s" if rate else "-"))
            for k in prof["top"]:
                print(f"  {k['ms']:8.2f} ms  {k['count']:5d}x  {k['name']}")
    print("\nmode    " + "".join(f"{n:>12}" for n in lengths) + "   logits diff / scale, argmax")
    for mode, row in report["modes"].items():
        print(f"{mode:8}" + "".join(f"{row['tok_s'][n]:>12,.0f}" for n in lengths)
              + f"   {row['logits_max_diff_vs_first']:.3g} / {row['logits_scale']:.3g}, "
              + ("same" if row["same_argmax_as_first"] else "DIFFERENT"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
