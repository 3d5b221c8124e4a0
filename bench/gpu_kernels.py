"""Time the EXL3 CUDA kernels on Llama-3.1-8B linear shapes against copy bandwidth.

Usage: python3 bench/gpu_kernels.py [--json OUT.json] [--quick]

Each case rotates over enough copies of the packed weight to exceed the L2 cache and
runs the launches inside a CUDA graph (so launch gaps don't count), timed with CUDA
events; the median of several replays is reported. GB/s counts the bytes the kernel
must move (trellis read; plus the float16 write for the decode kernel); "% copy" is
that over the measured device-to-device copy bandwidth (bytes read + written).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from exl3cli.ops import cuda_kernels as kernels

SHAPES = {  # name: (in_features, out_features)
    "qkvo 4096x4096": (4096, 4096),
    "up/gate 4096x14336": (4096, 14336),
    "down 14336x4096": (14336, 4096),
    "head 4096x128256": (4096, 128256),
}
L2_DEFEAT_BYTES = 512 << 20


def graph_time(fns: list, replays: int = 20) -> float:
    """Median seconds per call over a CUDA graph of all ``fns`` replayed ``replays`` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:  # warm-up outside the graph (allocations, lazy init)
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(fns))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (1 GiB buffers)."""
    a = torch.randn(1 << 28, device="cuda")
    b = torch.empty_like(a)
    for _ in range(400):  # ~0.2 s of copies: let the clocks ramp up from idle first
        b.copy_(a)
    torch.cuda.synchronize()
    seconds = graph_time([lambda: b.copy_(a)] * 10)
    return 2 * a.numel() * 4 / seconds


def bench_shape(name: str, in_f: int, out_f: int, k: float, bw: float, quick: bool) -> list:
    kb, nb = in_f // 16, out_f // 16
    words = int(16 * k)
    weight_bytes = kb * nb * words * 2
    copies = max(2, -(-L2_DEFEAT_BYTES // weight_bytes))
    gen = torch.Generator(device="cuda").manual_seed(0)
    trellises = [torch.randint(-32768, 32768, (kb, nb, words), dtype=torch.int16,
                               device="cuda", generator=gen) for _ in range(copies)]
    suh = torch.randn(in_f, device="cuda").sign()
    svh = torch.randn(out_f, device="cuda").sign()
    ext = kernels._extension()
    k2 = int(2 * k)
    splits = kernels.choose_splits(kb, nb, torch.device("cuda"))
    rows_list = (1,) if quick else (1, 8, 32)
    results = []

    def record(kernel: str, rows: int, seconds: float, moved: int) -> None:
        gbs = moved / seconds / 1e9
        results.append({"shape": name, "k": k, "kernel": kernel, "rows": rows,
                        "us": seconds * 1e6, "GB/s": gbs, "pct_copy": 100 * gbs * 1e9 / bw,
                        "splits": splits})

    for rows in rows_list:
        xh = torch.randn(rows, in_f, device="cuda").half()
        part = torch.empty(splits, rows, out_f, device="cuda")
        fns = [lambda t=t, a=xh, p=part: ext.gemm_partial(a, t, k2, 2, p) for t in trellises]
        record("fused gemm (kernel)", rows, graph_time(fns), weight_bytes)
        x = torch.randn(rows, in_f, device="cuda").half()
        fns = [lambda t=t, a=x: kernels.exl3_gemm(a, t, suh, svh, k, "mul1") for t in trellises]
        record("exl3_gemm (3 kernels)", rows, graph_time(fns), weight_bytes)

    out = torch.empty(in_f, out_f, dtype=torch.float16, device="cuda")
    fns = [lambda t=t: ext.decode(t, k2, 2, out) for t in trellises[:2]]
    record("decode to fp16", 0, graph_time(fns), weight_bytes + in_f * out_f * 2)
    if not quick and out_f <= 14336:
        rows = 2048
        x = torch.randn(rows, in_f, device="cuda").half()
        fns = [lambda t=t: kernels.exl3_gemm(x, t, suh, svh, k, "mul1") for t in trellises[:2]]
        record("decode + cuBLAS (prefill)", rows, graph_time(fns, 10),
               weight_bytes + in_f * out_f * 4)
    del trellises
    torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write all results here")
    parser.add_argument("--quick", action="store_true", help="batch 1 only")
    args = parser.parse_args()
    if not kernels.available():
        raise SystemExit(f"CUDA kernels unavailable: {kernels.unavailable_reason()}")
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    print(f"device: {props.name}, {props.multi_processor_count} SMs; "
          f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
    results = []
    cases = [(n, i, o, 4.0) for n, (i, o) in SHAPES.items()] + [
        ("head 4096x128256", 4096, 128256, 6.0)]
    for name, in_f, out_f, k in cases:
        results.extend(bench_shape(name, in_f, out_f, k, bw, args.quick))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": props.name, "copy_GBps": bw / 1e9, "results": results}, fh,
                      indent=1)
    print(f"\n{'shape':20} {'K':>3} {'kernel':27} {'rows':>5} {'us':>9} {'GB/s':>7} {'%copy':>6}")
    for r in results:
        print(f"{r['shape']:20} {r['k']:>3g} {r['kernel']:27} {r['rows']:>5} {r['us']:>9.1f} "
              f"{r['GB/s']:>7.0f} {r['pct_copy']:>5.0f}%")
    # Llama-3.1-8B per-token weight traffic at batch 1: 32 layers of q,k,v,o,gate,up,down.
    per_layer = {"qkvo 4096x4096": 2 + 2 * 0.25, "up/gate 4096x14336": 2, "down 14336x4096": 1}
    gemv = {r["shape"]: r["us"] for r in results
            if r["kernel"] == "exl3_gemm (3 kernels)" and r["rows"] == 1 and r["k"] == 4}
    if all(s in gemv for s in per_layer):
        # k/v projections are 4096x1024: counted as a quarter of a 4096x4096 each.
        layer_us = sum(gemv[s] * n for s, n in per_layer.items())
        print(f"\nestimated linear-layer time per token (32 layers + K=4 head): "
              f"{(32 * layer_us + gemv['head 4096x128256']) / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
