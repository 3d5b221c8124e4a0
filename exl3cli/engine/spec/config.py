"""Parse a Hugging Face `config.json` into architecture-agnostic fields.

Both config styles are accepted: transformers 4.x (`rope_theta` + `rope_scaling` at the
top level) and 5.x (`rope_parameters` holding theta, type and scaling keys). Gemma 3's
separate rope for sliding layers comes either as `rope_local_base_freq` (4.x) or as
`rope_parameters` keyed by layer type (5.x). Qwen2.5-VL's M-RoPE ("mrope" in 4.x, or
default rope with an `mrope_section`) becomes `mrope_section` over default frequencies.
A multimodal wrapper's `text_config`
(Gemma3ForConditionalGeneration) describes the language model and is read in place of
the top level; keys it leaves out take the family's defaults (`ArchitectureSpec.
config_defaults`, transformers' values, given by architecture.load_family_config), as
transformers itself fills them in.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exl3cli.errors import ModelLoadError

# Without these no model can be built, whatever its family.
_REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@dataclass
class ModelConfig:
    """What the engine needs to know about a model, independent of its family."""

    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float = 10000.0
    # Scaling parameters with a normalised "rope_type" key ("default" when unscaled).
    rope_scaling: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default"})
    partial_rotary_factor: float = 1.0
    # M-RoPE (Qwen2.5-VL): how many rotary frequencies follow each of the temporal,
    # height and width positions (summing to rotary dim / 2); None for 1-D rope.
    mrope_section: list[int] | None = None
    # Rope of sliding-window layers when it differs from the global one (Gemma 3).
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: dict[str, Any] | None = None
    # Attention scores scale by query_pre_attn_scalar**-0.5 instead of head_dim**-0.5.
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # the same on the output logits
    rms_norm_eps: float = 1e-6
    sliding_window: int | None = None
    # Per layer: "full_attention" or "sliding_attention"; None lets the spec decide.
    layer_types: list[str] | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    torch_dtype: str | None = None
    hidden_act: str | None = None  # None: the architecture's default
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any],
                  defaults: dict[str, Any] | None = None) -> ModelConfig:
        """Build from the parsed JSON of a config.json; raises ModelLoadError if incomplete.
        `defaults` fill keys the file leaves out (an explicit null stays null)."""
        data = {**(defaults or {}), **_language_model_keys(data)}
        missing = [key for key in _REQUIRED_KEYS if data.get(key) is None]
        if missing:
            raise ModelLoadError(f"config.json lacks required keys: {', '.join(missing)}")
        architectures = data.get("architectures") or []
        if not architectures:
            raise ModelLoadError("config.json has no 'architectures' entry")
        num_heads = int(data["num_attention_heads"])
        head_dim = data.get("head_dim") or int(data["hidden_size"]) // num_heads
        theta, scaling, partial = _parse_rope(data)
        mrope_section = scaling.pop("mrope_section", None)
        sliding_theta, sliding_scaling = _parse_sliding_rope(data)
        layer_types = data.get("layer_types")
        return cls(
            architecture=str(architectures[0]),
            model_type=str(data.get("model_type", "")),
            hidden_size=int(data["hidden_size"]),
            intermediate_size=int(data.get("intermediate_size") or 4 * int(data["hidden_size"])),
            num_layers=int(data["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(data.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            vocab_size=int(data["vocab_size"]),
            rope_theta=theta,
            rope_scaling=scaling,
            partial_rotary_factor=partial,
            mrope_section=[int(n) for n in mrope_section] if mrope_section else None,
            sliding_rope_theta=sliding_theta,
            sliding_rope_scaling=sliding_scaling,
            query_pre_attn_scalar=_optional_float(data.get("query_pre_attn_scalar")),
            attn_logit_softcapping=_optional_float(data.get("attn_logit_softcapping")),
            final_logit_softcapping=_optional_float(data.get("final_logit_softcapping")),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            sliding_window=_optional_int(data.get("sliding_window")),
            layer_types=list(layer_types) if layer_types else None,
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            max_position_embeddings=int(data.get("max_position_embeddings") or 2048),
            torch_dtype=data.get("torch_dtype") or data.get("dtype"),
            # Gemma names it hidden_activation (its hidden_act, if any, is legacy).
            hidden_act=data.get("hidden_activation") or data.get("hidden_act"),
            bos_token_id=_optional_int(data.get("bos_token_id")),
            eos_token_ids=_id_list(data.get("eos_token_id")),
            raw=data,
        )


def load_model_config(
    folder: str | Path,
    defaults: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
) -> ModelConfig:
    """Read `<folder>/config.json`; ModelLoadError when it is missing or malformed.
    `defaults(data)` gives values for keys the file leaves out (a family's defaults:
    architecture.load_family_config passes them; this module knows no families)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"no config.json in {folder}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return ModelConfig.from_dict(data, defaults(data) if defaults is not None else None)


def _language_model_keys(data: dict[str, Any]) -> dict[str, Any]:
    """The top level, or for a multimodal wrapper whose language model lives in
    `text_config` that merged over it (the wrapper's `architectures` kept)."""
    text = data.get("text_config")
    if data.get("hidden_size") is not None or not isinstance(text, dict):
        return data
    merged = {key: value for key, value in data.items() if key != "text_config"}
    merged.update(text)
    if data.get("architectures"):
        merged["architectures"] = data["architectures"]
    return merged


_FULL, _SLIDING = "full_attention", "sliding_attention"


def _parse_rope(data: dict[str, Any]) -> tuple[float, dict[str, Any], float]:
    """Return (theta, scaling dict with 'rope_type', partial rotary factor)."""
    params = dict(data.get("rope_parameters") or {})
    if isinstance(params.get(_FULL), dict):  # per layer type: the global one is the default
        params = dict(params[_FULL])
    legacy = data.get("rope_scaling") or {}
    merged = {**legacy, **params}
    theta = float(merged.pop("rope_theta", data.get("rope_theta", 10000.0)))
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rope_type == "mrope":  # transformers 4.x's name for M-RoPE over default frequencies
        rope_type = "default"
    partial = float(merged.pop("partial_rotary_factor", data.get("partial_rotary_factor", 1.0)))
    scaling = {"rope_type": str(rope_type), **merged}
    if partial != 1.0:  # the rotary table covers only this fraction of head_dim
        scaling["partial_rotary_factor"] = partial
    return theta, scaling, partial


def _parse_sliding_rope(data: dict[str, Any]) -> tuple[float | None, dict[str, Any] | None]:
    """(theta, scaling) of sliding layers when config.json gives them their own rope."""
    params = data.get("rope_parameters") or {}
    if isinstance(params.get(_SLIDING), dict):
        local = dict(params[_SLIDING])
        theta = float(local.pop("rope_theta", data.get("rope_local_base_freq", 10000.0)))
        rope_type = local.pop("rope_type", None) or local.pop("type", None) or "default"
        local.pop("type", None)
        return theta, {"rope_type": str(rope_type), **local}
    if data.get("rope_local_base_freq") is not None:  # 4.x: local layers are unscaled
        return float(data["rope_local_base_freq"]), {"rope_type": "default"}
    return None, None


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]
