"""The table of bench/gpu_offload.sh: one row per offload_bench.py JSON in a folder.

    python bench/offload_table.py OUT_DIR

Greedy text against the full-GPU run (the reference: every layer resident, not
streamed): "identical", or the first position where the tokens differ with the logit
gap there in the reference between its token and the other run's (float order
explains a gap under 1e-2; ">= x" when the other token is not in the reference's top 5).
"CPU threads": threads one loop of the CPU kernels ran on / torch's thread count.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def divergence(reference: dict, other: dict) -> str:
    ref_ids, ids = reference["ids"], other["ids"]
    for position, (a, b) in enumerate(zip(ref_ids, ids, strict=False)):
        if a != b:
            top_ids, top_logits = reference["top5"][position]
            if b in top_ids:
                gap = top_logits[0] - top_logits[top_ids.index(b)]
                verdict = "float order" if gap < 1e-2 else "NOT float order"
                return f"differs at {position}: gap {gap:.2e} ({verdict})"
            return f"differs at {position}: gap >= {top_logits[0] - top_logits[-1]:.2e}"
    return f"identical ({min(len(ref_ids), len(ids))} tokens)"


def main(argv: list[str] | None = None) -> int:
    folder = Path((argv or sys.argv[1:])[0])
    rows = [json.loads(p.read_text()) for p in sorted(folder.glob("offload-*.json"))]
    if not rows:
        print(f"no offload-*.json in {folder}")
        return 1
    full = [r for r in rows if r["gpu_layers"] == r["num_layers"] and not r["streamed"]
            and r["device"].startswith("cuda")] or rows[:1]
    reference = full[0]
    print(f"reference: {reference['label']} ({reference['decode_tok_s']:.1f} tok/s)")
    header = ("placement", "processor", "resident", "decode tok/s", "x full", "prefill tok/s",
              "mode", "CPU threads", "GPU GiB used/plan", "greedy vs full GPU")
    lines = [header]
    for r in rows:
        gib = (f"{r['max_allocated'] / 2**30:.2f}/{r['gpu_bytes'] / 2**30:.2f}"
               if "max_allocated" in r else "-")
        lines.append((r["label"], r["processor"], f"{r['gpu_layers']}/{r['num_layers']}"
                      + (" +stream" if r["streamed"] else ""), f"{r['decode_tok_s']:.1f}",
                      f"{r['decode_tok_s'] / reference['decode_tok_s']:.2f}",
                      f"{r['prefill_tok_s']:.0f}", r["decode_mode"],
                      f"{r.get('kernel_threads', '?')}/{r.get('threads', '?')}", gib,
                      "reference" if r is reference else
                      divergence(reference["greedy"], r["greedy"])))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    for line in lines:
        print(" | ".join(str(v).ljust(w) for v, w in zip(line, widths, strict=True)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
