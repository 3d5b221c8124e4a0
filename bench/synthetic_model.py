"""Write a synthetic EXL3 model folder of a real architecture's shape (random trellis).

    python bench/synthetic_model.py llama3-8b -b 4.0 --head-bits 6 --out DIR
    python bench/synthetic_model.py qwen3-30b-a3b -b 4.0 --head-bits 6 --out DIR
    python bench/synthetic_model.py tiny -b 3.5 --out DIR --tokenizer-from HF_FOLDER
    python bench/synthetic_model.py qwen2.5-vl-7b -b 4.0 --head-bits 6 --out DIR

Shapes: llama3-8b (= llama3.1-8b), llama3.2-1b, smollm2-135m, qwen2.5-0.5b, tiny; the mixtures of
experts qwen3-30b-a3b, mixtral-8x7b (tiny-qwen3-moe, tiny-mixtral at test sizes); image-text
qwen2.5-vl-7b and qwen2.5-vl-tiny (exl3cli/convert/synthetic_vision.py: the vision
tower at 16 bits under "visual.", a tokenizer with Qwen's special ids). The folder holds
random trellis words with random signs, so it loads in any EXL3 reader (ExLlamaV3 too);
the text it generates is noise: it is for speed and memory measurements, not quality.
The words are drawn on the GPU when there is one (--device), and shards are written by
--workers threads.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from exl3cli.codec.format import DEFAULT_SHARD_BYTES
from exl3cli.convert.synthetic import SHAPES, write_synthetic_model
from exl3cli.convert.synthetic_vision import VISION_SHAPES, write_synthetic_vision_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES) + sorted(VISION_SHAPES))
    parser.add_argument("-b", "--bits", type=float, default=4.0, help="average bpw (1..8)")
    parser.add_argument("--head-bits", type=int, default=6)
    parser.add_argument("--codebook", choices=("mul1", "mcg", "3inst"), default="mul1")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer-from", type=Path, default=None,
                        help="copy tokenizer files from this folder (default: byte-level)")
    parser.add_argument("--layers", type=int, default=None, help="override the layer count")
    parser.add_argument("--shard-gb", type=float, default=DEFAULT_SHARD_BYTES / 2**30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None,
                        help="where random words are drawn (default: cuda when present)")
    parser.add_argument("--workers", type=int, default=None,
                        help="writing threads (default: 4; image-text shapes: CPUs, <= 16)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.shape in VISION_SHAPES:
        if args.tokenizer_from is not None:
            parser.error("image-text shapes write their own tokenizer (Qwen's special ids)")
        folder = write_synthetic_vision_model(
            args.out, args.shape, bits=args.bits, head_bits=args.head_bits,
            codebook=args.codebook, seed=args.seed, shard_bytes=int(args.shard_gb * 2**30),
            num_layers=args.layers, workers=args.workers)
    else:
        folder = write_synthetic_model(
            args.out, args.shape, bits=args.bits, head_bits=args.head_bits,
            codebook=args.codebook, tokenizer_from=args.tokenizer_from, seed=args.seed,
            shard_bytes=int(args.shard_gb * 2**30), num_layers=args.layers,
            device=args.device, workers=args.workers or 4,
        )
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    print(f"wrote {folder} ({args.shape}, {args.bits} bpw, head {args.head_bits}, "
          f"{size / 2**30:.2f} GiB) in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
