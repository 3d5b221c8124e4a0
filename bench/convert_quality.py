"""Convert a model at several bpw and report perplexity + KL vs the unquantized model.

Usage (GPU machine, SmolLM2):
  python bench/convert_quality.py SRC --bits 2 3 4 5 --text ../shared/data/wikitext-2/test.txt \
      --windows 100 --calib ../shared/data/wikitext-2/valid.txt --work /tmp/cq
SRC: HF folder or GGUF file. Prints one line per bpw (ppl, KL, top-1, conversion time)
and writes the table as JSON next to --work (results.json, or results-TAG.json).
A/B of quantizer changes (bench/NOTES-quant-quality.md): ``--allocation fixed`` (the old
fixed order; default measured), ``--set damping=0.05`` or ``--set out_scales=rms`` (any
ConvertOptions field), ``--tag NAME``. The JSON is rewritten after every rate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from exl3cli.convert.pipeline import ConvertOptions, convert_model
from exl3cli.convert.quality import evaluate, token_windows
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.text.tokenizer import Tokenizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("src")
    parser.add_argument("--bits", type=float, nargs="+", default=[2.0, 3.0, 4.0, 5.0])
    parser.add_argument("--head-bits", type=int, default=6)
    parser.add_argument("--text", required=True)
    parser.add_argument("--windows", type=int, default=100)
    parser.add_argument("--calib", default=None)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--cols", type=int, default=2048)
    parser.add_argument("--work", default="/tmp/convert-quality")
    parser.add_argument("--device", default=None)
    parser.add_argument("--allocation", default="measured", choices=["measured", "fixed"])
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--tag", default=None)
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    work = Path(args.work)
    src = Path(args.src)
    if src.is_file():
        from exl3cli.gguf.convert import gguf_to_hf_folder
        src = gguf_to_hf_folder(src, work / "source")
    tokenizer = Tokenizer.from_folder(src)
    text = Path(args.text).read_text(encoding="utf-8")
    windows = token_windows(tokenizer.encode(text, add_bos=False), 2048, args.windows)
    reference = load_causal_lm(src, device, torch.float32)
    base = evaluate(reference, windows)
    rows = [{"model": "unquantized fp32", "ppl": base.perplexity, "kl": 0.0, "top1": 1.0}]
    print(f"unquantized: ppl {base.perplexity:.4f} over {base.tokens} tokens", flush=True)
    for bits in args.bits:
        out = work / f"exl3-{bits}"
        options = ConvertOptions(bits=bits, head_bits=args.head_bits, rows=args.rows,
                                 cols=args.cols, calib_path=args.calib, device=str(device),
                                 allocation=args.allocation)
        options = dataclasses.replace(options, **{
            k: _value(v) for k, v in (s.split("=", 1) for s in args.set)})
        started = time.perf_counter()
        summary = convert_model(src, out, options, work / f"work-{bits}", progress=print,
                                force=True)
        seconds = time.perf_counter() - started
        print(summary.table(), flush=True)
        layers = sum(r.seconds for r in summary.layers)
        print(f"{bits} bpw conversion phases: {seconds:.1f} s in all, layers' quantization "
              f"{layers:.1f} s, the rest (setup, plan, calibration forwards, head, "
              f"writing) {seconds - layers:.1f} s", flush=True)
        model = load_causal_lm(out, device, torch.float16 if device.type == "cuda" else None)
        result = evaluate(model, windows, reference)
        del model
        rows.append({"model": f"EXL3 {bits} bpw (head {args.head_bits})", "ppl": result.perplexity,
                     "kl": result.kl, "top1": result.top1_agreement, "convert_s": seconds,
                     "tag": args.tag, "allocation": args.allocation, "set": args.set})
        print(f"{bits} bpw: ppl {result.perplexity:.4f}  KL {result.kl:.4f}  "
              f"top-1 {result.top1_agreement:.3f}  conversion {seconds:.0f}s", flush=True)
        # After every rate: a run cut short by a time limit keeps what it finished.
        name = f"results-{args.tag}.json" if args.tag else "results.json"
        (work / name).write_text(json.dumps(rows, indent=2))


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


if __name__ == "__main__":
    main()
