"""Linear layers behind one interface: dense, EXL3 trellis-quantized, fused.

Every layer maps ``x[..., in_features] -> y[..., out_features]`` through ``forward``.

- ``DenseLinear(weight[out, in], bias=None)``: a plain matrix (HF orientation).
- ``Exl3Linear(tensors, in_features, out_features, device=None, dtype=float32,
  mode=None)``: one EXL3 module (``tensors`` by suffix: trellis, suh/svh or legacy
  su/sv, marker, bias). Mode ``"dense"`` (default on CPU) dequantizes once at load into
  ``dtype``; mode ``"trellis"`` (default on CUDA) keeps the packed trellis and decodes
  in ``forward`` (the pure-torch reference path; fused GPU kernels replace
  ``_forward_trellis`` later without changing callers).
- ``FusedLinear(parts)``: several layers on the same input with their outputs
  concatenated (q/k/v, gate/up). ``fuse_linears(parts)`` returns one ``DenseLinear``
  with concatenated weights when every part can give a dense weight, else a
  ``FusedLinear``.
- ``load_linear(reader, prefix, in_features, out_features, device, dtype, mode=None,
  require_bias=False) -> Linear``: reads module ``prefix`` however it is stored
  (``.trellis`` -> ``Exl3Linear``, ``.weight`` -> ``DenseLinear``; ``.bias`` when
  present; padded stored shapes trimmed to the logical ones).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from exl3cli.engine.quant import block_hadamard, codebook_from_tensors, decode_tiles
from exl3cli.engine.quant.dequant import dequantize_linear, unpack_sign_bits
from exl3cli.engine.quant.format import read_exl3_linear
from exl3cli.errors import ModelLoadError


class Linear(nn.Module):
    """Base: ``in_features``, ``out_features``, ``forward(x)``; ``dense_weight()`` gives
    the (out, in) matrix and bias when the layer holds one, else None."""

    in_features: int
    out_features: int

    def dense_weight(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        return None


class DenseLinear(Linear):
    """``y = x @ weight.T + bias`` with ``weight`` in Hugging Face orientation (out, in)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight.dim() != 2:
            raise ModelLoadError(f"linear weight must be 2-D, got {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def dense_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.weight, self.bias


def _by_suffix(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name.rsplit(".", 1)[-1]: value for name, value in tensors.items()}


def _trim_bias(bias: torch.Tensor | None, out_features: int) -> torch.Tensor | None:
    if bias is None:
        return None
    bias = bias.reshape(-1)
    if bias.numel() < out_features:
        raise ModelLoadError(f".bias has {bias.numel()} entries, layer has {out_features}")
    return bias[:out_features]  # writers may store the padded length


class Exl3Linear(Linear):
    """One trellis-quantized linear; see the module docstring for the two modes."""

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        in_features: int,
        out_features: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        mode: str | None = None,
    ):
        super().__init__()
        device = torch.device(device or "cpu")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.mode = mode or ("trellis" if device.type == "cuda" else "dense")
        if self.mode not in ("dense", "trellis"):
            raise ValueError(f"unknown Exl3Linear mode {self.mode!r}")
        found = _by_suffix(tensors)
        bias = _trim_bias(found.get("bias"), self.out_features)
        self.register_buffer(
            "bias", None if bias is None else bias.to(device, dtype), persistent=False
        )
        if self.mode == "dense":
            # (in, out) float32 -> HF orientation in the compute dtype; trellis dropped.
            weight = dequantize_linear(found, self.in_features, self.out_features)
            self.register_buffer("weight", weight.t().to(device, dtype).contiguous(),
                                 persistent=False)
            return
        self._setup_trellis(found, device, dtype)

    def _setup_trellis(self, found: dict[str, torch.Tensor], device: torch.device,
                       dtype: torch.dtype) -> None:
        # dequantize_linear validates everything; do it on a cheap view first would
        # decode the whole layer, so check the shapes here instead.
        trellis = found.get("trellis")
        if trellis is None or trellis.dim() != 3 or trellis.dtype != torch.int16:
            raise ModelLoadError("EXL3 linear needs an int16 (in/16, out/16, words) .trellis")
        self.codebook = codebook_from_tensors(found)
        self.padded_in, self.padded_out = 16 * trellis.shape[0], 16 * trellis.shape[1]
        if self.in_features > self.padded_in or self.out_features > self.padded_out:
            raise ModelLoadError(f"logical shape {self.in_features}x{self.out_features} "
                                 f"exceeds stored {self.padded_in}x{self.padded_out}")
        self.register_buffer("trellis", trellis.to(device), persistent=False)
        self.register_buffer("suh", self._scale(found, "suh", "su", self.padded_in)
                             .to(device, dtype), persistent=False)
        self.register_buffer("svh", self._scale(found, "svh", "sv", self.padded_out)
                             .to(device, dtype), persistent=False)

    @staticmethod
    def _scale(found: dict[str, torch.Tensor], name: str, legacy: str, size: int) -> torch.Tensor:
        if name in found:
            scale = found[name].reshape(-1).float()
        elif legacy in found:
            scale = unpack_sign_bits(found[legacy], min(size, 16 * found[legacy].numel()))
        else:
            raise ModelLoadError(f"EXL3 linear has neither .{name} nor .{legacy}")
        return F.pad(scale, (0, size - scale.numel()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "dense":
            return F.linear(x, self.weight, self.bias)
        return self._forward_trellis(x)

    def _forward_trellis(self, x: torch.Tensor) -> torch.Tensor:
        """Reference path: y = H(H(x * suh) @ Ŵ) * svh, Ŵ decoded now (never W)."""
        xs = F.pad(x, (0, self.padded_in - self.in_features)) * self.suh
        xh = block_hadamard(xs, dim=-1)
        rotated = decode_tiles(self.trellis, codebook=self.codebook).to(x.dtype)
        y = block_hadamard(xh @ rotated, dim=-1) * self.svh
        y = y[..., : self.out_features]
        return y + self.bias if self.bias is not None else y

    def dense_weight(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        return (self.weight, self.bias) if self.mode == "dense" else None


class FusedLinear(Linear):
    """Several layers applied to one input, outputs concatenated in order."""

    def __init__(self, parts: list[Linear]):
        super().__init__()
        if not parts:
            raise ValueError("FusedLinear needs at least one part")
        in_features = {p.in_features for p in parts}
        if len(in_features) != 1:
            raise ModelLoadError(f"fused parts disagree on in_features: {sorted(in_features)}")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def fuse_linears(parts: list[Linear]) -> Linear:
    """One layer for ``parts`` on a shared input: a single dense matmul when possible."""
    if len(parts) == 1:
        return parts[0]
    dense = [p.dense_weight() for p in parts]
    if any(d is None for d in dense):
        return FusedLinear(parts)
    weight = torch.cat([w for w, _ in dense])
    bias = None
    if any(b is not None for _, b in dense):
        bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in dense])
    return DenseLinear(weight, bias)


def load_linear(
    reader: Any,
    prefix: str,
    in_features: int,
    out_features: int,
    device: torch.device | str,
    dtype: torch.dtype,
    mode: str | None = None,
    require_bias: bool = False,
) -> Linear:
    """Module ``prefix`` of a checkpoint as a Linear, whichever way it is stored."""
    quantized = read_exl3_linear(reader, prefix)
    if quantized is not None:
        if require_bias and "bias" not in quantized:
            raise ModelLoadError(f"tensor {prefix + '.bias'!r} not found")
        return Exl3Linear(quantized, in_features, out_features, device, dtype, mode)
    weight = reader.get(f"{prefix}.weight")
    rows, cols = weight.shape
    if rows < out_features or cols < in_features:
        raise ModelLoadError(f"{prefix}.weight is {rows}x{cols}, "
                             f"expected {out_features}x{in_features}")
    weight = weight[:out_features, :in_features].to(device, dtype).contiguous()
    bias = None
    if require_bias or reader.has(f"{prefix}.bias"):
        bias = _trim_bias(reader.get(f"{prefix}.bias"), out_features).to(device, dtype)
    return DenseLinear(weight, bias)
