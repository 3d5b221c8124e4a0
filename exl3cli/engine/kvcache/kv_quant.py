"""Quantized key/value cache storage (EXL3-FORMAT.md section 6).

One cached token row (`kv_heads * head_dim` channels) is cut into groups of 32
channels. Each group is rotated by a 32-point Hadamard (divided by sqrt 32), which
spreads outliers over the group; the group absmax becomes its float16 scale, and every
channel becomes a b-bit integer code around the midpoint:

    code = clamp(round(x / s * 2^(b-1) + 2^(b-1) - 0.5), 0, 2^b - 1)
    x'   = (code - 2^(b-1) + 0.5) * s / 2^(b-1)

then x' is rotated back (the normalised Hadamard is its own inverse). Keys and values
choose their bit widths independently.

Stored codes are bit-packed (`pack_codes`): each run of 8 channels becomes `b` bytes,
byte j holding bit j of the 8 codes (bit-planes), so a b-bit cache costs b/8 bytes per
channel plus the scales. Bit-planes unpack with a few whole-tensor shifts for any b,
where contiguous b-bit fields would straddle bytes for b = 3, 5, 6, 7.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from exl3cli.errors import InvalidOption

GROUP_SIZE = 32
MIN_BITS, MAX_BITS = 2, 8
UNQUANTIZED_NAMES = ("fp16", "f16", "bf16", "fp32", "f32", "none", "")
ENV_VAR = "EXL3_KV_CACHE_TYPE"


@dataclass(frozen=True)
class KVCacheType:
    """Bits for keys and values; None for both means the model's own dtype."""

    key_bits: int | None = None
    value_bits: int | None = None

    @property
    def quantized(self) -> bool:
        return self.key_bits is not None

    @property
    def name(self) -> str:
        if not self.quantized:
            return "fp16"
        if self.key_bits == self.value_bits:
            return f"q{self.key_bits}"
        return f"k{self.key_bits}v{self.value_bits}"

    def bytes_per_token(self, channels: int, element_size: int) -> float:
        """Storage per token and layer for keys + values of `channels` channels each."""
        if not self.quantized:
            return 2.0 * channels * element_size
        scales = 2 * (channels // GROUP_SIZE) * 2  # one float16 per group, K and V
        codes = packed_width(channels, self.key_bits) + packed_width(channels, self.value_bits)
        return float(codes + scales)


_PATTERN = re.compile(r"^(?:q(\d)|k(\d)v(\d)|q(\d)_0)$")


def parse_kv_cache_type(text: str | None) -> KVCacheType:
    """"q8", "q6", "q4", "k8v4", "q8_0" (Ollama's spelling), "fp16"... -> KVCacheType.

    InvalidOption for anything else or for bits outside 2..8.
    """
    value = (text or "").strip().lower()
    if value in UNQUANTIZED_NAMES:
        return KVCacheType()
    match = _PATTERN.match(value)
    if match is None:
        raise InvalidOption(
            f"invalid kv_cache_type {text!r} (use fp16, q8, q6, q4, or kXvY such as k8v4)"
        )
    same = match.group(1) or match.group(4)
    key_bits = int(same or match.group(2))
    value_bits = int(same or match.group(3))
    for bits in (key_bits, value_bits):
        if not MIN_BITS <= bits <= MAX_BITS:
            raise InvalidOption(f"kv_cache_type {text!r}: bits must be {MIN_BITS}..{MAX_BITS}")
    return KVCacheType(key_bits, value_bits)


def resolve_kv_cache_type(value: str | KVCacheType | None) -> KVCacheType:
    """An explicit value, else the EXL3_KV_CACHE_TYPE environment variable, else fp16."""
    if isinstance(value, KVCacheType):
        return value
    if value is None or value == "":
        value = os.environ.get(ENV_VAR, "")
    return parse_kv_cache_type(value)


_HADAMARD: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def hadamard_matrix(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
                    ) -> torch.Tensor:
    """The Sylvester 32x32 Hadamard matrix divided by sqrt(32): symmetric, orthogonal."""
    key = (torch.device(device), dtype)
    if key not in _HADAMARD:
        matrix = torch.ones(1, 1, dtype=torch.float64)
        while matrix.shape[0] < GROUP_SIZE:
            matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
        _HADAMARD[key] = (matrix / GROUP_SIZE**0.5).to(device=device, dtype=dtype)
    return _HADAMARD[key]


def _grouped(x: torch.Tensor) -> torch.Tensor:
    channels = x.shape[-1]
    if channels % GROUP_SIZE:
        raise InvalidOption(
            f"a quantized KV cache needs kv_heads * head_dim divisible by {GROUP_SIZE}, "
            f"got {channels}"
        )
    return x.reshape(*x.shape[:-1], channels // GROUP_SIZE, GROUP_SIZE)


def quantize_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [..., C] -> (codes uint8 [..., C], scales float16 [..., C / 32])."""
    groups = _grouped(x.float())
    rotated = groups @ hadamard_matrix(x.device)
    absmax = rotated.abs().amax(dim=-1).clamp_max(torch.finfo(torch.float16).max)
    scales = absmax.to(torch.float16)
    # Round the scale up, never down, so no value falls outside the code range.
    scales = torch.where(scales.float() < absmax,
                         torch.nextafter(scales, torch.full_like(scales, float("inf"))), scales)
    half = float(1 << (bits - 1))
    # Divide by the stored (float16) scale so dequantization sees the same number.
    safe = scales.float().clamp_min(torch.finfo(torch.float16).tiny).unsqueeze(-1)
    codes = torch.round(rotated / safe * half + (half - 0.5)).clamp_(0, (1 << bits) - 1)
    return codes.to(torch.uint8).reshape(x.shape), scales


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, bits: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_rows: codes uint8 [..., C], scales [..., C / 32] -> [..., C]."""
    half = float(1 << (bits - 1))
    groups = _grouped(codes).float()
    rotated = (groups - (half - 0.5)) * (scales.float().unsqueeze(-1) / half)
    return (rotated @ hadamard_matrix(codes.device)).reshape(codes.shape).to(dtype)


PLANE_WIDTH = 8  # channels per bit-plane byte


def packed_width(channels: int, bits: int) -> int:
    """Bytes that `pack_codes` stores for one row of `channels` b-bit codes."""
    return channels // PLANE_WIDTH * bits


# Eight bytes of 0/1 (lane l in byte l) times this lands lane l in bit 56 + l, with no
# carries between the partial products: the top byte is the packed plane.
_GATHER_LANES = 0x0102040810204080
_LOW_BITS = 0x0101010101010101
_SPREAD: dict[torch.device, torch.Tensor] = {}


def _spread_table(device: torch.device) -> torch.Tensor:
    """Byte value -> int64 whose byte l is bit l of it (the plane's lanes, spread out)."""
    if device not in _SPREAD:
        values = torch.arange(256, dtype=torch.int64)
        lanes = torch.arange(PLANE_WIDTH, dtype=torch.int64)
        _SPREAD[device] = (((values[:, None] >> lanes) & 1) << (8 * lanes)).sum(-1).to(device)
    return _SPREAD[device]


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., C] (values < 2^bits) -> bit-planes uint8 [..., C / 8 * bits]."""
    if bits == 8:
        return codes
    # Eight codes as one int64 (byte l = lane l; little-endian, as on every torch target).
    lanes = codes.contiguous().view(torch.int64)  # [..., C/8]
    planes = [(((lanes >> j) & _LOW_BITS) * _GATHER_LANES) >> 56 for j in range(bits)]
    return (torch.stack(planes, dim=-1) & 0xFF).to(torch.uint8).reshape(*codes.shape[:-1], -1)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_codes: bit-planes uint8 [..., C / 8 * bits] -> codes uint8 [..., C]."""
    if bits == 8:
        return packed
    planes = packed.reshape(-1).long()  # [N * C/8 * b], plane j of lane group g at g*b + j
    spread = _spread_table(packed.device).index_select(0, planes).view(-1, bits)
    lanes = spread[:, 0].clone()
    for j in range(1, bits):
        lanes |= spread[:, j] << j
    # Byte l of each int64 is lane l (little-endian): [N * C/8] -> codes [..., C].
    return lanes.view(torch.uint8).view(*packed.shape[:-1], -1)
