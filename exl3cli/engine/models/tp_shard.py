"""One tensor-parallel rank's model: its slice of the checkpoint (shard.py) built by the
ordinary loader, with the all-reduces added (engine/layers/parallel.py).

Public API:
- ``check_parallel_support(config, spec)``: ModelLoadError for what tensor parallel
  does not run (image-text models).
- ``load_shard(folder, group, device=None, dtype=None, *, linear_mode=None,
  cpu_weights=None) -> CausalLM``: rank ``group.rank`` of ``group.world``; its
  ``config`` is the rank's (local heads, width, vocabulary slice), ``full_config``
  the model's, ``shard_plan`` what it holds.
"""

from __future__ import annotations

from pathlib import Path

import torch

from exl3cli.engine.layers.fused_experts import split_fused_experts
from exl3cli.engine.layers.mlp import GatedMLP
from exl3cli.engine.layers.moe import MoEMLP
from exl3cli.engine.layers.parallel import (
    AbsentLinear,
    Collective,
    ReducedLinear,
    ReducedModule,
    VocabShard,
)
from exl3cli.engine.models.causal_lm import CausalLM
from exl3cli.engine.models.loader import build_causal_lm, default_device, default_dtype
from exl3cli.engine.models.shard import ShardedReader, local_config, plan_shards
from exl3cli.engine.models.weights import WeightReader
from exl3cli.engine.spec.architecture import ArchitectureSpec, get_architecture, load_family_config
from exl3cli.engine.spec.config import ModelConfig
from exl3cli.errors import ModelLoadError


def check_parallel_support(config: ModelConfig, spec: ArchitectureSpec) -> None:
    """What is refused before any rank starts (more in shard.plan_shards)."""
    from exl3cli.engine.models.vision.loader import VISION_FAMILIES

    if config.architecture in VISION_FAMILIES:
        raise ModelLoadError(f"tensor parallel: {config.architecture} reads images; "
                             "image-text models run on one device (or a layer split)")
    if config.mrope_section is not None:
        raise ModelLoadError("tensor parallel: M-RoPE models run on one device")


def load_shard(folder: str | Path, group: Collective, device: torch.device | str | None = None,
               dtype: torch.dtype | None = None, *, linear_mode: str | None = None,
               cpu_weights: str | None = None) -> CausalLM:
    """Rank `group.rank`'s model (module docstring)."""
    config = load_family_config(folder)
    spec = get_architecture(config.architecture)
    check_parallel_support(config, spec)
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(config, device)
    reader = split_fused_experts(WeightReader(folder), config, spec)
    names = spec.tensor_names(reader.has)
    plan = plan_shards(config, spec, names, reader, group.rank, group.world)
    sharded = ShardedReader(reader, names, spec, config, plan)
    model = build_causal_lm(local_config(config, plan), spec, sharded, device, dtype,
                            linear_mode=linear_mode, cpu_weights=cpu_weights)
    add_reductions(model, group)
    v0, v1 = plan.vocab
    model.vocab_shard = VocabShard(v0, v1, config.vocab_size, group, list(plan.vocab_sizes))
    model.full_config = config
    model.shard_plan = plan
    return model


def add_reductions(model: CausalLM, group: Collective) -> None:
    """One all-reduce after each attention (around o_proj) and after each MLP (around
    down_proj, or the whole block of a mixture); a shared expert held by another rank
    is dropped from this rank's block."""
    for layer in model.layers:
        attention = layer.attention
        attention.o = ReducedLinear(attention.o, group)
        mlp = layer.mlp
        if isinstance(mlp, MoEMLP):
            if mlp.shared is not None and isinstance(mlp.shared.down, AbsentLinear):
                mlp.shared, mlp.shared_gate = None, None
            layer.mlp = ReducedModule(mlp, group)
        elif isinstance(mlp, GatedMLP):
            mlp.down = ReducedLinear(mlp.down, group)
        else:
            raise ModelLoadError(f"tensor parallel: no split for {type(mlp).__name__}")
