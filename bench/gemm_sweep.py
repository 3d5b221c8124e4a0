"""The fused GEMM per Llama-3.1-8B decode group at one row, K = 2..6, against the copy
rate, for several split heuristics (warps per SM the splits aim for).

Usage: python3 bench/gemm_sweep.py [--json OUT.json] [--warps 0,16,64] [--rows 1,16] [--ks 2,4]
(warps 0: the default heuristic). The build-time GEMM variant (EXL3_NVCC_FLAGS=
-DEXL3_GEMM_VARIANT=N) is printed and recorded; bench/gemm_ab_table.py compares runs.

Groups are the launches of engine/layers/fused_layer.py: q/k/v as one 3-part launch, o,
gate/up as one 2-part launch, down, and the 6-bit head. Each case rotates over enough
weight copies to defeat the L2 cache, inside a CUDA graph (bench/gpu_kernels.py).
"""

from __future__ import annotations

import argparse
import json

import torch
from gpu_kernels import copy_bandwidth, graph_time

from exl3cli.ops import cuda_kernels as kernels
from exl3cli.ops import layer_kernels

GROUPS = {  # name: (in_features, [out_features per part]), per layer (head: once)
    "qkv": (4096, [4096, 1024, 1024]),
    "o": (4096, [4096]),
    "gate/up": (4096, [14336, 14336]),
    "down": (14336, [4096]),
    "head": (4096, [128256]),
}
L2_DEFEAT_BYTES = 512 << 20


def bench(in_f: int, outs: list[int], k2: int, warps: int, rows: int
          ) -> tuple[float, int, int]:
    kb = in_f // 16
    words = 8 * k2
    nbs = [o // 16 for o in outs]
    group_bytes = sum(kb * nb * words * 2 for nb in nbs)
    copies = max(2, -(-L2_DEFEAT_BYTES // group_bytes))
    gen = torch.Generator(device="cuda").manual_seed(k2)
    sets = [[torch.randint(-32768, 32768, (kb, nb, words), dtype=torch.int16, device="cuda",
                           generator=gen) for nb in nbs] for _ in range(copies)]
    xhs = [torch.randn(rows, in_f, device="cuda").half() for _ in nbs]
    splits = kernels.choose_splits(kb, sum(nbs), torch.device("cuda"), warps or None, rows)
    fns = [lambda t=t: layer_kernels.gemm_parts(xhs, t, k2, "mul1", splits) for t in sets]
    seconds = graph_time(fns)
    del sets
    torch.cuda.empty_cache()
    return seconds, group_bytes, splits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--warps", default="0,16,64", help="0: the default heuristic")
    parser.add_argument("--rows", default="1", help="row counts, e.g. 1,16")
    parser.add_argument("--ks", default="2,3,4,5,6")
    args = parser.parse_args()
    if not kernels.available():
        raise SystemExit(f"CUDA kernels unavailable: {kernels.unavailable_reason()}")
    bw = copy_bandwidth()
    warps_list = [int(w) for w in args.warps.split(",")]
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for rows in rows_list:
        for k in [int(k) for k in args.ks.split(",")]:
            for name, (in_f, outs) in GROUPS.items():
                if name == "head" and k != 6:
                    continue
                for warps in warps_list:
                    seconds, moved, splits = bench(in_f, outs, 2 * k, warps, rows)
                    results.append({"group": name, "k": k, "rows": rows, "warps_per_sm": warps,
                                    "splits": splits, "us": seconds * 1e6,
                                    "pct_copy": 100 * moved / seconds / bw})
    variant = kernels.gemm_variant()
    print(f"copy rate {bw / 1e9:.0f} GB/s (read + write); gemm variant {variant}")
    for rows in rows_list:
        print(f"rows {rows}\n{'group':8}{'K':>3} " + "".join(f"{'w' + str(w):>16}" for w in warps_list))
        for k in sorted({r["k"] for r in results}):
            for name in GROUPS:
                row = [r for r in results if r["k"] == k and r["group"] == name and r["rows"] == rows]
                if row:
                    print(f"{name:8}{k:>3} " + "".join(
                        f"{r['us']:7.1f}us {r['pct_copy']:3.0f}%s{r['splits']:<2}" for r in row))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"copy_GBps": bw / 1e9, "variant": variant, "rows": rows_list,
                       "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
