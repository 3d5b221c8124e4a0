"""Perplexity, mean KL and top-1 agreement of model folders against one reference, on
the same token windows (exl3cli.convert.quality), e.g. ExLlamaV3's conversions of a
zero-padded copy against the unpadded fp32 model.

    python bench/real_models/eval_folders.py REFERENCE --text test.txt --windows 100 \
        --folder peer-2.0=/tmp/peer-2.0 --folder peer-4.0=/tmp/peer-4.0 --out peer.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from exl3cli.convert.quality import evaluate, token_windows
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.text.tokenizer import Tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference")
    parser.add_argument("--text", required=True)
    parser.add_argument("--windows", type=int, default=100)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--folder", action="append", default=[], metavar="NAME=PATH")
    parser.add_argument("--seconds", action="append", default=[], metavar="NAME=S",
                        help="conversion seconds to carry into the report")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    tokenizer = Tokenizer.from_folder(args.reference)
    text = Path(args.text).read_text(encoding="utf-8")
    windows = token_windows(tokenizer.encode(text, add_bos=False), args.window, args.windows)
    reference = load_causal_lm(args.reference, device, torch.float32)
    base = evaluate(reference, windows)
    seconds = dict(item.split("=", 1) for item in args.seconds)
    rows = [{"model": "unquantized fp32", "ppl": base.perplexity, "kl": 0.0, "top1": 1.0,
             "tokens": base.tokens}]
    for item in args.folder:
        name, _, path = item.partition("=")
        try:
            model = load_causal_lm(path, device, torch.float16 if device.type == "cuda" else None)
            result = evaluate(model, windows, reference)
            del model
            rows.append({"model": name, "ppl": result.perplexity, "kl": result.kl,
                         "top1": result.top1_agreement,
                         "convert_s": float(seconds[name]) if name in seconds else None})
            print(f"{name}: ppl {result.perplexity:.4f}  KL {result.kl:.4f}  "
                  f"top-1 {result.top1_agreement:.3f}", flush=True)
        except Exception as error:  # one bad folder must not lose the others' rows
            rows.append({"model": name, "error": f"{type(error).__name__}: {error}"})
            print(f"{name}: FAIL {type(error).__name__}: {error}", flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
