"""EXL3 models without a source checkpoint: plain quantization and synthetic folders.

Public API:
- ``quantize_linear_plain(weight[out, in], k_bits, codebook="mul1", bias=None, seed=0)
  -> dict[suffix, Tensor]``: incoherence transform (random signs + block Hadamard on
  both sides, per-input and per-output RMS scales, one global scale) and the real
  trellis encoder, no Hessian. For tests and quick conversions; the quantizer in
  ``exl3cli/convert`` does the Hessian-aware version.
- ``random_exl3_linear(in_features, out_features, k_bits, codebook="mul1",
  generator=None) -> dict[suffix, Tensor]``: random trellis words, random signs,
  scales that keep activations at unit RMS.
- ``SHAPES``: name -> config.json dict of real architectures (public facts):
  ``llama3-8b`` (Llama 3.1 8B), ``llama3.2-1b``, ``smollm2-135m`` (hidden 576: stored
  padded to 640), ``qwen2.5-0.5b`` (its sizes, Llama layers), ``tiny``.
- ``write_synthetic_model(out_dir, shape="tiny", bits=4.0, head_bits=6,
  codebook="mul1", tokenizer_from=None, seed=0, shard_bytes=..., num_layers=None)
  -> Path``: an EXL3
  folder loadable by any EXL3 reader. Fractional ``bits`` mixes floor/ceil per layer.
- ``write_byte_tokenizer(folder, vocab_size)``: a minimal byte-level tokenizer (256
  byte tokens + ``<|begin_of_text|>``, ``<|end_of_text|>``).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch

from exl3cli.codec.format import (
    DEFAULT_SHARD_BYTES,
    Exl3FolderWriter,
    make_quantization_config,
    padded_size,
    write_exl3_linear,
)
from exl3cli.codec.hadamard import block_hadamard
from exl3cli.ops.viterbi import encode_tiles

# Global scale of the rotated weight relative to its RMS; the codec's Gaussian sweeps
# (NOTES.md) found the best MSE a little above 1 for K >= 3.
_GLOBAL_SCALE = {1: 1.0, 2: 1.02, 3: 1.04}
_DEFAULT_GLOBAL_SCALE = 1.1


def _random_signs(n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2, (n,), generator=generator).float() * 2 - 1


def _rms(x: torch.Tensor, dim: int) -> torch.Tensor:
    rms = x.pow(2).mean(dim=dim).sqrt()
    # Zero rows/columns (padding) keep scale 1; fp16 round-trip so decode sees the same.
    return torch.where(rms > 0, rms, torch.ones_like(rms)).clamp(1e-4, 6e4).half().float()


def quantize_linear_plain(
    weight: torch.Tensor,
    k_bits: float,
    codebook: str = "mul1",
    bias: torch.Tensor | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Quantize a Hugging Face (out, in) weight into EXL3 tensors (by suffix)."""
    out_features, in_features = weight.shape
    pin, pout = padded_size(in_features), padded_size(out_features)
    w = torch.zeros(pin, pout, dtype=torch.float32)
    w[:in_features, :out_features] = weight.detach().float().t()
    gen = torch.Generator().manual_seed(seed)
    su, sv = _random_signs(pin, gen), _random_signs(pout, gen)
    # W = diag(suh) H Ŵ H diag(svh): fold RMS scales into suh/svh, then rotate.
    row_scale = _rms(w, dim=1)
    w = w / row_scale[:, None]
    col_scale = _rms(w, dim=0)
    w = w / col_scale[None, :]
    rotated = block_hadamard(block_hadamard(w * su[:, None] * sv[None, :], dim=0), dim=1)
    factor = _GLOBAL_SCALE.get(int(k_bits), _DEFAULT_GLOBAL_SCALE)
    global_scale = float(rotated.pow(2).mean().sqrt()) * factor or 1.0
    trellis = encode_tiles(rotated / global_scale, k_bits, codebook)
    suh = su * row_scale
    svh = sv * col_scale * global_scale
    tensors = write_exl3_linear("x", trellis, suh, svh, codebook, bias)
    return {name.removeprefix("x."): value for name, value in tensors.items()}


def random_exl3_linear(
    in_features: int,
    out_features: int,
    k_bits: float,
    codebook: str = "mul1",
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """Random trellis words and signs; y = x W keeps roughly the RMS of x."""
    gen = generator or torch.Generator().manual_seed(0)
    pin, pout = padded_size(in_features), padded_size(out_features)
    words = int(16 * k_bits)
    trellis = torch.randint(-(2**15), 2**15, (pin // 16, pout // 16, words),
                            generator=gen, dtype=torch.int32).to(torch.int16)
    suh = _random_signs(pin, gen)
    svh = _random_signs(pout, gen) / math.sqrt(in_features)
    tensors = write_exl3_linear("x", trellis, suh, svh, codebook)
    return {name.removeprefix("x."): value for name, value in tensors.items()}


def _llama_config(**fields: Any) -> dict[str, Any]:
    base = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "attention_bias": False,
        "mlp_bias": False, "initializer_range": 0.02, "pretraining_tp": 1,
        "use_cache": True,
    }
    base.update(fields)
    return base


_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": _llama_config(  # Meta-Llama-3.1-8B
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        rope_theta=500000.0, rope_scaling={**_LLAMA3_ROPE, "factor": 8.0},
        max_position_embeddings=131072, bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009], tie_word_embeddings=False,
    ),
    "llama3.2-1b": _llama_config(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        rope_theta=500000.0, rope_scaling={**_LLAMA3_ROPE, "factor": 32.0},
        max_position_embeddings=131072, bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009], tie_word_embeddings=True,
    ),
    "smollm2-135m": _llama_config(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
        rope_theta=100000.0, max_position_embeddings=8192, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=True,
    ),
    # Qwen2.5(-Coder)-0.5B's sizes on the Llama architecture (no q/k/v bias: a few KiB,
    # nothing that moves a speed or memory figure); untied here, as EXL3 stores the head.
    "qwen2.5-0.5b": _llama_config(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, head_dim=64, vocab_size=151936,
        rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6,
        bos_token_id=151643, eos_token_id=151645, tie_word_embeddings=False,
    ),
    "tiny": _llama_config(  # hidden and intermediate not multiples of 128 on purpose
        hidden_size=192, intermediate_size=320, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, head_dim=32, vocab_size=320,
        rope_theta=10000.0, max_position_embeddings=2048, bos_token_id=256,
        eos_token_id=257, tie_word_embeddings=False,
    ),
}
SHAPES["llama3.1-8b"] = SHAPES["llama3-8b"]


def linear_shapes(config: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(module name, in_features, out_features) of every linear of a Llama-shaped config."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    shapes = []
    for i in range(config["num_hidden_layers"]):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        shapes += [
            (f"{attn}.q_proj", hidden, heads * head_dim),
            (f"{attn}.k_proj", hidden, kv * head_dim),
            (f"{attn}.v_proj", hidden, kv * head_dim),
            (f"{attn}.o_proj", heads * head_dim, hidden),
            (f"{mlp}.gate_proj", hidden, inter),
            (f"{mlp}.up_proj", hidden, inter),
            (f"{mlp}.down_proj", inter, hidden),
        ]
    return shapes


def _layer_bits(bits: float, index: int, count: int) -> int:
    """Integer K per layer so that the average over ``count`` layers is ``bits``."""
    low = math.floor(bits)
    promoted = round((bits - low) * count)
    return low + (1 if index < promoted else 0)


def write_synthetic_model(
    out_dir: str | Path,
    shape: str = "tiny",
    bits: float = 4.0,
    head_bits: int = 6,
    codebook: str = "mul1",
    tokenizer_from: str | Path | None = None,
    seed: int = 0,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    num_layers: int | None = None,
) -> Path:
    """Write an EXL3 folder of architecture ``shape`` with random quantized weights.

    ``num_layers`` overrides the depth (every other size stays the real one)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {sorted(SHAPES)}")
    if not 1 <= bits <= 8 or not 1 <= head_bits <= 8:
        raise ValueError("bits and head_bits must lie in 1..8")
    config = dict(SHAPES[shape])
    if num_layers is not None:
        config["num_hidden_layers"] = int(num_layers)
    gen = torch.Generator().manual_seed(seed)
    writer = Exl3FolderWriter(out_dir, config, shard_bytes)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    dtype = getattr(torch, config["torch_dtype"])
    embed = torch.randn(vocab, hidden, generator=gen).to(dtype)
    writer.add_tensor("model.embed_tokens.weight", embed)
    ones = torch.ones(hidden, dtype=dtype)
    layers = config["num_hidden_layers"]
    for name, in_features, out_features in linear_shapes(config):
        layer = int(name.split(".")[2])
        if name.endswith("q_proj"):
            writer.add_tensor(f"model.layers.{layer}.input_layernorm.weight", ones)
        if name.endswith("gate_proj"):
            writer.add_tensor(f"model.layers.{layer}.post_attention_layernorm.weight", ones)
        k = _layer_bits(bits, layer, layers)
        writer.add_linear_tensors(name, random_exl3_linear(in_features, out_features, k,
                                                           codebook, gen))
    writer.add_tensor("model.norm.weight", ones)
    writer.add_linear_tensors("lm_head", random_exl3_linear(hidden, vocab, head_bits,
                                                            codebook, gen))
    out = writer.close(make_quantization_config(bits, head_bits, codebook, synthetic=True))
    _write_generation_config(out, config)
    if tokenizer_from is not None:
        copy_tokenizer(tokenizer_from, out)
    else:
        write_byte_tokenizer(out, vocab)
    return out


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
                   "generation_config.json")


def copy_tokenizer(source: str | Path, out_dir: str | Path) -> list[str]:
    """Copy the tokenizer files present in ``source``; returns the names copied."""
    copied = []
    for name in TOKENIZER_FILES:
        path = Path(source) / name
        if path.is_file():
            shutil.copyfile(path, Path(out_dir) / name)
            copied.append(name)
    if "tokenizer.json" not in copied and "tokenizer.model" not in copied:
        raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in {source}")
    return copied


def _write_generation_config(out_dir: Path, config: dict[str, Any]) -> None:
    data = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}
    (out_dir / "generation_config.json").write_text(json.dumps(data, indent=2) + "\n")


def write_byte_tokenizer(folder: str | Path, vocab_size: int) -> Path:
    """A byte-level BPE without merges: ids 0..255 are bytes, 256/257 are BOS/EOS."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if vocab_size < 258:
        raise ValueError("a byte-level tokenizer needs a vocabulary of at least 258")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of_char)
    tokenizer = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tokenizer.add_special_tokens([AddedToken(bos, special=True), AddedToken(eos, special=True)])
    folder = Path(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    tok_config = {"bos_token": bos, "eos_token": eos, "add_bos_token": True,
                  "model_max_length": 2048, "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return folder


def _byte_of_char(char: str) -> int:
    """Inverse of the GPT-2 byte -> printable character map (orders the alphabet)."""
    code = ord(char)
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
