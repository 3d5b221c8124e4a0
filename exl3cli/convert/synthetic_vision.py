"""Synthetic image-text EXL3 folders: Qwen2.5-VL's shape with random weights.

Public API:
- ``VISION_SHAPES``: name -> (config.json dict, preprocessor_config.json dict, first
  special token id): ``qwen2.5-vl-7b`` (Qwen2.5-VL-7B-Instruct's public shape: text
  hidden 3584, 28 layers, 28 / 4 heads, intermediate 18944, vocabulary 152064; tower
  depth 32, hidden 1280, 16 heads, intermediate 3420, windows of 112 pixels, full
  attention in blocks 7, 15, 23, 31) and ``qwen2.5-vl-tiny`` (the same layout in
  miniature, for CPU dry runs).
- ``write_synthetic_vision_model(out_dir, shape, bits=4.0, head_bits=6, codebook="mul1",
  seed=0, shard_bytes=..., num_layers=None, workers=None) -> Path``: the language model as random
  trellis words (as ``synthetic.write_synthetic_model``; q/k/v with zero biases) and
  the vision tower at 16 bits under "visual.*" (the names transformers' hub
  checkpoints, exl3 convert and ExLlamaV3 1.6.5 use; ExLlamaV3 keeps Qwen2.5-VL's tower
  unquantized by default), its random weights scaled so activations stay finite; a
  tokenizer whose special tokens sit at Qwen's ids (the image and turn tokens both
  loaders look up), a chat template and a preprocessor_config.json. For speed and
  memory measurements: the text it writes is noise.
"""

from __future__ import annotations

import json
import math
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from exl3cli.codec.format import DEFAULT_SHARD_BYTES, Exl3FolderWriter, make_quantization_config
from exl3cli.convert.synthetic import _layer_bits, linear_shapes, random_exl3_linear

# Qwen2's special tokens, in id order from the first special id (151643 in Qwen's vocabulary).
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
            "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
            "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
            "<|image_pad|>", "<|video_pad|>")
# Written for exl3 in the shape of Qwen2.5-VL's template: string contents (exl3 writes
# image placeholders into them) or parts of type "image" / "text".
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711], "do_resize": True,
    "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
}


def _qwen_vl_config(first_special: int, vision: dict[str, Any], **text: Any) -> dict[str, Any]:
    ids = {name: first_special + i for i, name in enumerate(SPECIALS)}
    config = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
        "use_sliding_window": False, "sliding_window": 32768, "tie_word_embeddings": False,
        "rope_theta": 1000000.0, "max_position_embeddings": 128000,
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"], "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_config": {"model_type": "qwen2_5_vl", "hidden_act": "silu", "in_chans": 3,
                          "in_channels": 3, "patch_size": 14, "spatial_patch_size": 14,
                          "spatial_merge_size": 2, "temporal_patch_size": 2,
                          "window_size": 112, "tokens_per_second": 2, **vision},
    }
    config.update(text)
    config["max_window_layers"] = config["num_hidden_layers"]
    return config


VISION_SHAPES: dict[str, tuple[dict[str, Any], dict[str, Any], int]] = {
    "qwen2.5-vl-7b": (_qwen_vl_config(
        151643,
        {"depth": 32, "hidden_size": 1280, "num_heads": 16, "intermediate_size": 3420,
         "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31]},
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
    ), PREPROCESSOR, 151643),
    # Every width a multiple of 128 (as ExLlamaV3 needs); head_dim 64 as M-RoPE [8, 12, 12].
    "qwen2.5-vl-tiny": (_qwen_vl_config(
        384,
        {"depth": 4, "hidden_size": 128, "num_heads": 2, "intermediate_size": 256,
         "out_hidden_size": 256, "fullatt_block_indexes": [1, 3]},
        hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
        rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]},
    ), PREPROCESSOR, 384),
}


def _randn(shape: tuple[int, ...], std: float, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * std).to(torch.float16)


# A tensor to write: kind ("tensor", "dense", "exl3"), name, and what makes its value(s)
# from a generator of its own (so tensors are made in parallel, still deterministic).
_Task = tuple[str, str, Callable[[torch.Generator], Any]]


def _tower_tasks(vision: dict[str, Any]) -> list[_Task]:
    """Qwen2.5-VL's vision tower under "visual." at 16 bits. Each projection keeps its
    input's RMS (std 1/sqrt(fan-in)); the blocks' output projections are scaled by
    1/sqrt(2 * depth) so the residual stream stays near unit RMS over all blocks."""
    hidden, inter = vision["hidden_size"], vision["intermediate_size"]
    depth, merge = vision["depth"], vision["spatial_merge_size"] ** 2
    frames, side = vision["temporal_patch_size"], vision["patch_size"]
    residual = 1 / math.sqrt(2 * depth)

    def ones(gen: torch.Generator) -> torch.Tensor:
        return torch.ones(hidden, dtype=torch.float16)

    def dense(name: str, fan_in: int, fan_out: int, scale: float = 1.0) -> _Task:
        return ("dense", name, lambda gen: (
            _randn((fan_out, fan_in), scale / math.sqrt(fan_in), gen),
            torch.zeros(fan_out, dtype=torch.float16)))

    tasks: list[_Task] = [("tensor", "visual.patch_embed.proj.weight", lambda gen: _randn(
        (hidden, 3, frames, side, side), 1 / math.sqrt(3 * frames * side * side), gen))]
    for i in range(depth):
        at = f"visual.blocks.{i}."
        tasks += [("tensor", at + "norm1.weight", ones),
                  dense(at + "attn.qkv", hidden, 3 * hidden),
                  dense(at + "attn.proj", hidden, hidden, residual),
                  ("tensor", at + "norm2.weight", ones),
                  dense(at + "mlp.gate_proj", hidden, inter),
                  dense(at + "mlp.up_proj", hidden, inter),
                  dense(at + "mlp.down_proj", inter, hidden, residual)]
    return tasks + [("tensor", "visual.merger.ln_q.weight", ones),
                    dense("visual.merger.mlp.0", merge * hidden, merge * hidden),
                    dense("visual.merger.mlp.2", merge * hidden, vision["out_hidden_size"])]


def _randn_rows(rows: int, cols: int, gen: torch.Generator, workers: int) -> torch.Tensor:
    """A standard normal bfloat16 [rows, cols], filled in row blocks by `workers` threads
    (the embedding: the largest tensor, else the writer's critical path)."""
    out = torch.empty(rows, cols, dtype=torch.bfloat16)
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    step = -(-rows // workers)

    def fill(index: int) -> None:
        block = torch.Generator().manual_seed(seed + index)
        begin = index * step
        end = min(rows, begin + step)
        out[begin:end] = torch.randn(end - begin, cols, generator=block)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(fill, range(-(-rows // step))))
    return out


def _text_tasks(config: dict[str, Any], bits: float, head_bits: int, codebook: str,
                workers: int) -> list[_Task]:
    """The language model: bf16 embedding and norms, random trellis linears (Qwen2's
    q, k, v with zero biases), a quantized head."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    layers = config["num_hidden_layers"]

    def ones(gen: torch.Generator) -> torch.Tensor:
        return torch.ones(hidden, dtype=torch.bfloat16)

    def linear(name: str, in_features: int, out_features: int, k: int) -> _Task:
        def make(gen: torch.Generator) -> dict[str, torch.Tensor]:
            tensors = random_exl3_linear(in_features, out_features, k, codebook, gen)
            if name.endswith(("q_proj", "k_proj", "v_proj")):
                tensors["bias"] = torch.zeros(out_features, dtype=torch.float16)
            return tensors
        return ("exl3", name, make)

    tasks: list[_Task] = [("tensor", "model.embed_tokens.weight",
                           lambda gen: _randn_rows(vocab, hidden, gen, workers))]
    for name, in_features, out_features in linear_shapes(config):
        layer = int(name.split(".")[2])
        if name.endswith("q_proj"):
            tasks.append(("tensor", f"model.layers.{layer}.input_layernorm.weight", ones))
        if name.endswith("gate_proj"):
            tasks.append(("tensor", f"model.layers.{layer}.post_attention_layernorm.weight",
                          ones))
        tasks.append(linear(name, in_features, out_features, _layer_bits(bits, layer, layers)))
    return tasks + [("tensor", "model.norm.weight", ones),
                    linear("lm_head", hidden, vocab, head_bits)]


def _made(tasks: list[_Task], seed: int, workers: int) -> Iterator[tuple[_Task, Any]]:
    """Each task with its value, in order; made by `workers` threads (torch's random
    fills and casts release the GIL), a bounded number ahead of the writer."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        ahead: deque[tuple[_Task, Future[Any]]] = deque()
        for index, task in enumerate(tasks):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
            ahead.append((task, pool.submit(task[2], gen)))
            while len(ahead) > 2 * workers:
                done, future = ahead.popleft()
                yield done, future.result()
        while ahead:
            done, future = ahead.popleft()
            yield done, future.result()


def write_synthetic_vision_model(
    out_dir: str | Path,
    shape: str = "qwen2.5-vl-tiny",
    bits: float = 4.0,
    head_bits: int = 6,
    codebook: str = "mul1",
    seed: int = 0,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    num_layers: int | None = None,
    workers: int | None = None,
) -> Path:
    """Write a Qwen2.5-VL-shaped EXL3 folder (module docstring); ``num_layers``
    overrides the language model's depth; ``workers`` threads make the random tensors
    (default: the CPU count, at most 16)."""
    if shape not in VISION_SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {sorted(VISION_SHAPES)}")
    if not 1 <= bits <= 8 or not 1 <= head_bits <= 8:
        raise ValueError("bits and head_bits must lie in 1..8")
    base, preprocessor, first_special = VISION_SHAPES[shape]
    config = json.loads(json.dumps(base))
    if num_layers is not None:
        config["num_hidden_layers"] = config["max_window_layers"] = int(num_layers)
    writer = Exl3FolderWriter(out_dir, config, shard_bytes)
    workers = workers or min(16, os.cpu_count() or 1)
    tasks = (_text_tasks(config, bits, head_bits, codebook, workers)
             + _tower_tasks(config["vision_config"]))
    for (kind, name, _), value in _made(tasks, seed, workers):
        if kind == "tensor":
            writer.add_tensor(name, value)
        elif kind == "dense":
            writer.add_dense_linear(name, *value)
        else:
            writer.add_linear_tensors(name, value)
    out = writer.close(make_quantization_config(bits, head_bits, codebook, synthetic=True))
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"],
         "eos_token_id": [config["eos_token_id"], first_special]}, indent=2) + "\n")
    write_qwen_tokenizer(out, config["vocab_size"], first_special)
    return out


def write_qwen_tokenizer(folder: str | Path, vocab_size: int, first_special: int) -> Path:
    """A byte-level BPE without merges covering every id below `vocab_size`: ids 0..255
    are bytes, SPECIALS start at `first_special`, the rest are filler tokens that no
    text encodes to (they decode as their own spelling)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from exl3cli.convert.synthetic import _byte_of_char

    if first_special < 256 or first_special + len(SPECIALS) > vocab_size:
        raise ValueError("the special tokens must fit between the bytes and vocab_size")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of_char)
    vocab = {c: i for i, c in enumerate(alphabet)}
    for i in range(256, vocab_size):
        special = i - first_special
        vocab[SPECIALS[special] if 0 <= special < len(SPECIALS) else f"<|filler_{i}|>"] = i
    tokenizer = Tokenizer(models.BPE(vocab, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(name, special=True) for name in SPECIALS])
    folder = Path(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    decoder = {str(first_special + i): {"content": name, "special": True, "lstrip": False,
                                        "rstrip": False, "normalized": False,
                                        "single_word": False}
               for i, name in enumerate(SPECIALS)}
    tok_config = {"add_bos_token": False, "add_prefix_space": False, "bos_token": None,
                  "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                  "model_max_length": 131072, "tokenizer_class": "Qwen2Tokenizer",
                  "chat_template": CHAT_TEMPLATE, "added_tokens_decoder": decoder}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return folder
