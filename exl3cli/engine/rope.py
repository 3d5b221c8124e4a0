"""Rotary position embeddings with the scaling variants of config.json `rope_scaling`.

Supported `rope_type`s: default, linear, dynamic (NTK-aware, computed for the length of
the current step), llama3. cos/sin tables are cached and indexed by position, so a
decode step costs one gather instead of recomputing frequencies.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from exl3cli.errors import UnsupportedArchitecture

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any], seq_len: int | None = None
) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32) after applying `scaling`."""
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedArchitecture(f"unsupported rope_type {rope_type!r}")
    factor = float(scaling.get("factor", 1.0))
    if rope_type == "dynamic":
        original = int(scaling.get("original_max_position_embeddings") or scaling["max_position"])
        if seq_len is not None and seq_len > original:
            theta = theta * ((factor * seq_len / original) - (factor - 1)) ** (
                head_dim / (head_dim - 2)
            )
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / factor
    elif rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by factor, blend in between."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding:
    """cos/sin lookup by position; tables grow on demand (host-side lengths, no sync)."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict[str, Any],
        max_position_embeddings: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = dict(scaling)
        self.scaling.setdefault("max_position", max_position_embeddings)
        self.device = device
        self.dtype = dtype
        self.dynamic = self.scaling.get("rope_type") == "dynamic"
        rope_inv_freq(head_dim, theta, self.scaling)  # validate the rope type early
        self._cos = torch.empty(0, head_dim, device=device, dtype=dtype)
        self._sin = torch.empty(0, head_dim, device=device, dtype=dtype)
        self._table_len = 0
        self._table_key: int | None = None
        self.version = 0  # bumped on every rebuild: captured graphs hold the old tables

    def _build(self, length: int, seq_len: int | None) -> None:
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, seq_len)
        positions = torch.arange(length, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        self._cos = angles.cos().to(device=self.device, dtype=self.dtype)
        self._sin = angles.sin().to(device=self.device, dtype=self.dtype)
        self._table_len = length
        self.version += 1

    def lookup(self, positions: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [*positions.shape, head_dim]; `span` > every position."""
        if self.dynamic:
            if self._table_key != span:  # frequencies depend on the current length
                self._build(span, span)
                self._table_key = span
        elif span > self._table_len:
            self._build(max(span, 2 * self._table_len, 256), None)
        return self._cos[positions], self._sin[positions]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + d/2) of the last dimension; cos/sin broadcast against x."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
