"""What a stored model is, as Ollama describes it: `details` (family, parameter size,
quantization level) and `model_info`, read from config.json and the safetensors headers.
/api/tags, /api/show (client/local.py) and /api/ps (runtime/residency.py) show the same."""

from __future__ import annotations

import json
from typing import Any

from exl3cli.store.manifest import Manifest
from exl3cli.store.store import ModelStore

# Per-module side tensors of EXL3 folders: not weights of their own.
_EXL3_SIDE_TENSORS = (".suh", ".svh", ".su", ".sv", ".mul1", ".mcg")


def model_capabilities(store: ModelStore, manifest: Manifest) -> list[str]:
    """Ollama's `capabilities`: "completion", plus "vision" for image-text models."""
    from exl3cli.engine.models.vision.loader import reads_images

    try:
        config = json.loads(store.blob_path(manifest.files["config.json"]).read_text())
    except (KeyError, OSError, ValueError):
        return ["completion"]
    return ["completion", "vision"] if isinstance(config, dict) and reads_images(config) \
        else ["completion"]


def model_details(store: ModelStore, manifest: Manifest) -> dict[str, Any]:
    """Ollama's `details` of a stored model (what /api/tags and /api/ps show)."""
    return model_facts(store, manifest)[0]


def model_facts(store: ModelStore, manifest: Manifest) -> tuple[dict[str, Any], dict[str, Any]]:
    """Ollama's `details` and `model_info` from config.json and safetensors headers."""
    config: dict[str, Any] = {}
    if "config.json" in manifest.files:
        try:
            config = json.loads(store.blob_path(manifest.files["config.json"]).read_text())
        except (OSError, ValueError):
            config = {}
    text_config = config.get("text_config") or config
    family = str(config.get("model_type") or "unknown")
    count = _parameter_count(store, manifest)
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") == "exl3":
        level = f"EXL3 {float(quant.get('bits', 0)):.2f}bpw"
        fmt = "exl3"
    else:
        level = str(config.get("torch_dtype") or "unknown").upper().replace("BFLOAT16", "BF16") \
            .replace("FLOAT16", "F16").replace("FLOAT32", "F32")
        fmt = "safetensors"
    details = {
        "parent_model": "", "format": fmt, "family": family, "families": [family],
        "parameter_size": _human_count(count), "quantization_level": level,
    }
    info: dict[str, Any] = {"general.architecture": family, "general.parameter_count": count}
    for key, field in (("context_length", "max_position_embeddings"),
                       ("embedding_length", "hidden_size"), ("block_count", "num_hidden_layers"),
                       ("attention.head_count", "num_attention_heads"),
                       ("attention.head_count_kv", "num_key_value_heads"),
                       ("vocab_size", "vocab_size")):
        if text_config.get(field) is not None:
            info[f"{family}.{key}"] = text_config[field]
    return details, info


def _parameter_count(store: ModelStore, manifest: Manifest) -> int:
    total = 0
    for relpath, digest in manifest.files.items():
        if not relpath.endswith(".safetensors"):
            continue
        try:
            with open(store.blob_path(digest), "rb") as handle:
                size = int.from_bytes(handle.read(8), "little")
                header = json.loads(handle.read(size))
        except (OSError, ValueError):
            continue
        for tensor, entry in header.items():
            if tensor == "__metadata__" or tensor.endswith(_EXL3_SIDE_TENSORS):
                continue
            shape = entry.get("shape", [])
            if tensor.endswith(".trellis") and len(shape) == 3:
                total += shape[0] * 16 * shape[1] * 16  # one 16x16 tile per [kb, nb]
                continue
            count = 1
            for dim in shape:
                count *= dim
            total += count
    return total


def _human_count(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f}".rstrip("0").rstrip(".") + unit
    return str(count)
