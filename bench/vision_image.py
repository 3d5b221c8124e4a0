"""Deterministic synthetic test images for the vision benchmarks (ours and the peer's
read the same bytes): smooth colour gradients plus seeded noise, encoded as PNG or
JPEG. Only numpy and Pillow, so the peer's script can import it too."""

from __future__ import annotations

import io
import statistics
from typing import Any

import numpy as np

QUESTION = "What is in this image? Answer briefly."


def synthetic_image(size: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    """A `size` x `size` RGB image; a different `seed` gives different bytes (so an
    image cache or a prefix cache cannot serve a repeated measurement)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    ramp = np.linspace(0.0, 1.0, size, dtype=np.float32)
    ys, xs = np.meshgrid(ramp, ramp, indexing="ij")
    phase = rng.uniform(0, 2 * np.pi, 3).astype(np.float32)
    channels = [np.sin(6 * xs + phase[0]), np.cos(5 * ys + phase[1]),
                np.sin(4 * (xs + ys) + phase[2])]
    pixels = (np.stack(channels, axis=-1) * 0.5 + 0.5) * 200
    pixels += rng.uniform(0, 55, pixels.shape).astype(np.float32)
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), mode="RGB")
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def chat_text(image_marker: str) -> str:
    """The rendered chat both benchmarks send (the synthetic folder's template):
    system prompt, a user turn with the image ahead of QUESTION, the assistant's turn."""
    return ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            f"<|im_start|>user\n{image_marker}{QUESTION}<|im_end|>\n<|im_start|>assistant\n")


def chat_summary(chat_runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat figures both benchmarks report: medians over the measured chats' TTFT,
    prompt time and decode rate (and the TTFT of each run), token counts of the first."""
    median = statistics.median
    return {
        "ttft_s": median(r["ttft_s"] for r in chat_runs),
        "ttft_runs": [r["ttft_s"] for r in chat_runs],
        "prompt_s": median(r["prompt_s"] for r in chat_runs),
        "prompt_tokens": chat_runs[0]["prompt_tokens"],
        "decode_tok_s": median(r["decode_tok_s"] for r in chat_runs),
        "gen_tokens": chat_runs[0]["gen_tokens"],
    }
