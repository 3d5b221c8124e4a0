"""The CPU EXL3 projections of one Llama-3.1-8B-shape decoder layer at 1..N threads: what
an offloaded layer (engine/layers/offload.py) or a CPU-only model runs per token, in
weight bytes per second (issue 15, bench/NOTES-cpu-exl3.md "Offload: one thread").

    python3 bench/cpu_threads.py [--threads 1,2] [--rows 1,128] [--layers 2] [--bits 4]
        [--hidden 4096] [--inter 14336] [--kv 1024] [--rounds 5]

Random trellises (speed does not depend on the values), `--layers` copies so a token's
weights stream from memory, not cache, as in a model. Every (threads, rows) row prints
the median wall time of `--rounds` passes over all projections, G weights/s and GB/s of
trellis read; `parallel_threads` says how many threads one kernel loop really used (1
on a build without OpenMP, whatever torch.set_num_threads says).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from exl3cli.codec.bitstream import words_per_tile
from exl3cli.ops import cpu_kernels


def projections(hidden: int, inter: int, kv: int) -> list[tuple[int, int]]:
    """(in, out) of q, k, v, o, gate, up, down."""
    return [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden),
            (hidden, inter), (hidden, inter), (inter, hidden)]


def random_layer(shape: tuple[int, int], bits: int, gen: torch.Generator) -> tuple:
    """(trellis_t, suh, svh, out) of a random mul1 layer."""
    n_in, n_out = shape
    trellis = torch.randint(-32768, 32768, (n_out // 16, n_in // 16, words_per_tile(bits)),
                            dtype=torch.int16, generator=gen)
    suh = torch.randn(n_in, generator=gen).sign()
    svh = torch.rand(n_out, generator=gen) * 0.01
    return trellis, suh, svh, n_out


def one_pass(layers: list[tuple], x_of: dict[int, torch.Tensor], bits: int) -> None:
    for trellis, suh, svh, n_out in layers:
        x = x_of[trellis.shape[1] * 16]
        cpu_kernels.exl3_linear_cpu(x, trellis, suh, svh, None, bits, "mul1", n_out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rows", default="1,128")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--inter", type=int, default=14336)
    parser.add_argument("--kv", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not cpu_kernels.available():
        raise SystemExit(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    gen = torch.Generator().manual_seed(0)
    shapes = projections(args.hidden, args.inter, args.kv)
    layers = [random_layer(s, args.bits, gen) for _ in range(args.layers) for s in shapes]
    weights = sum(t.shape[0] * t.shape[1] * 256 for t, *_ in layers)
    nbytes = sum(t.numel() * 2 for t, *_ in layers)
    probe = getattr(cpu_kernels, "parallel_threads", None)
    print(f"{args.layers} layers x 7 projections, K={args.bits}: {weights / 1e6:.0f} M weights, "
          f"{nbytes / 1e6:.0f} MB of trellis; {torch.get_num_threads()} torch threads "
          f"by default; CPU kernels {cpu_kernels.simd_level()}")
    print("threads | rows | kernel threads | ms/pass | G weights/s | GB/s | tok/s (rows/s)")
    for rows in [int(r) for r in args.rows.split(",")]:
        x_of = {n: torch.randn(rows, n, generator=gen) for n in {s[0] for s in shapes}}
        for threads in [int(t) for t in args.threads.split(",")]:
            torch.set_num_threads(threads)
            used = probe(256) if probe is not None else 1
            one_pass(layers, x_of, args.bits)  # warm-up
            times = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                one_pass(layers, x_of, args.bits)
                times.append(time.perf_counter() - start)
            t = statistics.median(times)
            print(f"{threads} | {rows} | {used} | {t * 1e3:.1f} | {weights / t / 1e9:.2f} | "
                  f"{nbytes / t / 1e9:.2f} | {rows / t:.1f}")


if __name__ == "__main__":
    main()
