"""The peer's side of bench/vision_bench.py: ExLlamaV3 1.6.5's own API on the same
Qwen2.5-VL-shaped EXL3 folder, the same image bytes and the same rendered chat.

    cd /tmp && PYTHONPATH=/tmp/peer python3 REPO/bench/peer_vision.py MODEL_DIR \
        --image-size 1024 --json

Timings (seconds, medians; CUDA-synchronised), named as vision_bench.py names them:
- load_s: text model, vision model, cache and generator.
- decode_image_s: PNG bytes -> Pillow image (loaded).
- preprocess_s: the vision model's `preprocess` (resize, normalise, patching).
- embed_s: `get_image_embeddings` (preprocess + tower + merger, embeddings to the host).
- encode_s: embed_s - preprocess_s.
- ttft_s: one new image each run, from the bytes until the generator's first streamed
  token: image embeddings, tokenizing with the embedding's alias, prefill, first sample.
- decode_tok_s: the `--gen` greedy tokens after it (min_new_tokens = gen), (n - 1) /
  time from the first token to the last.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vision_image import chat_summary, chat_text, synthetic_image  # noqa: E402

ALIAS = "<$IMAGE$>"


def _timed(fn: Any, repeat: int) -> tuple[list[float], Any]:
    result = fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - start)
    return runs, result


def _open(data: bytes) -> Any:
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def one_chat(vision: Any, tokenizer: Any, generator: Any, data: bytes, gen: int) -> dict:
    from exllamav3 import Job
    from exllamav3.generator.sampler import ArgmaxSampler

    torch.cuda.synchronize()
    start = time.perf_counter()
    embedding = vision.get_image_embeddings(tokenizer, _open(data), text_alias=ALIAS)
    ids = tokenizer.encode(chat_text(ALIAS), add_bos=False, encode_special_tokens=True,
                           embeddings=[embedding])
    prompt_s = time.perf_counter() - start
    job = Job(input_ids=ids, max_new_tokens=gen, min_new_tokens=gen, sampler=ArgmaxSampler(),
              embeddings=[embedding], stop_conditions=[])
    generator.enqueue(job)
    first = None
    count = 0
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result.get("stage") == "error":
                raise RuntimeError(repr(result))
            if result.get("stage") != "streaming":
                continue
            tokens = result.get("token_ids")
            if tokens is not None and tokens.numel():
                first = first or time.perf_counter()
                count += tokens.numel()
    end = time.perf_counter()
    return {"ttft_s": (first or end) - start, "prompt_s": prompt_s, "gen_tokens": count,
            "decode_tok_s": (count - 1) / (end - first) if first and count > 1 else 0.0,
            "prompt_tokens": int(ids.shape[-1])}


def run(folder: Path, size: int, gen: int, repeat: int, chats: int) -> dict[str, Any]:
    from exllamav3 import Cache, Config, Generator, Model, Tokenizer

    start = time.perf_counter()
    config = Config.from_directory(str(folder))
    model = Model.from_config(config)
    vision = Model.from_config(config, component="vision")
    cache = Cache(model, max_num_tokens=8192)
    model.load(device="cuda:0")
    vision.load(device="cuda:0")
    tokenizer = Tokenizer.from_config(config)
    generator = Generator(model=model, cache=cache, tokenizer=tokenizer)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - start

    data = synthetic_image(size, seed=0)
    decode_runs, image = _timed(lambda: _open(data), repeat)
    prep_runs, prepared = _timed(lambda: vision.preprocess(image), repeat)
    patches, resized, grid = prepared
    embed_runs, embedding = _timed(
        lambda: vision.get_image_embeddings(tokenizer, image, text_alias=ALIAS), repeat)
    median = statistics.median
    result: dict[str, Any] = {
        "impl": "exllamav3", "model": str(folder), "device": "cuda:0",
        "gpu": torch.cuda.get_device_name(0),
        "image": {"size": size, "grid_patches": [int(grid[1]), int(grid[2])],
                  "patches": int(patches.shape[0]), "tokens": int(embedding.embeddings.shape[0]),
                  "png_bytes": len(data)},
        "load_s": load_s,
        "decode_image_s": median(decode_runs), "preprocess_s": median(prep_runs),
        "embed_s": median(embed_runs), "embed_runs": embed_runs,
        "encode_s": median(embed_runs) - median(prep_runs),
    }
    try:  # the encode figures stand even if the chat part fails
        one_chat(vision, tokenizer, generator, synthetic_image(size, seed=99), gen)  # warm-up
        chat_runs = [one_chat(vision, tokenizer, generator, synthetic_image(size, seed=100 + i),
                              gen) for i in range(chats)]
        result.update(chat_summary(chat_runs))
    except Exception as error:  # reported in the JSON and the table
        import traceback

        traceback.print_exc()
        result["chat_error"] = f"{type(error).__name__}: {error}"
    result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--image-size", type=int, default=1024)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--chats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run(args.model, args.image_size, args.gen, args.repeat, args.chats)
    print(json.dumps(result, indent=1) if args.json else result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
