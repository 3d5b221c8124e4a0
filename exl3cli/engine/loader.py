"""Build a CausalLM from a Hugging Face model folder."""

from __future__ import annotations

from pathlib import Path

import torch

from exl3cli.engine.architecture import SLIDING_ATTENTION, ArchitectureSpec, get_architecture
from exl3cli.engine.attention import Attention
from exl3cli.engine.config import ModelConfig, load_model_config
from exl3cli.engine.mlp import GatedMLP
from exl3cli.engine.model import CausalLM, DecoderLayer
from exl3cli.engine.norm import RMSNorm
from exl3cli.engine.weights import WeightReader
from exl3cli.errors import ModelLoadError

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(config: ModelConfig, device: torch.device) -> torch.dtype:
    """The checkpoint's dtype on GPU; on CPU bfloat16 for bf16 checkpoints, else float32."""
    stored = _DTYPES.get(str(config.torch_dtype).removeprefix("torch."), torch.float32)
    if device.type == "cpu":
        return torch.bfloat16 if stored == torch.bfloat16 else torch.float32
    return stored


def load_causal_lm(
    folder: str | Path,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> CausalLM:
    """Load the model in `folder`; ModelLoadError / UnsupportedArchitecture on failure."""
    config = load_model_config(folder)
    spec = get_architecture(config.architecture)
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(config, device)
    reader = WeightReader(folder)
    return build_causal_lm(config, spec, reader, device, dtype)


def build_causal_lm(
    config: ModelConfig,
    spec: ArchitectureSpec,
    reader: WeightReader,
    device: torch.device,
    dtype: torch.dtype,
) -> CausalLM:
    """Assemble the shared blocks as `spec` describes, with weights from `reader`."""
    names = spec.tensors

    def tensor(name: str) -> torch.Tensor:
        return reader.get(name, dtype=dtype, device=device).contiguous()

    def linear(prefixes: list[str], bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Fused projections: concatenate along the output dimension.
        weight = torch.cat([tensor(p + ".weight") for p in prefixes])
        if not bias:
            return weight, None
        return weight, torch.cat([tensor(p + ".bias") for p in prefixes])

    layer_types = spec.layer_types(config)
    if len(layer_types) != config.num_layers:
        raise ModelLoadError("config.json layer_types does not match num_hidden_layers")
    layers = []
    for i in range(config.num_layers):
        qkv_w, qkv_b = linear(
            [n.format(i=i) for n in (names.q_proj, names.k_proj, names.v_proj)], spec.qkv_bias
        )
        o_w, o_b = linear([names.o_proj.format(i=i)], spec.o_bias)
        qk_norm = None
        if spec.qk_norm == "rms":
            # One [q heads + kv heads, head_dim] weight so q and k normalise in one op.
            weight = torch.cat([
                tensor(names.q_norm.format(i=i)).expand(config.num_heads, -1),
                tensor(names.k_norm.format(i=i)).expand(config.num_kv_heads, -1),
            ])
            qk_norm = RMSNorm(weight, config.rms_norm_eps)
        window = config.sliding_window if layer_types[i] == SLIDING_ATTENTION else None
        attention = Attention(
            i, qkv_w, qkv_b, o_w, o_b, config.num_heads, config.num_kv_heads,
            config.head_dim, qk_norm, window,
        )
        gate_up_w, gate_up_b = linear(
            [names.gate_proj.format(i=i), names.up_proj.format(i=i)], spec.mlp_bias
        )
        down_w, down_b = linear([names.down_proj.format(i=i)], spec.mlp_bias)
        act = config.hidden_act or spec.activation
        layers.append(DecoderLayer(
            RMSNorm(tensor(names.input_norm.format(i=i)), config.rms_norm_eps),
            attention,
            RMSNorm(tensor(names.post_attention_norm.format(i=i)), config.rms_norm_eps),
            GatedMLP(gate_up_w, gate_up_b, down_w, down_b, act),
        ))
    embed = tensor(names.embed)
    if config.tie_word_embeddings or not reader.has(names.lm_head):
        lm_head = embed
    else:
        lm_head = tensor(names.lm_head)
    final_norm = RMSNorm(tensor(names.final_norm), config.rms_norm_eps)
    return CausalLM(config, spec, embed, layers, final_norm, lm_head).eval()
