"""Paired CPU A/B of the suh/svh refit (convert/scale_refit.py) on a finished conversion.

Takes a folder that bench/quant_quality_cpu.py converted WITHOUT the refit (and its work
folder), recomputes the Hessian every quantized group of ``--layers`` saw (the source's
layers before it, the stored tensors of the groups before it in the layer, exactly as
the pipeline fed them), refits each tensor's scales with the trellis as stored, writes a
copy of the folder with the new suh/svh and evaluates both on the same windows. The
trellis paths are the same bits in A and B, so the difference is the refit's alone,
without the path luck that makes two conversions differ by ~10% (NOTES-quant-quality.md,
section 5). (The pipeline's refit runs group by group, so there the groups after a
refitted one see its refitted output: this measures the refit without that knock-on.)

Usage (after ``quant_quality_cpu.py --bits 3 --layers 29 --seed S --tag base-sS``):
  OMP_NUM_THREADS=1 python bench/refit_ab_cpu.py --work /tmp/quant-quality-cpu \\
      --tag base-sS --bits 3 --layers 29
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> None:
    from quant_quality_cpu import DATA, compare, reference_logprobs

    from exl3cli.codec import dequantize_linear
    from exl3cli.convert.calibration import calibration_tokens, read_calibration_text
    from exl3cli.convert.engine_layer import LINEAR_SLOTS
    from exl3cli.convert.hessian import HessianAccumulator, proxy_error
    from exl3cli.convert.pipeline import ConvertOptions, _Converter
    from exl3cli.convert.quality import token_windows
    from exl3cli.convert.quantize_layer import _refit
    from exl3cli.convert.work_folder import load_checkpoint, module_tensors
    from exl3cli.engine.models.loader import load_causal_lm
    from exl3cli.engine.text.tokenizer import Tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", required=True, help="quant_quality_cpu.py's --work")
    parser.add_argument("--tag", required=True)
    parser.add_argument("--bits", type=float, required=True)
    parser.add_argument("--layers", default="29")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--cols", type=int, default=512)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--src", default=None, help="as quant_quality_cpu.py's --src")
    args = parser.parse_args()

    work = Path(args.work)
    src = Path(args.src) if args.src else work / "smollm2"
    base = work / f"exl3-{args.tag}-{args.bits}"
    conv_work = work / f"work-{args.tag}-{args.bits}"
    job = json.loads((conv_work / "job.json").read_text())["options"]
    options = ConvertOptions(**{k: tuple(tuple(e) for e in v) if k == "recipe" else v
                                for k, v in job.items()})
    conv = _Converter(src, replace(options, device="cpu"), conv_work, lambda _e: None)
    conv.out_fisher = load_checkpoint(conv_work / "out-fisher.safetensors")[0]
    settings = replace(conv.settings(4), refit_rounds=args.rounds)
    tokenizer = Tokenizer.from_folder(src)
    tokens = calibration_tokens(tokenizer, read_calibration_text(options.calib_path),
                                options.rows, options.cols)
    layers = {int(x) for x in args.layers.split(",")}
    engine = conv.engine_layers
    tensors = load_file(str(base / "model.safetensors"))
    with torch.inference_mode():
        hidden = conv.embeddings(tokens)
        for i in range(conv.config.num_layers):
            stored, _ = load_checkpoint(conv_work / f"layer-{i:04d}.safetensors")
            if i in layers:
                mods = conv.layer_modules(i)
                dense = {m: (conv.weight(m), conv.bias(m)) for ms in mods.values() for m in ms}
                dense.update(conv.kept_dense(i))
                attended = None
                for group in LINEAR_SLOTS:
                    layer = engine.build(i, dense, conv.tensor)
                    x = engine.linear_input(layer, hidden, group, attended)
                    attended = x if group == "o" else attended
                    acc = HessianAccumulator(x.shape[-1])
                    acc.add(x)
                    h = acc.hessian()
                    for m in mods[group]:
                        t = module_tensors(stored, m)
                        if not t:
                            continue
                        w = conv.weight(m)
                        q = dequantize_linear(t, *w.shape)
                        fisher = conv.out_fisher.get(m)
                        refitted, q2 = _refit(t, w, q, h, settings, fisher)
                        print(f"{m}: proxy {proxy_error(h, w, q):.5e} -> "
                              f"{proxy_error(h, w, q2):.5e} "
                              f"({proxy_error(h, w, q2) / proxy_error(h, w, q) - 1:+.1%})",
                              flush=True)
                        tensors[f"{m}.suh"], tensors[f"{m}.svh"] = refitted["suh"], refitted["svh"]
                        dense[m] = (q, conv.bias(m))  # later groups saw the stored tensors
            hidden = conv.run_layer(i, hidden, conv.dense_from_stored(stored, i))
    out = work / f"exl3-{args.tag}-refit{args.rounds}-{args.bits}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(base, out)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              {"format": "pt"})
    windows = token_windows(tokenizer.encode((DATA / "test.txt").read_text(encoding="utf-8"),
                                             add_bos=False), args.window, args.windows)
    ref = reference_logprobs(load_causal_lm(src, "cpu", torch.float32), windows)
    for name, folder in (("base", base), (f"refit{args.rounds}", out)):
        row = compare(load_causal_lm(folder, "cpu", torch.float32), windows, ref)
        print(f"{args.tag} {args.bits} {name}: ppl {row['ppl']:.4f}  KL {row['kl']:.5f}  "
              f"top-1 {row['top1']:.4f}", flush=True)


if __name__ == "__main__":
    main()
