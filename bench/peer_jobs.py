"""ExLlamaV3's generator at N concurrent greedy jobs on one EXL3 folder: aggregate decode
tok/s, as JSON lines, the last one {"peer_rows": [...]} (the tables read that one).

The prompts are random token ids below the folder's vocabulary (config.json's vocab_size,
or text_config's): the shared tools' peer_exllamav3_jobs.py draws them from 100..40,000,
which a 32,000-token Mixtral refuses with an IndexError (run 36, bench/NOTES-gpu.md).

usage: PYTHONPATH=<peer install> python3 bench/peer_jobs.py MODEL_DIR JOBS PROMPT GEN
(JOBS like 1,16,64; EX3_KV_BITS=4 gives the peer a quantized cache of that many bits).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path


def vocab_size(folder: Path) -> int:
    """The folder's vocabulary size, from config.json (text_config for image-text ones)."""
    config = json.loads((folder / "config.json").read_text())
    size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if not size:
        raise SystemExit(f"{folder}/config.json names no vocab_size")
    return int(size)


def prompt_range(vocab: int) -> tuple[int, int]:
    """Token ids the prompts draw from: past the specials, below the vocabulary."""
    return min(100, vocab // 4), min(40_000, vocab)


def main(argv: list[str]) -> None:
    if len(argv) != 4:
        raise SystemExit(__doc__)
    import torch
    from exllamav3 import Cache, Config, Generator, Job, Model, Tokenizer
    from exllamav3.generator.sampler import ArgmaxSampler

    folder, counts = Path(argv[0]), [int(n) for n in argv[1].split(",")]
    prompt_len, gen_len = int(argv[2]), int(argv[3])
    low, high = prompt_range(vocab_size(folder))
    config = Config.from_directory(str(folder))
    model = Model.from_config(config)
    cache_args: dict = {"max_num_tokens": 65536, "max_batch_size": 128}
    if os.environ.get("EX3_KV_BITS"):
        from exllamav3.cache.quant import CacheLayer_quant
        bits = int(os.environ["EX3_KV_BITS"])
        cache_args.update(layer_type=CacheLayer_quant, k_bits=bits, v_bits=bits)
    cache = Cache(model, **cache_args)
    model.load(device="cuda:0")
    generator = Generator(model=model, cache=cache, tokenizer=Tokenizer.from_config(config),
                          max_batch_size=128)
    seed = torch.Generator().manual_seed(1)

    def measure(n: int) -> dict:
        jobs = [Job(input_ids=torch.randint(low, high, (1, prompt_len), generator=seed),
                    max_new_tokens=gen_len, min_new_tokens=gen_len, sampler=ArgmaxSampler())
                for _ in range(n)]
        finished: dict[int, dict] = {}
        start = time.time()
        generator.enqueue(jobs)
        while generator.num_remaining_jobs():
            for result in generator.iterate():
                if result.get("stage") == "error":
                    raise RuntimeError(repr(result))
                if result.get("eos"):
                    finished[result["serial"]] = result
        wall = time.time() - start
        rates = [(r["new_tokens"] - 1) / r["time_generate"] for r in finished.values()]
        per_job = statistics.median(rates)
        return {"jobs": n, "per_job_tok_s": per_job, "agg_decode_tok_s": n * per_job,
                "agg_incl_prefill_tok_s":
                    sum(r["new_tokens"] for r in finished.values()) / wall}

    rows = []
    for n in counts:
        measure(n)  # warm-up at this batch size
        rows.append(measure(n))
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"peer_rows": rows}))


if __name__ == "__main__":
    main(sys.argv[1:])
