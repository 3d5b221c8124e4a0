"""Quantizing multi-head latent attention (DeepSeek-V3): the qkv group in two stages.

An MLA layer's "qkv" group holds projections with two different inputs: q_proj (or
q_a_proj) and kv_a_proj_with_mqa read the normed hidden state; q_b_proj reads the
normed query latent (q_a_layernorm of q_a_proj's output). So the first stage quantizes
the hidden state's readers on its Hessian, and the second quantizes q_b_proj on the
latent it receives once q_a_proj is quantized (captured with a hook on the engine's
LatentQKV, engine/layers/mla.py), as o_proj and down_proj see the outputs of the
quantized modules before them. kv_b_proj (the normed key/value latent to per-head keys
and values) is written at 16 bits, as ExLlamaV3 1.6.5 stores it: it reads that dense
weight (folding it into queries and outputs), so the folders stay loadable there. The
group shares one bit width (allocation.py) and the layer's o projection reads the value
heads without their padding (HeadSlice.narrow).

Public API:
- ``latent_modules(names, config, i) -> list[str]``: the qkv group of an MLA layer.
- ``latent_kept_modules(names, i) -> list[str]``: its linears kept at 16 bits (kv_b_proj).
- ``latent_norm_names(names, config, i) -> list[str]``: its latent norms (kept as they are).
- ``quantize_latent(conv, i, hidden, dense, bits) -> list[QuantizedLinear]``: ``conv`` is
  the pipeline's converter; ``dense`` (module -> ((in, out) weight, bias)) is updated
  with the first stage's quantized weights.
"""

from __future__ import annotations

import torch

from exl3cli.engine.spec.architecture import TensorNames
from exl3cli.engine.spec.config import ModelConfig


def _has_query_latent(config: ModelConfig) -> bool:
    return bool(config.raw.get("q_lora_rank"))


def latent_modules(names: TensorNames, config: ModelConfig, i: int) -> list[str]:
    """The quantized ones: [q_a_proj, kv_a_proj_with_mqa, q_b_proj], or [q_proj,
    kv_a_proj_with_mqa] when the model has no query latent."""
    first = [names.q_a_proj if _has_query_latent(config) else names.q_proj, names.kv_a_proj]
    second = [names.q_b_proj] if _has_query_latent(config) else []
    return [n.format(i=i) for n in first + second]


def latent_kept_modules(names: TensorNames, i: int) -> list[str]:
    """kv_b_proj, written at 16 bits as ExLlamaV3 stores it (it reads kv_b_proj.weight
    and folds it into the queries and outputs)."""
    return [names.kv_b_proj.format(i=i)]


def latent_norm_names(names: TensorNames, config: ModelConfig, i: int) -> list[str]:
    norms = ([names.q_a_norm] if _has_query_latent(config) else []) + [names.kv_a_norm]
    return [n.format(i=i) for n in norms]


def quantize_latent(conv, i: int, hidden: torch.Tensor, dense: dict,
                    bits: dict[str, int]) -> list:
    """Layer `i`'s qkv group, stage by stage (module docstring)."""
    engine, names = conv.engine_layers, conv.names
    modules = latent_modules(names, conv.config, i)
    first, second = modules[:2], modules[2:]
    x = engine.linear_input(engine.build(i, dense, conv.tensor), hidden, "qkv")
    results = conv.quantize(first, x, [bits[m] for m in first])
    del x
    for q in results:
        dense[q.name] = (q.weight, conv.bias(q.name))
    if second:  # q_b_proj
        layer = engine.build(i, dense, conv.tensor)
        x = engine.module_input(layer, hidden, layer.attention.qkv.q_b)
        results += conv.quantize(second, x, [bits[m] for m in second])
        del x
    return results
