"""The one table bench/gpu_real_models.sh prints last, from the JSON files in its OUT.

    python bench/real_models/table.py OUT_FOLDER
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def greedy(out: Path) -> list[str]:
    lines = ["== item 1: greedy 64 tokens, GPU vs CPU reference =="]
    for path in sorted(out.glob("greedy-*.json")):
        report = _load(path)
        if report is None:
            lines.append(f"{path.stem}: FAIL (no report)")
            continue
        detail = []
        for row in report["results"]:
            noise = (f" [noise p50 {row['noise_p50']:.4f} max {row['noise_max']:.4f}]"
                     if "noise_max" in row else "")
            if row.get("same_tokens"):
                detail.append("same" + noise)
            elif "status" in row:
                detail.append(row["status"])
            else:
                gap = row.get("ref_gap")
                detail.append(f"diverges at {row.get('first_divergence')} (ref gap "
                              f"{gap if gap is None else round(gap, 5)}, own gap "
                              f"{row.get('own_gap')}"
                              f"{', within noise' if row.get('within_noise') else ''}){noise}")
        lines.append(f"{path.stem.removeprefix('greedy-'):<16} {report['dtype']:<15} "
                     f"ref {report['reference']['dtype']:<14} {report['same']}/"
                     f"{report['prompts']} same, {report['explained']} explained: "
                     + "; ".join(detail))
    run = out / "exl3-run-smollm2.txt"
    fp16 = _load(out / "greedy-smollm2-fp16.json")
    if run.is_file() and fp16:
        text = run.read_text().strip()
        lines.append(f"exl3 run (CLI) text equals the checked run's: "
                     f"{text == fp16['results'][0]['text'].strip()}")
    return lines


def serve(out: Path) -> list[str]:
    lines = ["== item 2: exl3 serve, streaming clients (official ollama / openai) =="]
    for path in sorted(out.glob("clients-*.json")):
        report = _load(path)
        if report is None:
            lines.append(f"{path.stem}: FAIL (no report)")
            continue
        for phase in report["phases"]:
            for row in phase["rows"]:
                lines.append(
                    f"{phase['phase']:<9}{row['api']:<7}{row['model']:<9}"
                    f"{row['finished']:>3}/{row['clients']:<3} done {row['same_as_solo']:>3} "
                    f"= solo  {row['tok_s']:>8} tok/s  TTFT p50 {row['ttft_p50_ms']} "
                    f"p95 {row['ttft_p95_ms']} ms  (wall {phase['wall_s']} s)")
    for path in sorted(out.glob("bench-server-*.json")):
        report = _load(path)
        if report is None:
            lines.append(f"{path.stem}: FAIL (no report)")
            continue
        lines.append(f"exl3 bench --server {report['model']}: {report['completed']}/"
                     f"{report['requests']} at concurrency {report['concurrency']}, "
                     f"{report['tokens_per_s']} tok/s, TTFT p50 {report['ttft_ms'].get('p50')} "
                     f"p95 {report['ttft_ms'].get('p95')} ms, errors {report['errors']}")
    return lines


def spec(out: Path) -> list[str]:
    lines = ["== item 4: speculative decoding (SmolLM2 target) =="]
    report = _load(out / "spec.json")
    if report is None:
        return lines + ["no spec.json"]
    lines.append(f"{'set':<9}{'jobs':>6} {'drafter':<20}{'plain':>9}{'drafted':>9}{'x':>7}"
                 f"{'kept/pass':>10}{'pass cost':>10}  same")
    for row in report["rows"]:
        lines.append(f"{row['set']:<9}{str(row['jobs']):>6} {row['drafter']:<20}"
                     f"{row['plain_tok_s']!s:>9}{row['tok_s']!s:>9}{row['speedup']!s:>7}"
                     f"{row['kept_per_pass']:>10}{row['pass_cost_vs_plain']!s:>10}  "
                     f"{row['same_text']}")
    return lines


def other(out: Path) -> list[str]:
    lines = ["== conversions / tests =="]
    for path in sorted(out.glob("convert-*.json")):
        row = _load(path) or {}
        lines.append(f"convert {row.get('model')} {row.get('bits')} bpw: {row.get('seconds')} s")
    log = out / "tests-gemma-cuda.log"
    if log.is_file():
        tail = [line for line in log.read_text().splitlines() if line.strip()]
        lines.append(f"item 5, gemma cuda tests: {tail[-1] if tail else 'no output'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    out = Path((argv or sys.argv[1:])[0])
    print("\n".join(other(out) + greedy(out) + serve(out) + spec(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
