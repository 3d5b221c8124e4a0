"""One placement of a model (layers on the GPU, offloaded to the CPU or streamed) and
what it gives: decode tok/s through the generator, prefill tok/s, memory, and a greedy
continuation with its top-5 logits at every position (for offload_table.py's text
identity check). One process per placement, so each memory figure is its own.

    python bench/offload_bench.py MODEL --num-gpu 16 --offload cpu --json OUT.json
        [--device cuda] [--prompt 128] [--gen 64] [--repeat 2] [--greedy 32]
        [--prefill 512]

`--num-gpu -1` leaves the split to the memory plan (EXL3_GPU_MEMORY forces a budget).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generator_throughput import new_generator, run_jobs  # noqa: E402

from exl3cli.engine.kvcache.paged_attention import PagedBatch  # noqa: E402
from exl3cli.engine.kvcache.paged_cache import PagePool, PageTable, pages_for  # noqa: E402
from exl3cli.engine.models.loader import load_causal_lm  # noqa: E402
from exl3cli.engine.text.tokenizer import Tokenizer  # noqa: E402


def kernel_threads() -> int:
    """Threads one loop of the CPU kernels runs on (0: kernels unavailable)."""
    from exl3cli.ops import cpu_kernels

    return cpu_kernels.parallel_threads(256) if cpu_kernels.available() else 0


def _sync(model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def _paged(model, length: int) -> tuple[PagePool, PageTable]:
    config = model.config
    pool = PagePool(pages_for(length + 1), len(model.layers), config.num_kv_heads,
                    config.head_dim, model.dtype, model.device)
    return pool, PageTable(pool)


def greedy_with_logits(model, prompt: list[int], count: int) -> dict:
    """`count` greedy tokens over the paged cache (the model path, no generator), with
    the top-5 (ids, logits) at each position."""
    pool, table = _paged(model, len(prompt) + count)
    table.admit(prompt, len(prompt) + count + 1)
    logits = model(torch.tensor([prompt]), PagedBatch(pool, [table], [prompt]),
                   last_logits_only=True)
    ids, top = [], []
    for _ in range(count):
        row = logits[0, -1].float()
        values, indices = row.topk(5)
        top.append([indices.tolist(), values.tolist()])
        token = int(indices[0])
        ids.append(token)
        logits = model(torch.tensor([[token]]), PagedBatch(pool, [table], [[token]]),
                       last_logits_only=True)
    return {"ids": ids, "top5": top}


def prefill_rate(model, length: int, seed: int) -> float:
    prompt = torch.randint(10, model.config.vocab_size // 2, (length,),
                           generator=torch.Generator().manual_seed(seed)).tolist()
    best = 0.0
    for _ in range(2):  # the first one warms up
        pool, table = _paged(model, length)
        table.admit(prompt, length + 1)
        _sync(model)
        start = time.perf_counter()
        model(torch.tensor([prompt]), PagedBatch(pool, [table], [prompt]), last_logits_only=True)
        _sync(model)
        best = max(best, length / (time.perf_counter() - start))
        del pool, table
    return best


def forced_budget(folder: Path, num_ctx: int, fraction: float) -> int:
    """Device bytes for the fixed part (embeddings, head, cache, workspace) plus
    `fraction` of the decoder layers' bytes, as the memory plan counts them."""
    from exl3cli.engine.models.placement import estimate_memory
    from exl3cli.engine.spec.architecture import load_family_config

    config = load_family_config(folder)
    estimate = estimate_memory(folder, config, torch.float16, num_ctx)
    fixed = estimate.other + estimate.cache_per_layer * len(estimate.layers) + estimate.workspace
    return int(fixed + fraction * sum(estimate.layers))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--num-gpu", type=int, default=-1)
    parser.add_argument("--offload", choices=("cpu", "stream"), default="cpu")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--greedy", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--budget-fraction", type=float, default=None,
                        help="force EXL3_GPU_MEMORY to the fixed part plus this fraction "
                             "of the layers' bytes (a small budget that must offload)")
    parser.add_argument("--label", default=None)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    num_ctx = max(args.prefill, args.prompt + args.gen) + 64
    if args.budget_fraction is not None:
        os.environ["EXL3_GPU_MEMORY"] = str(forced_budget(args.model, num_ctx,
                                                          args.budget_fraction))
    start = time.perf_counter()
    model = load_causal_lm(args.model, device=args.device, gpu_layers=args.num_gpu,
                           offload=args.offload, num_ctx=num_ctx)
    _sync(model)
    load_s = time.perf_counter() - start
    placement = model.placement
    result = {
        "label": args.label or f"num_gpu {args.num_gpu} {args.offload}",
        "num_gpu": args.num_gpu, "offload": args.offload, "device": str(model.device),
        "gpu_layers": placement.gpu_layers, "num_layers": placement.num_layers,
        "streamed": placement.streamed, "processor": placement.processor,
        "gpu_bytes": placement.gpu_bytes, "cpu_bytes": placement.cpu_bytes,
        "load_s": load_s, "threads": torch.get_num_threads(),
        "kernel_threads": kernel_threads(),
        "gpu_memory": os.environ.get("EXL3_GPU_MEMORY", ""),
    }
    tokenizer = Tokenizer.from_folder(args.model)
    generator = new_generator(model, tokenizer, 1, args.prompt, args.gen, "fp16")
    run_jobs(generator, 1, args.prompt, min(args.gen, 16), seed=1)  # warm-up, graphs
    runs = [run_jobs(generator, 1, args.prompt, args.gen, seed=2 + r)
            for r in range(args.repeat)]
    rates = [r["tokens_per_s"] for r in runs]
    result.update(decode_tok_s=statistics.median(rates), decode_runs=rates,
                  decode_mode=runs[-1]["decode_mode"], graphs=runs[-1]["graphs"])
    del generator
    result["prefill_tok_s"] = prefill_rate(model, args.prefill, seed=9)
    prompt = torch.randint(10, model.config.vocab_size // 2, (args.prompt,),
                           generator=torch.Generator().manual_seed(5)).tolist()
    result["greedy"] = greedy_with_logits(model, prompt, args.greedy)
    if model.device.type == "cuda":
        result["max_allocated"] = torch.cuda.max_memory_allocated(model.device)
    args.json.write_text(json.dumps(result))
    print(f"{result['label']}: {placement.processor}, {placement.gpu_layers}/"
          f"{placement.num_layers} layers resident, decode {result['decode_tok_s']:.1f} tok/s "
          f"({result['decode_mode']}), prefill {result['prefill_tok_s']:.0f} tok/s, "
          f"load {load_s:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
