"""Calibration forward through the engine's own blocks, for families whose layers the
raw-weight ``LayerRunner`` does not reproduce (Gemma 2/3: 1 + w norms, sandwich norms,
score scale, attention soft-cap, a separate rope for sliding layers).

Each layer is assembled by ``engine.loader.build_decoder_layer`` (what the loader
itself uses) from ``DenseLinear`` weights, so the activations the quantizer calibrates
on are the ones the engine computes. The input of
one linear is read with a forward pre-hook that stops the layer right there (nothing
after it is computed).

Weights come in the converter's orientation ``(in, out)`` (float32); rows of the
calibration batch go through in chunks to bound attention memory.

Public API:
- ``EngineLayerForward(config, spec, names, device, row_chunk=16)``:
  ``.build(i, dense, tensor) -> DecoderLayer``, ``.run(layer, hidden) -> hidden``,
  ``.linear_input(layer, hidden, slot) -> Tensor`` (slot: "qkv", "o", "gate_up",
  "down"), ``.rms_norm(x, weight)`` (the family's norm, e.g. for the final norm),
  ``.embed_scale(dtype) -> float | None``.
- ``activation_dtype(config) -> torch.dtype``: the checkpoint's dtype (the engine
  rounds Gemma's embedding scale to its activation dtype).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from exl3cli.engine.layers.attention import AttentionStep
from exl3cli.engine.layers.linear import DenseLinear
from exl3cli.engine.layers.norm import RMSNorm
from exl3cli.engine.layers.rope import RotaryEmbedding
from exl3cli.engine.models.causal_lm import DecoderLayer
from exl3cli.engine.models.loader import build_decoder_layer
from exl3cli.engine.spec.architecture import ArchitectureSpec, TensorNames
from exl3cli.engine.spec.config import ModelConfig

Dense = dict[str, tuple[torch.Tensor, torch.Tensor | None]]  # module -> ((in, out), bias)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def activation_dtype(config: ModelConfig) -> torch.dtype:
    """The checkpoint's dtype: what the model runs in (transformers, the engine on GPU)."""
    return _DTYPES.get(str(config.torch_dtype).removeprefix("torch."), torch.float32)


class _Stop(Exception):
    """Raised by the capture hook: the layer's remaining work is not needed."""


class EngineLayerForward:
    """Builds and runs engine decoder layers from plain weight tensors."""

    def __init__(self, config: ModelConfig, spec: ArchitectureSpec, names: TensorNames,
                 device: torch.device, row_chunk: int = 16):
        self.config, self.spec, self.names = config, spec, names
        self.device = device
        self.row_chunk = row_chunk
        self.layer_types = spec.layer_types(config)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling,
            config.max_position_embeddings, device, torch.float32,
        )
        self.local_rotary = None
        if config.sliding_rope_theta is not None:  # as CausalLM: only when configured
            self.local_rotary = RotaryEmbedding(
                config.head_dim, config.sliding_rope_theta,
                config.sliding_rope_scaling or {"rope_type": "default"},
                config.max_position_embeddings, device, torch.float32,
            )

    def embed_scale(self, dtype: torch.dtype) -> float | None:
        """sqrt(hidden_size) rounded to `dtype`, as CausalLM scales embeddings."""
        if not self.spec.embed_scale:
            return None
        return torch.tensor(self.config.hidden_size**0.5, dtype=dtype).item()

    def norm(self, weight: torch.Tensor) -> RMSNorm:
        return RMSNorm(weight, self.config.rms_norm_eps, unit_offset=self.spec.norm_unit_offset)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.norm(weight)(x)

    def build(self, i: int, dense: Dense, tensor: Callable[[str], torch.Tensor]) -> DecoderLayer:
        """Layer `i` with the linears in `dense` and the norms read through `tensor`,
        assembled by the engine loader's own `build_decoder_layer`."""

        def linear(prefixes: list[str], _shapes: list[tuple[int, int]],
                   _bias: bool) -> DenseLinear:
            parts = [dense[p] for p in prefixes]
            weight = torch.cat([w.T for w, _ in parts]).contiguous()
            bias = None
            if any(b is not None for _, b in parts):
                bias = torch.cat([b if b is not None else w.new_zeros(w.shape[1])
                                  for w, b in parts])
            return DenseLinear(weight, bias)

        return build_decoder_layer(self.config, self.spec, self.names, i,
                                   self.layer_types[i], tensor, linear).eval()

    def _step(self, rows: int, cols: int) -> AttentionStep:
        """What CausalLM._step gives a cache-less forward of [rows, cols] tokens."""
        positions = torch.arange(cols, device=self.device).expand(rows, cols)
        cos, sin = self.rotary.lookup(positions, cols)
        local_cos = local_sin = None
        if self.local_rotary is not None:
            local_cos, local_sin = (t.unsqueeze(2) for t in self.local_rotary.lookup(positions, cols))
        return AttentionStep(positions=positions, cos=cos.unsqueeze(2), sin=sin.unsqueeze(2),
                             span=cols, start=0, cache=None,
                             local_cos=local_cos, local_sin=local_sin)

    def run(self, layer: DecoderLayer, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's output for hidden [R, C, hidden_size]."""
        out = []
        for start in range(0, hidden.shape[0], self.row_chunk):
            x = hidden[start : start + self.row_chunk]
            out.append(layer(x, self._step(*x.shape[:2])))
        return torch.cat(out)

    def linear_input(self, layer: DecoderLayer, hidden: torch.Tensor, slot: str) -> torch.Tensor:
        """What the linear at `slot` ("qkv", "o", "gate_up", "down") receives."""
        owner = layer.attention if slot in ("qkv", "o") else layer.mlp
        module: nn.Module = getattr(owner, slot)  # a dense MLP's (MoE: moe_layer.py)
        seen: list[torch.Tensor] = []

        def capture(_module: nn.Module, args: tuple) -> None:
            seen.append(args[0])
            raise _Stop

        handle = module.register_forward_pre_hook(capture)
        try:
            for start in range(0, hidden.shape[0], self.row_chunk):
                x = hidden[start : start + self.row_chunk]
                try:
                    layer(x, self._step(*x.shape[:2]))
                except _Stop:
                    pass
        finally:
            handle.remove()
        if len(seen) != -(-hidden.shape[0] // self.row_chunk):
            raise RuntimeError(f"the {slot} projection was not reached in every row chunk")
        return torch.cat(seen)
