"""One greedy generation on the CPU in one process, for whole-process timing
(`/usr/bin/time -v`, or two runs of different lengths: their CPU-time difference over
the token difference is the per-token cost without the load; bench/NOTES-cpu-exl3.md).

    python3 bench/cpu_generate.py MODEL_FOLDER [--prompt-tokens 32] [--new-tokens 64]
        [--threads 1]

The model loads as `exl3 run` loads it (the loader's defaults: device, dtype, CPU weight
mode; EXL3_CPU_GEMV / EXL3_CPU_STACK / EXL3_CPU_WEIGHTS apply); the prompt is random
token ids (speed does not depend on them), the cache paged as the generator runs it.
"""

from __future__ import annotations

import argparse

import torch

from exl3cli.engine.kvcache.paged_attention import PagedBatch
from exl3cli.engine.kvcache.paged_cache import PagePool, PageTable, pages_for
from exl3cli.engine.models.loader import load_causal_lm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_causal_lm(args.model, device="cpu")
    config, total = model.config, args.prompt_tokens + args.new_tokens + 1
    pool = PagePool(pages_for(total), len(model.layers), config.num_kv_heads, config.head_dim,
                    model.dtype, model.device)
    table = PageTable(pool)
    ids = torch.randint(10, config.vocab_size // 2, (args.prompt_tokens,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    table.admit(ids, total)
    logits = model(torch.tensor([ids]), PagedBatch(pool, [table], [ids]), last_logits_only=True)
    out = []
    for _ in range(args.new_tokens):
        token = int(logits[0, -1].argmax())
        out.append(token)
        logits = model(torch.tensor([[token]]), PagedBatch(pool, [table], [[token]]),
                       last_logits_only=True)
    print(out[:8])


if __name__ == "__main__":
    main()
