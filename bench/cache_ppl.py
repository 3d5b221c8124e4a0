"""Perplexity of a model on wikitext-2 test with each KV cache type (fp16, q8, q6, q4, k8v4).

Each 2048-token window is fed through the paged cache in 512-token chunks, so every
chunk attends to the (quantized) keys/values of the chunks before it, and itself.

    python3 bench/cache_ppl.py MODEL_FOLDER [--windows 4] [--types fp16,q8,q6,q4,k8v4]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from exl3cli.engine.kvcache.kv_quant import parse_kv_cache_type
from exl3cli.engine.kvcache.paged_attention import PagedBatch
from exl3cli.engine.kvcache.paged_cache import PagePool, PageTable, pages_for
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.text.tokenizer import Tokenizer

WIKITEXT = Path(__file__).resolve().parents[2] / "shared/data/wikitext-2/test.txt"


def window_nll(model, pool: PagePool, ids: list[int], chunk: int) -> tuple[float, torch.Tensor]:
    """Summed next-token NLL over the window and the argmax prediction at each position."""
    table = PageTable(pool)
    assert table.admit(ids, len(ids))
    total, predictions = 0.0, []
    try:
        for start in range(0, len(ids), chunk):
            piece = ids[start : start + chunk]
            logits = model.forward(torch.tensor([piece]), PagedBatch(pool, [table], [piece]))[0]
            targets = torch.tensor(ids[start + 1 : start + 1 + len(piece)])
            logits = logits[: len(targets)]
            total += float(F.cross_entropy(logits, targets, reduction="sum"))
            predictions.append(logits.argmax(-1))
    finally:
        table.free()
    return total, torch.cat(predictions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--types", default="fp16,q8,q6,q4,k8v4")
    parser.add_argument("--text", default=str(WIKITEXT))
    args = parser.parse_args()

    model = load_causal_lm(args.model, device="cpu")
    tokenizer = Tokenizer.from_folder(args.model)
    text = Path(args.text).read_text(encoding="utf-8")
    ids = tokenizer.encode(text[: args.windows * args.length * 8], add_bos=False)
    windows = [ids[i * args.length : (i + 1) * args.length] for i in range(args.windows)]
    assert all(len(w) == args.length for w in windows), "not enough text for the windows"
    config = model.config
    scored = args.windows * (args.length - 1)
    print(f"model {args.model} dtype {model.dtype}, {args.windows} x {args.length} tokens")
    baseline, reference = None, None
    for name in args.types.split(","):
        pool = PagePool(pages_for(args.length), len(model.layers), config.num_kv_heads,
                        config.head_dim, model.dtype, model.device, parse_kv_cache_type(name))
        started = time.perf_counter()
        results = [window_nll(model, pool, w, args.chunk) for w in windows]
        nll = sum(r[0] for r in results)
        predictions = torch.cat([r[1] for r in results])
        ppl = math.exp(nll / scored)
        if baseline is None:
            baseline, reference = ppl, predictions
        agree = float((predictions == reference).float().mean())
        print(f"{name:6s} ppl {ppl:9.4f}  vs first {100 * (ppl / baseline - 1):+6.2f}%  "
              f"top-1 agreement {agree:.4f}  KV bytes/token {pool.bytes_per_token():8.0f}  "
              f"({time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
