"""Decoder-layer variants that are not the pre-norm sequence of engine/models/causal_lm.py.

- ``ParallelDecoderLayer`` (Cohere, Command-R/A): attention and MLP both read the
  same normed input and are added to the residual together:
  x + attn(norm(x)) + mlp(norm(x)).
"""

from __future__ import annotations

import torch
from torch import nn

from exl3cli.engine.layers.attention import Attention, AttentionStep
from exl3cli.engine.models.causal_lm import DecoderLayer


class ParallelDecoderLayer(DecoderLayer):
    """One norm, attention and MLP side by side (see the module docstring)."""

    def __init__(self, input_norm: nn.Module, attention: Attention, mlp: nn.Module):
        super().__init__(input_norm, attention, nn.Identity(), mlp)  # type: ignore[arg-type]
        self._plan = None  # never the fused pre-norm decode path

    def forward(self, x: torch.Tensor, step: AttentionStep) -> torch.Tensor:
        normed = self.input_norm(x)
        return x + self.attention(normed, step) + self.mlp(normed)
