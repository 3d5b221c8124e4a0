"""GGUF file -> Hugging Face model folder (dequantised safetensors + config + tokenizer).

llama.cpp's converter renames tensors and, for llama-architecture models, permutes
the rows of q_proj/k_proj so that rotary pairs sit next to each other (GPT-J style
"interleaved" layout). We rename back and apply the exact inverse permutation, so
the folder loads like the original checkpoint (modulo quantisation error).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from exl3cli.errors import ModelLoadError, UnsupportedArchitecture
from exl3cli.gguf.reader import GgufFile
from exl3cli.gguf.tokenizer import write_tokenizer_files

# GGUF `general.architecture` -> (HF architectures string, model_type, permuted q/k rows)
ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "mistral": ("MistralForCausalLM", "mistral", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_PATTERN = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Tensors llama.cpp derives from config values; the HF config carries them instead.
_DERIVED_TENSORS = {"rope_freqs.weight"}

SHARD_BYTES = 2 * 1024**3


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor, or None if the HF checkpoint has no such tensor."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name in _DERIVED_TENSORS:
        return None
    match = _BLOCK_PATTERN.match(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise UnsupportedArchitecture(f"GGUF tensor {gguf_name} has no Hugging Face equivalent")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def unpermute_rotary_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Invert llama.cpp's q/k permutation (convert_hf_to_gguf `permute`).

    llama.cpp reshapes rows as (heads, 2, head_dim/2) and swaps the last two axes,
    interleaving the two rotary halves; reshaping as (heads, head_dim/2, 2) and
    swapping back restores the HF half-split layout. Works for weights and biases.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ModelLoadError(f"cannot un-permute {rows} rows over {n_heads} heads")
    return (
        weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def build_config(model: GgufFile, vocab_size: int, tied: bool, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for the converted folder, from `<arch>.*` metadata keys."""
    hf_arch, model_type, _ = _architecture(model)
    hidden = int(model.arch_value("embedding_length"))
    heads = int(model.arch_value("attention.head_count"))
    kv_heads = int(model.arch_value("attention.head_count_kv", heads))
    head_dim = int(model.arch_value("attention.key_length", hidden // heads))
    meta = model.metadata
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(model.arch_value("feed_forward_length")),
        "num_hidden_layers": int(model.arch_value("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": int(model.arch_value("context_length", 4096)),
        "rms_norm_eps": _f32(model.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(model.arch_value("rope.freq_base", 10000.0)),
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "attention_bias": model.has_tensor("blk.0.attn_q.bias"),
        "mlp_bias": False,
    }
    for key, gguf_key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                          ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                          ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if gguf_key in meta:
            config[key] = int(meta[gguf_key])
    scaling = _rope_scaling(model)
    if scaling:
        config["rope_scaling"] = scaling
    sliding = model.arch_value("attention.sliding_window")
    if sliding:
        config["sliding_window"] = int(sliding)
    return config


def gguf_to_hf_folder(gguf_path: str | Path, out_dir: str | Path,
                      dtype: torch.dtype | None = None) -> Path:
    """Convert a GGUF file into a Hugging Face folder at `out_dir` and return its path.

    Weights are dequantised to `dtype` (default: `storage_dtype`, 16 bits unless the
    file is a full-precision F32 export). The folder is built next to `out_dir` and
    renamed into place, so a crash never leaves a half folder.
    """
    model = GgufFile(gguf_path)
    _, _, permuted = _architecture(model)
    out_dir = Path(out_dir)
    if dtype is None:
        dtype = storage_dtype([t.type_name for t in model.tensors()])
    building = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)
    try:
        heads = int(model.arch_value("attention.head_count"))
        kv_heads = int(model.arch_value("attention.head_count_kv", heads))
        vocab_size = _write_weights(model, building, dtype, permuted, heads, kv_heads)
        tied = not model.has_tensor("output.weight")
        config = build_config(model, vocab_size, tied, dtype)
        (building / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_tokenizer_files(model.metadata, building)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        building.rename(out_dir)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return out_dir


FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}


def storage_dtype(tensor_types: list[str]) -> torch.dtype:
    """How a GGUF's tensors are stored: 16 bits, so a 1 GB Q4 file does not become a 6 GB
    folder. bfloat16 when the file holds BF16 tensors (their range needs it); float16
    for quantized and F16 files (dequantised values keep 11 significant bits, far finer
    than the quantization; a tensor outside float16's range is kept at float32);
    float32 only for a file that is all F32 (a full-precision export, kept exact)."""
    kinds = set(tensor_types)
    if "BF16" in kinds:
        return torch.bfloat16
    if kinds <= {"F32", "F64"}:
        return torch.float32
    return torch.float16


def _stored(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` in `dtype`; float32 when it does not fit float16's range."""
    if dtype == torch.float16 and tensor.numel() and \
            float(tensor.abs().max()) > torch.finfo(torch.float16).max:
        return tensor.to(torch.float32).contiguous()
    return tensor.to(dtype).contiguous()


def _write_weights(model: GgufFile, folder: Path, dtype: torch.dtype, permuted: bool,
                   heads: int, kv_heads: int) -> int:
    """Dequantise every tensor into safetensors shards; returns the vocabulary size."""
    current: dict[str, torch.Tensor] = {}
    names_per_shard: list[list[str]] = [[]]
    shard_bytes = 0
    vocab_size = 0
    for gguf_name, tensor in model.iter_dequantized():
        name = hf_tensor_name(gguf_name)
        if name is None:
            continue
        if permuted and ".self_attn.q_proj." in name:
            tensor = unpermute_rotary_rows(tensor, heads)
        elif permuted and ".self_attn.k_proj." in name:
            tensor = unpermute_rotary_rows(tensor, kv_heads)
        if name == "model.embed_tokens.weight":
            vocab_size = tensor.shape[0]
        tensor = _stored(tensor, dtype)
        size = tensor.numel() * tensor.element_size()
        if shard_bytes and shard_bytes + size > SHARD_BYTES:
            _save_shard(current, folder, len(names_per_shard))
            current = {}
            names_per_shard.append([])
            shard_bytes = 0
        current[name] = tensor
        names_per_shard[-1].append(name)
        shard_bytes += size
    if not vocab_size:
        raise ModelLoadError(f"{model.path} has no token_embd tensor")
    _save_shard(current, folder, len(names_per_shard))
    _name_shards(folder, names_per_shard)
    return vocab_size


def _save_shard(tensors: dict[str, torch.Tensor], folder: Path, number: int) -> None:
    save_file(tensors, str(folder / f"shard-{number}.tmp"), metadata={"format": "pt"})


def _name_shards(folder: Path, names_per_shard: list[list[str]]) -> None:
    """One shard -> model.safetensors; several -> numbered files plus the HF index."""
    count = len(names_per_shard)
    if count == 1:
        (folder / "shard-1.tmp").rename(folder / "model.safetensors")
        return
    weight_map = {}
    for number in range(1, count + 1):
        final = f"model-{number:05d}-of-{count:05d}.safetensors"
        (folder / f"shard-{number}.tmp").rename(folder / final)
        weight_map.update({name: final for name in names_per_shard[number - 1]})
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _architecture(model: GgufFile) -> tuple[str, str, bool]:
    arch = model.architecture
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    return ARCHITECTURES[arch]


def _rope_scaling(model: GgufFile) -> dict[str, Any] | None:
    kind = model.arch_value("rope.scaling.type")
    factor = model.arch_value("rope.scaling.factor")
    if not kind or kind == "none" or not factor:
        return None
    scaling: dict[str, Any] = {"rope_type": str(kind), "factor": _f32(factor)}
    original = model.arch_value("rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _f32(value: Any) -> float:
    """A float32 metadata value printed the short way (1e-05, not 9.99999974e-06)."""
    import numpy as np

    return float(str(np.float32(value)))
