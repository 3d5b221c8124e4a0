"""Viterbi tile encoder speed: tiles/s of each path, reference vs kernel, in one process.

Paths: the PyTorch reference on the CPU, the C++ CPU kernel, and (with a GPU) the
PyTorch reference on the GPU and the CUDA kernel. Each kernel's states are checked
against the reference on the same tiles (equal states, or the same total cost).

Usage: python3 bench/viterbi_speed.py [--k 2 4] [--tiles 64] [--gpu-tiles 4096]
       [--codebook mul1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from exl3cli.codec.codebooks import codebook_lut_float32
from exl3cli.ops import cpu_kernels, cuda_viterbi
from exl3cli.ops.viterbi import viterbi_states_reference


def _timed(fn, targets: torch.Tensor) -> tuple[torch.Tensor, float]:
    if targets.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    states = fn(targets)
    if targets.is_cuda:
        torch.cuda.synchronize()
    return states, time.perf_counter() - start


def _agreement(states: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor,
               lut: torch.Tensor) -> str:
    states, reference, targets = states.cpu(), reference.cpu(), targets.cpu()
    if torch.equal(states, reference):
        return "same states"
    cost = (lut[states] - targets).pow(2).sum()
    ref_cost = (lut[reference] - targets).pow(2).sum()
    return f"cost ratio {float(cost / ref_cost):.8f}"


def run(k_bits: float, codebook: str, tiles: int, gpu_tiles: int) -> list[dict]:
    rows = []
    lut = codebook_lut_float32(codebook)
    g = torch.Generator().manual_seed(0)
    targets = torch.randn(tiles, 256, generator=g)
    ref_tiles = min(tiles, 16)  # the reference is slow: time it on fewer tiles
    ref_states, ref_s = _timed(
        lambda t: viterbi_states_reference(t, k_bits, codebook), targets[:ref_tiles])
    ref_rate = ref_tiles / ref_s
    rows.append({"path": "torch-cpu", "k": k_bits, "tiles": ref_tiles, "seconds": ref_s,
                 "tiles_per_s": ref_rate, "vs_ref": 1.0, "check": "reference"})
    if cpu_kernels.available():
        cpu_kernels.viterbi_states_cpu(targets[:2], k_bits, codebook)  # warm-up
        states, sec = _timed(lambda t: cpu_kernels.viterbi_states_cpu(t, k_bits, codebook),
                             targets)
        rows.append({"path": f"cpp-cpu ({cpu_kernels.simd_level()})", "k": k_bits,
                     "tiles": tiles, "seconds": sec, "tiles_per_s": tiles / sec,
                     "vs_ref": tiles / sec / ref_rate,
                     "check": _agreement(states[:ref_tiles], ref_states, targets[:ref_tiles],
                                         lut)})
    if torch.cuda.is_available():
        gpu_targets = torch.randn(gpu_tiles, 256, generator=g).cuda()
        n_ref = min(gpu_tiles, 512)
        viterbi_states_reference(gpu_targets[:2], k_bits, codebook)  # warm-up
        gpu_ref, sec = _timed(lambda t: viterbi_states_reference(t, k_bits, codebook),
                              gpu_targets[:n_ref])
        gpu_ref_rate = n_ref / sec
        rows.append({"path": "torch-cuda", "k": k_bits, "tiles": n_ref, "seconds": sec,
                     "tiles_per_s": gpu_ref_rate, "vs_ref": gpu_ref_rate / ref_rate,
                     "check": _agreement(gpu_ref[:ref_tiles], viterbi_states_reference(
                         gpu_targets[:ref_tiles].cpu(), k_bits, codebook),
                         gpu_targets[:ref_tiles], lut)})
        if cuda_viterbi.available():
            cuda_viterbi.viterbi_states_cuda(gpu_targets[:2], k_bits, codebook)  # warm-up
            for n in sorted({36, gpu_tiles}):  # 36: one LDLQ block of a 576-wide layer
                states, sec = _timed(
                    lambda t: cuda_viterbi.viterbi_states_cuda(t, k_bits, codebook),
                    gpu_targets[:n])
                rows.append({"path": f"cuda-kernel x{n}", "k": k_bits, "tiles": n,
                             "seconds": sec, "tiles_per_s": n / sec,
                             "vs_ref": n / sec / gpu_ref_rate,
                             "check": _agreement(states[:n_ref], gpu_ref[: min(n, n_ref)],
                                                 gpu_targets[: min(n, n_ref)], lut)})
        else:
            print(f"cuda kernel unavailable: {cuda_viterbi.unavailable_reason()}")
    else:
        print("no GPU: CPU paths only")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=float, nargs="+", default=[2, 4])
    parser.add_argument("--codebook", default="mul1")
    parser.add_argument("--tiles", type=int, default=64)
    parser.add_argument("--gpu-tiles", type=int, default=4096)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(f"threads={torch.get_num_threads()} codebook={args.codebook}")
    rows = []
    for k in args.k:
        rows += run(k, args.codebook, args.tiles, args.gpu_tiles)
    print(f"{'path':<26}{'K':>5}{'tiles':>7}{'s':>9}{'tiles/s':>11}{'vs ref':>9}  check")
    for r in rows:
        # vs ref: CPU paths against the CPU reference, CUDA kernel against torch-cuda.
        print(f"{r['path']:<26}{r['k']:>5}{r['tiles']:>7}{r['seconds']:>9.3f}"
              f"{r['tiles_per_s']:>11.1f}{r['vs_ref']:>9.1f}  {r['check']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
