"""The table of bench/gpu_vision.sh: ours (bench/vision_bench.py, JSON ours*.json) next
to ExLlamaV3 (bench/peer_vision.py, peer.json) from one output folder.

    python bench/vision_table.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# (label, key, scale, unit): seconds shown in ms.
ROWS = [
    ("load (model + tower + generator)", "load_s", 1, "s"),
    ("decode PNG", "decode_image_s", 1000, "ms"),
    ("preprocess (resize, normalise, patches)", "preprocess_s", 1000, "ms"),
    ("vision encode (tower + merger)", "encode_s", 1000, "ms"),
    ("  the same, one attention call per window", "encode_loop_s", 1000, "ms"),
    ("image -> embeddings (preprocess + encode)", "embed_s", 1000, "ms"),
    ("TTFT (new image + question -> 1st token)", "ttft_s", 1000, "ms"),
    ("  of which before the prompt is submitted", "prompt_s", 1000, "ms"),
    ("prompt tokens", "prompt_tokens", 1, ""),
    ("decode after it", "decode_tok_s", 1, "tok/s"),
    ("peak GPU memory", "peak_gib", 1, "GiB"),
]


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _cell(row: dict[str, Any] | None, key: str, scale: float) -> str:
    value = None if row is None else row.get(key)
    if not isinstance(value, (int, float)):
        return "-"
    value *= scale
    return f"{value:,.0f}" if isinstance(value, int) or value >= 100 else f"{value:.3g}"


def table(out: Path) -> str:
    ours = {p.stem: _load(p) for p in sorted(out.glob("ours*.json"))}
    peer = _load(out / "peer.json")
    lines = []
    first = next((r for r in ours.values() if r), None) or peer
    if first:
        image = first.get("image", {})
        lines.append(f"{first.get('gpu') or first.get('device')}; {image.get('size')} px image "
                     f"-> {image.get('grid_patches')} patches ({image.get('patches')}) -> "
                     f"{image.get('tokens')} tokens; {Path(first.get('model', '')).name}")
    names = list(ours) or ["ours"]
    head = "| figure | " + " | ".join(names) + " | ExLlamaV3 1.6.5 | ours / peer |"
    lines += [head, "|" + "---|" * (len(names) + 3)]
    main = ours.get("ours")
    for label, key, scale, unit in ROWS:
        cells = [_cell(ours.get(n), key, scale) for n in names]
        ratio = "-"
        if main and peer and isinstance(main.get(key), (int, float)) and peer.get(key):
            ratio = f"{main[key] / peer[key]:.2f}x"
        lines.append(f"| {label}{f' ({unit})' if unit else ''} | " + " | ".join(cells)
                     + f" | {_cell(peer, key, scale)} | {ratio} |")
    for name, row in [*ours.items(), ("peer", peer)]:
        if row and row.get("chat_error"):
            lines.append(f"{name}: chat failed: {row['chat_error']}")
    modes = ", ".join(f"{n}: {r.get('decode_mode')} ({r.get('graphs', 0)} graphs)"
                      for n, r in ours.items() if r)
    if modes:
        lines.append(f"decode mode: {modes}")
    status = out / "status.txt"
    if status.is_file():
        lines += ["", status.read_text().rstrip()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1] if len(sys.argv) > 1 else ".")))
