"""Rotary position embeddings with the scaling variants of config.json `rope_scaling`.

Supported `rope_type`s: default, linear, dynamic (NTK-aware, computed for the length of
the current step), llama3, yarn (Qwen2.5 / Qwen3 long-context configs, DeepSeek:
interpolated low frequencies, extrapolated high ones, a linear ramp between, and
cos/sin scaled by an attention factor) and longrope (Phi-3 / Phi-4: per-frequency
factors, the long set once the sequence passes original_max_position_embeddings).
cos/sin tables are cached and indexed by position, so a decode step costs one gather
instead of recomputing frequencies.

M-RoPE (Qwen2.5-VL, `lookup_sections`): each token has three positions (temporal,
height, width); the first `sections[0]` frequencies rotate by the first, the next
`sections[1]` by the second, and so on (in both halves of the head). With the same
position on all three it is plain rope.

`partial_rotary_factor` in the scaling dict (config.py puts it there when it is not 1):
only that fraction of head_dim rotates; the table's other frequencies are 0 (cos 1,
sin 0), and the loader orders q/k head dimensions so the rotated pairs come first in
each half (`rope_permutation`), which also maps GPT-J-style interleaved pairs (ERNIE
4.5, GLM) onto this module's (i, i + d/2) pairs.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from exl3cli.errors import UnsupportedArchitecture

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
# Types whose frequencies depend on the current sequence length (tables rebuilt).
LENGTH_DEPENDENT = ("dynamic", "longrope")


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
    if rope_type == "longrope":
        long = seq_len is not None and seq_len > _original_length(scaling)
        factors = scaling["long_factor" if long else "short_factor"]
        if len(factors) != head_dim // 2:
            raise UnsupportedArchitecture(f"longrope needs {head_dim // 2} factors, "
                                          f"config.json gives {len(factors)}")
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / factor
    elif rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    elif rope_type == "yarn":
        inv_freq = _yarn_scale(inv_freq, head_dim, theta, scaling)
    return inv_freq


def _original_length(scaling: dict[str, Any]) -> int:
    return int(scaling.get("original_max_position_embeddings") or scaling["max_position"])


def _context_factor(scaling: dict[str, Any]) -> float:
    """`factor`, or the context extension max_position / original when it is not given."""
    if scaling.get("factor") is not None:
        return float(scaling["factor"])
    return float(scaling["max_position"]) / _original_length(scaling)


def rope_attention_factor(scaling: dict[str, Any]) -> float:
    """What cos and sin are multiplied by: `attention_factor`, else yarn's
    0.1 ln(factor) + 1 (a ratio of two with DeepSeek's mscale / mscale_all_dim) or
    longrope's sqrt(1 + ln(factor) / ln(original length)); 1 for the other types."""
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _context_factor(scaling)
    if factor <= 1.0:
        return 1.0
    if rope_type == "longrope":
        return math.sqrt(1 + math.log(factor) / math.log(_original_length(scaling)))

    def mscale(scale: float) -> float:
        return 0.1 * scale * math.log(factor) + 1.0

    top, bottom = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if top and bottom:
        return mscale(float(top)) / mscale(float(bottom))
    return mscale(1.0)


def _yarn_scale(inv_freq: torch.Tensor, head_dim: int, theta: float,
                scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: frequencies turning fewer than beta_slow times over the original context
    are divided by factor, those turning more than beta_fast times kept, a linear
    ramp over the dimensions between."""
    factor = _context_factor(scaling)
    original = _original_length(scaling)
    fast = float(scaling.get("beta_fast") or 32)
    slow = float(scaling.get("beta_slow") or 1)

    def dimension(rotations: float) -> float:  # where a frequency turns `rotations` times
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(fast), dimension(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


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


def rotary_dim(head_dim: int, scaling: dict[str, Any]) -> int:
    """How many dimensions of a head rotate (all but with partial_rotary_factor)."""
    dim = int(head_dim * float(scaling.get("partial_rotary_factor", 1.0)))
    if dim % 2 or not 0 < dim <= head_dim:
        raise UnsupportedArchitecture(f"rotary dimension {dim} of head_dim {head_dim}")
    return dim


def rope_permutation(head_dim: int, rotary: int, interleaved: bool) -> torch.Tensor:
    """Source index of each dimension of a head in the engine's layout: rotated pair j
    (frequency j) at (j, head_dim/2 + j), then the dimensions that do not rotate.
    Checkpoint pairs are (j, rotary/2 + j) (Llama style) or (2j, 2j + 1) (interleaved)."""
    half = rotary // 2
    j = torch.arange(half)
    first, second = (2 * j, 2 * j + 1) if interleaved else (j, half + j)
    passing = torch.arange(rotary, head_dim)
    keep = passing[: len(passing) // 2], passing[len(passing) // 2 :]
    return torch.cat([first, keep[0], second, keep[1]])


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
        self.dynamic = self.scaling.get("rope_type") in LENGTH_DEPENDENT
        rope_inv_freq(head_dim, theta, self.scaling)  # validate the rope type early
        self.attention_factor = rope_attention_factor(self.scaling)
        self._cos = torch.empty(0, head_dim, device=device, dtype=dtype)
        self._sin = torch.empty(0, head_dim, device=device, dtype=dtype)
        self._table_len = 0
        self._table_key: int | None = None
        self.version = 0  # bumped on every rebuild: captured graphs hold the old tables

    def _build(self, length: int, seq_len: int | None) -> None:
        rotary = rotary_dim(self.head_dim, self.scaling)
        inv_freq = rope_inv_freq(rotary, self.theta, self.scaling, seq_len)
        inv_freq = torch.nn.functional.pad(inv_freq, (0, (self.head_dim - rotary) // 2))
        positions = torch.arange(length, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        self._cos = cos.to(device=self.device, dtype=self.dtype)
        self._sin = sin.to(device=self.device, dtype=self.dtype)
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

    def lookup_sections(self, positions: torch.Tensor, span: int, sections: list[int]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """M-RoPE: cos, sin [*positions.shape[1:], head_dim] for positions [3, ...],
        frequency section i following positions[i % 3]."""
        if 2 * sum(sections) != self.head_dim:
            raise UnsupportedArchitecture(f"M-RoPE sections {sections} do not cover "
                                          f"head_dim {self.head_dim}")
        cos, sin = self.lookup(positions, span)  # [3, ..., head_dim]
        axis = torch.cat([torch.full((size,), i % 3, dtype=torch.long)
                          for i, size in enumerate(sections * 2)]).to(cos.device)
        index = axis.expand(1, *cos.shape[1:])
        return cos.gather(0, index)[0], sin.gather(0, index)[0]
