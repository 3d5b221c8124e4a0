"""One image in, text out: load, preprocessing, vision encode, time to first token and
decode speed of an image-text model, through the path `exl3 run --image` and the
Python API take (TextModel.chat_prompt -> GenerationJob -> Generator).

    python bench/vision_bench.py MODEL_DIR --device cuda --image-size 1024 --json

Timings (seconds, medians; CUDA-synchronised):
- load_s: TextModel + vision tower + Generator (its decode graphs captured), once.
- decode_image_s: PNG bytes -> Pillow RGB image.
- preprocess_s: image -> patches (resize, normalise, patching) on the CPU.
- encode_s: patches -> image embeddings (tower + merger) on the device; encode_loop_s
  the same with one attention call per window (Qwen2.5-VL's tower before batching).
- embed_s: image -> embeddings (preprocess + encode), the scope of the peer's
  get_image_embeddings.
- ttft_s: a chat with one new image (bench/vision_image.py: a different image each
  run, so neither the image cache nor prefix reuse serves it) and a short question,
  from the request until its first token is on the host: decode, preprocess, encode,
  prefill, first sample. prompt_s is the part before the job is submitted.
- decode_tok_s: the `--gen` greedy tokens after it (EOS ignored), (n - 1) / time
  from the first token to the last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import exl3cli

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vision_image import QUESTION, chat_summary, chat_text, synthetic_image  # noqa: E402

from exl3cli.engine.generation.generator import Generator  # noqa: E402
from exl3cli.engine.generation.jobs import GenerationJob  # noqa: E402
from exl3cli.engine.generation.textmodel import TextModel  # noqa: E402
from exl3cli.engine.models.vision.image_processor import decode_image  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Any, device: torch.device, repeat: int) -> tuple[list[float], Any]:
    """`repeat` synchronised timings of fn() (after one untimed call), and its result."""
    result = fn()
    _sync(device)
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        _sync(device)
        runs.append(time.perf_counter() - start)
    return runs, result


def one_chat(text_model: TextModel, generator: Generator, data: bytes, gen: int
             ) -> dict[str, Any]:
    """One request with image `data`: timings from the request to its first and last token."""
    device = torch.device(text_model.model.device)
    _sync(device)
    start = time.perf_counter()
    messages = [{"role": "user", "content": QUESTION, "images": [data]}]
    ids = text_model.chat_prompt(messages)
    prompt_s = time.perf_counter() - start
    handle = generator.submit(GenerationJob(ids, {"temperature": 0}, num_predict=gen,
                                            ignore_eos=True))
    first = None
    while not handle.done:
        generator.step()
        if first is None and handle.token_ids:
            first = time.perf_counter()
    end = time.perf_counter()
    if handle.error is not None:
        raise handle.error
    count = len(handle.token_ids)
    return {"ttft_s": (first or end) - start, "prompt_s": prompt_s, "gen_tokens": count,
            "decode_tok_s": (count - 1) / (end - first) if first and count > 1 else 0.0,
            "prompt_tokens": len(ids)}


def run(folder: Path, device: str | None, size: int, gen: int, repeat: int,
        chats: int) -> dict[str, Any]:
    start = time.perf_counter()
    text_model = TextModel.load(folder, device=device)
    vision = text_model.vision
    if vision is None:
        raise SystemExit(f"{folder} reads text only (no vision tower)")
    model = text_model.model
    generator = Generator(model, text_model.tokenizer, max_batch=1, num_ctx=4096)
    dev = torch.device(model.device)
    _sync(dev)
    load_s = time.perf_counter() - start
    # The same prompt text the peer's script sends.
    rendered = text_model.chat_template.render(
        [{"role": "user", "content": vision.placeholder + QUESTION}], add_generation_prompt=True)
    if rendered != chat_text(vision.placeholder):
        raise SystemExit(f"the folder's chat template renders {rendered!r}, not the peer's prompt")

    data = synthetic_image(size, seed=0)
    decode_runs, image = _timed(lambda: decode_image(data), torch.device("cpu"), repeat)
    prep_runs, pixels = _timed(lambda: vision.processor(image), torch.device("cpu"), repeat)
    patches, grid = pixels
    encode_runs, rows = _timed(lambda: vision.vision.embed_image((patches, grid)), dev, repeat)
    embed_runs, _ = _timed(lambda: vision.vision.embed_image(vision.processor(image)), dev,
                           repeat)
    loop_runs: list[float] = []
    tower = getattr(vision.vision, "tower", None)
    if tower is not None and hasattr(tower, "batched_windows"):  # the before: a call a window
        tower.batched_windows = False
        try:
            loop_runs, _ = _timed(lambda: vision.vision.embed_image((patches, grid)), dev, repeat)
        finally:
            tower.batched_windows = True
    median = statistics.median
    result: dict[str, Any] = {
        "impl": "exl3", "exl3cli": str(Path(exl3cli.__file__).parent), "model": str(folder),
        "device": str(dev), "dtype": str(model.dtype),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "image": {"size": size, "grid_patches": list(grid[1:]), "patches": int(patches.shape[0]),
                  "tokens": int(rows.shape[0]), "png_bytes": len(data)},
        "load_s": load_s,
        "decode_image_s": median(decode_runs), "preprocess_s": median(prep_runs),
        "encode_s": median(encode_runs), "encode_runs": encode_runs,
        "embed_s": median(embed_runs),
        "encode_loop_s": median(loop_runs) if loop_runs else None,
    }
    try:  # the encode figures stand even if the chat part fails
        one_chat(text_model, generator, synthetic_image(size, seed=99), gen)  # warm-up
        chat_runs = [one_chat(text_model, generator, synthetic_image(size, seed=100 + i), gen)
                     for i in range(chats)]
        result.update(chat_summary(chat_runs))
    except Exception as error:  # reported in the JSON and the table
        import traceback

        traceback.print_exc()
        result["chat_error"] = f"{type(error).__name__}: {error}"
    result["decode_mode"] = generator.decode.mode
    result["graphs"] = generator.decode.graph_count
    result["peak_gib"] = (torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda"
                          else None)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--device", default=None)
    parser.add_argument("--image-size", type=int, default=1024)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5, help="timed encode runs")
    parser.add_argument("--chats", type=int, default=3, help="timed chats (TTFT, decode)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run(args.model, args.device, args.image_size, args.gen, args.repeat, args.chats)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for key, value in result.items():
            print(f"{key:16s} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
