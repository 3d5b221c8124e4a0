"""CPU EXL3 product A/B: the checkout's csrc/ops/cpu/exl3_gemm_cpu.cpp against the same file
at a git revision, both built in this process (the base under the op namespace exl3_base),
called alternately, timed on the calling thread's CPU clock (what other jobs on a shared
machine inflate least; bench/NOTES-cpu-exl3.md).

    python3 bench/cpu_exl3_kernel.py [--base HEAD] [--set kernel|smol|qwen] [--rows 1]
        [--rounds 5] [--flags "-DEXL3_CPU_NO_VBMI"]

--set kernel: single products (in L2), G weights per CPU-second of each build;
smol / qwen: every product of one decode token of that shape (its own random trellis, so
they stream from memory as in the model), then the head. Prints each build's median and
new/base, and the largest difference of the outputs (float32 summation order only).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from exl3cli.codec.bitstream import words_per_tile

ROOT = Path(__file__).resolve().parents[1]
CPU = ROOT / "csrc" / "ops" / "cpu"
KERNEL = [(640, 1536, 2), (640, 1536, 3), (640, 1536, 4), (640, 1536, 5), (640, 1536, 6),
          (896, 4864, 4), (4864, 896, 4), (640, 49152, 6)]
SMOL = [(640, 640, 4), (640, 256, 4), (640, 256, 4), (640, 640, 4), (640, 1536, 4),
        (640, 1536, 4), (1536, 640, 4)] * 30 + [(640, 49152, 6)]
QWEN = [(896, 896, 4), (896, 128, 4), (896, 128, 4), (896, 896, 4), (896, 4864, 4),
        (896, 4864, 4), (4864, 896, 4)] * 24 + [(896, 151936, 6)]


def build(base: str, flags: list[str], work: Path) -> None:
    """Load the checkout's kernel (ops exl3_cpu) and the base revision's (ops exl3_base)."""
    base_dir = work / "base"
    base_dir.mkdir()
    for name in ("exl3_gemm_cpu.cpp", "exl3_gemm_cpu.h", "exl3_step_gemv.h"):
        shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{base}:csrc/ops/cpu/{name}"],
                               capture_output=True, text=True)
        if shown.returncode == 0:
            text = re.sub(r"\bexl3_cpu\b", "exl3_base", shown.stdout)
            (base_dir / name).write_text(text)
    cflags = ["-O3", "-march=native", *flags]
    for name, source, include in (("exl3_kernel_base", base_dir / "exl3_gemm_cpu.cpp", base_dir),
                                  ("exl3_kernel_new", CPU / "exl3_gemm_cpu.cpp", CPU)):
        out = work / name
        out.mkdir()
        cpp_extension.load(name=name, sources=[str(source)], extra_cflags=cflags,
                           extra_include_paths=[str(include)], build_directory=str(out),
                           is_python_module=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD")
    parser.add_argument("--set", choices=("kernel", "smol", "qwen"), default="kernel")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--flags", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as work:
        build(args.base, args.flags.split(), Path(work))
    ops = {"base": torch.ops.exl3_base.exl3_matmul, "new": torch.ops.exl3_cpu.exl3_matmul}
    g = torch.Generator().manual_seed(0)
    shapes = {"kernel": KERNEL, "smol": SMOL, "qwen": QWEN}[args.set]
    groups = [[s] for s in shapes] if args.set == "kernel" else [shapes]
    for group in groups:
        mats = [(torch.randint(-32768, 32768, (n // 16, k // 16, words_per_tile(b)), generator=g,
                               dtype=torch.int32).to(torch.int16),
                 torch.randn(args.rows, k, generator=g), float(b)) for k, n, b in group]
        weights = sum(k * n for k, n, _ in group)
        calls = max(1, int(2e8 / weights))
        diff = max(float((ops["base"](x, t, b, 2, None) - ops["new"](x, t, b, 2, None)).abs().max()
                         / ops["base"](x, t, b, 2, None).abs().max()) for t, x, b in mats)
        times: dict[str, list[float]] = {name: [] for name in ops}
        for _ in range(args.rounds):
            for name, op in ops.items():
                start = time.thread_time()
                for _ in range(calls):
                    for t, x, b in mats:
                        op(x, t, b, 2, None)
                times[name].append((time.thread_time() - start) / calls)
        rate = {name: weights / statistics.median(v) / 1e9 for name, v in times.items()}
        label = (f"{group[0][0]}x{group[0][1]} K={group[0][2]:g}" if len(group) == 1
                 else f"{args.set} token ({len(group)} products)")
        print(f"{label} rows={args.rows}: base {rate['base']:.2f}  new {rate['new']:.2f} "
              f"G weights/CPU-s  new/base time {rate['base'] / rate['new']:.3f}  "
              f"max diff {diff:.1e} of max|y|", flush=True)


if __name__ == "__main__":
    main()
