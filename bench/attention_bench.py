"""Decode attention over the paged cache and the cache write, per layer, fp16 against
quantized pages: the kernels alone, inside CUDA graphs (bench/gpu_kernels.py timing).

Usage: python3 bench/attention_bench.py [--json OUT.json]

Llama-3.1-8B's attention shape (32 query heads, 8 kv heads, head dim 128) at 1, 16 and 64
rows, and Llama-3.2-1B's (head dim 64) at 64 rows; page size 256, every row at the same
context length; one layer's pool.
"""

from __future__ import annotations

import argparse
import json

import torch
from gpu_kernels import graph_time

from exl3cli.engine.kvcache.kv_quant import parse_kv_cache_type
from exl3cli.engine.kvcache.paged_cache import PagePool
from exl3cli.ops import cuda_kernels as kernels

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 256


def case(kind: str, batch: int, context: int, dim: int = DIM) -> dict:
    pages_per_row = -(-context // PAGE)
    pool = PagePool(batch * pages_per_row + 1, 1, KV_HEADS, dim, torch.float16, "cuda",
                    parse_kv_cache_type(kind), PAGE)
    gen = torch.Generator(device="cuda").manual_seed(batch)
    table = torch.arange(batch * pages_per_row, device="cuda").view(batch, pages_per_row)
    all_slots = (table[:, :, None] * PAGE + torch.arange(PAGE, device="cuda")).reshape(-1)
    keys = torch.randn(all_slots.numel(), KV_HEADS, dim, device="cuda", generator=gen).half()
    pool.write(0, all_slots, keys, keys)
    lengths = torch.full((batch,), context, dtype=torch.long, device="cuda")
    query = torch.randn(batch, HEADS, dim, device="cuda", generator=gen).half()
    new = torch.randn(batch, KV_HEADS, dim, device="cuda", generator=gen).half()
    write_slots = table[:, 0] * PAGE + (context - 1) % PAGE
    store = pool.keys[0], pool.values[0]
    bits = pool.cache_type.key_bits, pool.cache_type.value_bits

    def attend():
        return kernels.paged_attention(query, store[0], store[1], bits[0], bits[1], table,
                                       lengths, PAGE, None)

    assert attend() is not None, "no kernel for this case"
    return {"kv": kind, "dim": dim, "batch": batch, "context": context,
            "attention_us": graph_time([attend] * 8) * 1e6,
            "write_us": graph_time([lambda: pool.write(0, write_slots, new, new)] * 8) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true", help="64 rows only (A/B runs)")
    args = parser.parse_args()
    batches = (64,) if args.quick else (1, 16, 64)
    results = [case(kind, batch, context) for context in (192, 2048) for batch in batches
               for kind in ("fp16", "q4", "q8")]
    results += [case(kind, 64, context, 64) for context in (192, 2048) for kind in ("fp16", "q4")]
    print(f"{'kv':5}{'dim':>4}{'batch':>6}{'context':>8}{'attention us':>14}{'write us':>10}")
    for r in results:
        print(f"{r['kv']:5}{r['dim']:>4}{r['batch']:>6}{r['context']:>8}{r['attention_us']:>14.1f}"
              f"{r['write_us']:>10.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
