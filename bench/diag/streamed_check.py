"""Device diagnostic for tests/engine/test_streamed_cuda.py's static-mode mismatch:
whole vs streamed greedy tokens, each generated twice (is either side itself
nondeterministic?). Run it under CUDA_LAUNCH_BLOCKING=1 and EXL3_FUSED_LAYER=0 as well:
    python bench/diag/streamed_check.py"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from exl3cli.convert.synthetic import write_synthetic_model  # noqa: E402
from tests.engine.test_streamed_cuda import _fixed_and_layers, _generate, _load  # noqa: E402


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), -1)


def main() -> None:
    folder = write_synthetic_model(Path(tempfile.mkdtemp()), "smollm2-135m", bits=3.5,
                                   head_bits=6, num_layers=5, seed=7)
    whole = _load(folder)
    fixed, layers = _fixed_and_layers(folder)
    os.environ["EXL3_GPU_MEMORY"] = str(fixed + layers[0] + 2 * max(layers[1:]))
    streamed = _load(folder, offload="stream")
    tag = (f"blocking={os.environ.get('CUDA_LAUNCH_BLOCKING', '0')} "
           f"fused={os.environ.get('EXL3_FUSED_LAYER', '1')}")
    for mode, fill in (("static", float("nan")), ("static", 0.0), ("static", 1e4)):
        # The allocator's free blocks filled before each generation: a kernel that reads
        # memory it never wrote (pages past a row's length, a workspace) shows up here.
        runs = []
        for _ in range(3):
            torch.cuda.synchronize()
            block = torch.full((1 << 28,), fill, dtype=torch.float16, device="cuda")
            del block
            runs.append(_generate(whole, folder, mode)[0])
        print(f"{tag} {mode} poisoned {fill}: run2 vs run1 {first_diff(runs[0], runs[1])}, "
              f"run3 vs run1 {first_diff(runs[0], runs[2])}", flush=True)
    for mode in ("static", "graph"):
        w1, _ = _generate(whole, folder, mode)
        w2, _ = _generate(whole, folder, mode)
        s1, ran1 = _generate(streamed, folder, mode)
        s2, _ = _generate(streamed, folder, mode)
        print(f"{tag} {mode:6s} ran={ran1} whole-vs-whole {first_diff(w1, w2)} "
              f"streamed-vs-streamed {first_diff(s1, s2)} whole-vs-streamed "
              f"{first_diff(w1, s1)} (of {len(w1)})", flush=True)


if __name__ == "__main__":
    main()
