"""The table of a GEMM A/B (bench/gpu_generator.sh, stage "ab" with AB_BENCH containing
"gemm" and/or "gen"): per decode group, K and row count, microseconds per launch of every
build variant (best of its rounds) and its ratio to variant 0's; the 8B decode step's GEMM
time at K = 4 (32 layers of q/k/v + o + gate/up + down, plus the 6-bit head); the 8B
generator's tokens/s per variant.

Usage: python3 bench/gemm_ab_table.py OUT_DIR   (reads ab-gemm-I-R.json, ab-gen-I.json)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

LAYER_GROUPS = ("qkv", "o", "gate/up", "down")
LAYERS = 32  # Llama-3.1-8B


def load(out: Path) -> tuple[dict[int, dict], dict[int, dict]]:
    """{variant index: {(group, k, rows): best us, "_variant": built variant, "_pct": {...}}},
    {variant index: generator JSON}."""
    sweeps: dict[int, dict] = {}
    for path in sorted(out.glob("ab-gemm-*-*.json")):
        index = int(re.match(r"ab-gemm-(\d+)-", path.name).group(1))
        data = json.loads(path.read_text())
        runs = sweeps.setdefault(index, {"_variant": data.get("variant"), "_pct": {}})
        for r in data["results"]:
            key = (r["group"], r["k"], r.get("rows", 1))
            if key not in runs or r["us"] < runs[key]:
                runs[key] = r["us"]
                runs["_pct"][key] = r["pct_copy"]
    gens = {}
    for path in sorted(out.glob("ab-gen-*.json")):
        index = int(re.match(r"ab-gen-(\d+)", path.name).group(1))
        try:
            gens[index] = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
    return sweeps, gens


def main(out: Path) -> None:
    sweeps, gens = load(out)
    if sweeps:
        order = sorted(sweeps)
        print("GEMM A/B, us per launch (best of rounds), x = variant 0 / this; %copy of v0 and last")
        print(f"{'rows':>4} {'group':8}{'K':>2} " + "".join(
            f"{'v' + str(sweeps[i]['_variant']):>15}" for i in order))
        keys = sorted({k for i in order for k in sweeps[i] if not str(k).startswith("_")},
                      key=lambda k: (k[2], k[1], LAYER_GROUPS.index(k[0]) if k[0] in LAYER_GROUPS else 9))
        base = sweeps[order[0]]
        for key in keys:
            cells = []
            for i in order:
                us = sweeps[i].get(key)
                ratio = base.get(key, float("nan")) / us if us else float("nan")
                cells.append(f"{us:8.1f} {ratio:4.2f}x" if us else f"{'-':>14}")
            pct = f"  {base['_pct'].get(key, 0):3.0f}% -> {sweeps[order[-1]]['_pct'].get(key, 0):3.0f}%"
            print(f"{key[2]:>4} {key[0]:8}{key[1]:>2} " + " ".join(cells) + pct)
        for rows in sorted({k[2] for k in keys}):
            line = []
            for i in order:
                s = sweeps[i]
                layer = [s.get((g, 4, rows)) for g in LAYER_GROUPS]
                head = s.get(("head", 6, rows), 0.0)
                if all(layer):
                    line.append(f"v{s['_variant']} {LAYERS * sum(layer) + head:7.0f} us")
            if line:
                print(f"8B step GEMM at K=4 (+ head K=6), rows {rows}: " + ", ".join(line))
    for i in sorted(gens):
        rows = gens[i].get("rows", [])
        rates = ", ".join(f"{r['jobs']} jobs {r['tokens_per_s']:.1f} tok/s" for r in rows)
        print(f"8B generator, variant index {i}: {rates}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
