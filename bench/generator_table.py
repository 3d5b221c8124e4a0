"""The table of bench/gpu_generator.sh: our generator against ExLlamaV3's at each job
count, from the JSON files that script leaves in its output folder.

    python bench/generator_table.py OUT_FOLDER [MODELS]

MODELS: the comma-separated model tags of the JSON/log names (default 8b,1b;
bench/gpu_moe.sh passes qwen3,mixtral).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:5.2f}x" if a and b else "    -"


def ours(folder: Path, model: str) -> dict[tuple[str, int], float]:
    report = _json(folder / f"ours-{model}.json") or {}
    return {(row["kv"], row["jobs"]): row["tokens_per_s"] for row in report.get("rows", [])}


def peer(folder: Path, model: str, kv: int) -> dict[int, float]:
    """Median aggregate decode tok/s per job count over the peer's measured runs."""
    runs: dict[int, list[float]] = {}
    try:
        lines = (folder / f"peer-{model}-kv{kv}.log").read_text().splitlines()
    except OSError:
        return {}
    for line in lines:
        if line.startswith('{"jobs"'):
            row = json.loads(line)
            runs.setdefault(row["jobs"], []).append(row["agg_decode_tok_s"])
    return {jobs: statistics.median(values) for jobs, values in runs.items()}


def main(folder: Path, models: tuple[str, ...] = ("8b", "1b")) -> None:
    fmt = lambda v: f"{v:8.1f}" if v else "       -"  # noqa: E731
    print(f"{'model':<8}{'jobs':>5} | {'ours fp16':>9}{'ours q4':>9}{'q4/fp16':>8} | "
          f"{'peer fp16':>9}{'peer q4':>9} | {'fp16 vs peer':>12}{'q4 vs peer':>11}")
    for model in models:
        mine, theirs, theirs4 = ours(folder, model), peer(folder, model, 16), peer(folder, model, 4)
        for jobs in sorted({j for _, j in mine} | set(theirs)):
            a, b = mine.get(("fp16", jobs)), mine.get(("q4", jobs))
            c, d = theirs.get(jobs), theirs4.get(jobs)
            print(f"{model:<8}{jobs:>5} | {fmt(a)} {fmt(b)} {ratio(b, a):>7} | {fmt(c)} "
                  f"{fmt(d)} | {ratio(a, c):>12}{ratio(b, d):>11}")
    for model in models:
        rows = (_json(folder / f"ours-{model}.json") or {}).get("rows", [])
        if rows:
            print(f"{model} decode modes: " + ", ".join(
                f"{r['kv']}/{r['jobs']}: {r.get('decode_mode')} ({r.get('graphs')} graphs)"
                for r in rows))
        halves = ours(folder, f"{model}-halves").get(("fp16", 64))
        if halves:
            print(f"{model} 64 jobs, fp16, EXL3_GEMM_WIDE=halves: {halves:.1f} tok/s")
        pdl, plain = ours(folder, f"{model}-pdl"), ours(folder, model)
        for (kv, jobs), value in sorted(pdl.items()):
            before = plain.get((kv, jobs))
            print(f"{model} {jobs} jobs, {kv}, EXL3_PDL=1: {value:.1f} tok/s; plain launches "
                  f"{before or 0:.1f} ({ratio(value, before).strip()})")
        for path in sorted(folder.glob(f"ours-{model}-lora*.json")):
            variant = path.stem.removeprefix(f"ours-{model}-")
            for (kv, jobs), value in sorted(ours(folder, f"{model}-{variant}").items()):
                bare = plain.get((kv, jobs))
                print(f"{model} {jobs} jobs, {kv}, rank-16 LoRA on every projection ({variant}): "
                      f"{value:.1f} tok/s; without {bare or 0:.1f} ({ratio(value, bare).strip()})")
        _variant_rows(folder, model, plain, "moe", "MoE variant")  # gpu_moe.sh MOE_VARIANTS
        for path in sorted(folder.glob(f"ours-{model}-fold-*.json")):  # FOLD_VARIANTS
            variant = path.stem.removeprefix(f"ours-{model}-fold-")
            for (kv, jobs), value in sorted(ours(folder, f"{model}-fold-{variant}").items()):
                base = plain.get((kv, jobs))
                print(f"{model} {jobs} jobs, {kv}, EXL3_LAYER_FOLD={variant}: {value:.1f} "
                      f"tok/s; default {base or 0:.1f} (variant / default {ratio(value, base).strip()})")
        _variant_rows(folder, model, plain, "async", "async variant")  # ASYNC_VARIANTS
        for path in sorted(folder.glob(f"profile-{model}-async-*.json")):
            _print_profile(f"{model} 1 job, async {path.stem.removeprefix(f'profile-{model}-async-')}",
                           _json(path), 8)
        for path in sorted(folder.glob(f"profile-{model}-fold-*.json")):
            name = path.stem.removeprefix(f"profile-{model}-fold-")
            _print_profile(f"{model} 1 job, fold {name}", _json(path), 12)
        for path in sorted(folder.glob(f"profile-{model}-moe-*.json")):
            _print_profile(f"{model} 1 job, {path.stem.removeprefix(f'profile-{model}-moe-')}",
                           _json(path), 14)
        unfused, fused = ours(folder, f"{model}-unfused"), ours(folder, model)
        for (kv, jobs), value in sorted(unfused.items()):
            now = fused.get((kv, jobs))
            print(f"{model} {jobs} jobs, {kv}, EXL3_FUSED_LAYER=0 (unfused layer): "
                  f"{value:.1f} tok/s; fused {now or 0:.1f} ({ratio(now, value).strip()})")
    _ab_gen_rows(folder)
    for jobs, kv in [(j, kv) for j in (1, 16, 64) for kv in ("", "-q4", "-lora", "-q4-lora")]:
        prof = _json(folder / f"profile-{jobs}{kv}.json")
        if prof:
            _print_profile(f"8b {jobs} jobs{kv}", prof, 12 if "lora" in kv else 8)


def _ab_gen_rows(folder: Path) -> None:
    """gpu_generator.sh's AB_BENCH=gen: the 8B generator per kernel build, against v0."""
    runs = {int(p.stem.removeprefix("ab-gen-")): p for p in folder.glob("ab-gen-*.json")
            if p.stem.removeprefix("ab-gen-").isdigit()}
    base = {}
    for i in sorted(runs):
        report = _json(runs[i]) or {}
        values = {(r["kv"], r["jobs"]): r["tokens_per_s"] for r in report.get("rows", [])}
        base = base or values
        print(f"8b ab variant {i}: " + ", ".join(
            f"{kv}/{jobs} {v:.1f} tok/s ({ratio(v, base.get((kv, jobs))).strip()} of v0)"
            for (kv, jobs), v in sorted(values.items())))


def _variant_rows(folder: Path, model: str, plain: dict, tag: str, label: str) -> None:
    """One line per job count of each `ours-MODEL-TAG-VARIANT.json`, against `plain`."""
    for path in sorted(folder.glob(f"ours-{model}-{tag}-*.json")):
        variant = path.stem.removeprefix(f"ours-{model}-{tag}-")
        for (kv, jobs), value in sorted(ours(folder, f"{model}-{tag}-{variant}").items()):
            base = plain.get((kv, jobs))
            print(f"{model} {jobs} jobs, {kv}, {label} {variant}: {value:.1f} tok/s; "
                  f"default {base or 0:.1f} (default / variant {ratio(base, value).strip()})")


def _print_profile(label: str, prof: Any, top_n: int) -> None:
    """One bench/decode_profile.py result: the step, kernel kinds and the top kernels."""
    if not prof or "kernel_us" not in prof:
        print(f"profile {label}: {prof}")
        return
    kinds = ", ".join(f"{k} {v:.0f}" for k, v in prof["kernel_us"].items())
    print(f"{label}, {prof['mode']}: {prof['step_us']:.0f} us/step ({prof['tok_s']:.1f} "
          f"tok/s), {prof['kernels_per_step']:.0f} kernels/step; GPU busy "
          f"{prof['gpu_busy_us']:.0f} us, waiting {prof['gpu_wait_us']:.0f} us; "
          f"kernel us/step: {kinds}")
    for top in prof.get("top_kernels", [])[:top_n]:
        print(f"    {top['us_per_step']:8.1f} us/step  x{top['per_step']:5.1f}  {top['name']}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else ("8b", "1b"))
