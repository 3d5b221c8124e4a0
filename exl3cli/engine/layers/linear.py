"""Linear layers behind one interface: dense, EXL3 trellis-quantized, fused.

Every layer maps ``x[..., in_features] -> y[..., out_features]`` through ``forward``.

- ``DenseLinear(weight[out, in], bias=None, cpu_weights=None)``: a plain matrix (HF
  orientation). With ``cpu_weights`` ("fp32", "bf16", "int8"; CPU, float32
  activations) the matrix is held packed for the CPU GEMV kernel instead
  (``cpu_kernels.pack_gemv_weight``): up to ``GEMV_MAX_ROWS`` rows (decode) run on the
  kernel, longer inputs (prompts) on a torch matmul of the unpacked matrix (float32 for
  "fp32", bfloat16 otherwise). ``pack_for_cpu(layer, cpu_weights)`` converts any layer
  that can give a dense weight.
- ``Exl3Linear(tensors, in_features, out_features, device=None, dtype=float32,
  mode=None)``: one EXL3 module (``tensors`` by suffix: trellis, suh/svh or legacy
  su/sv, marker, bias). Mode ``"dense"`` (default on CPU) dequantizes once at load into
  ``dtype``; mode ``"trellis"`` (default on CUDA) keeps the packed trellis and decodes
  in ``forward``: on CUDA through the fused kernels of ``exl3cli.ops.cuda_kernels`` when they
  are available, else (and on CPU) the pure-torch reference path.
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

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from exl3cli.codec import block_hadamard, codebook_from_tensors, decode_tiles, k_bits_from_words
from exl3cli.codec.dequant import dequantize_linear, unpack_sign_bits
from exl3cli.codec.format import read_exl3_linear
from exl3cli.errors import ModelLoadError
from exl3cli.ops import cpu_kernels
from exl3cli.ops import cuda_kernels as kernels
from exl3cli.ops.batch_invariant import batch_invariant, padded_linear

log = logging.getLogger(__name__)


class Linear(nn.Module):
    """Base: ``in_features``, ``out_features``, ``forward(x)``; ``dense_weight()`` gives
    the (out, in) matrix and bias when the layer holds one, else None."""

    in_features: int
    out_features: int

    def dense_weight(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        return None


CPU_WEIGHT_MODES = ("fp32", "bf16", "int8")
GEMV_MAX_ROWS = 8  # up to this many rows the GEMV kernel beats a matmul (bench/NOTES.md)


class DenseLinear(Linear):
    """``y = x @ weight.T + bias`` with ``weight`` in Hugging Face orientation (out, in);
    with ``cpu_weights`` the weight is held packed for the CPU kernel (module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 cpu_weights: str | None = None):
        super().__init__()
        if weight.dim() != 2:
            raise ModelLoadError(f"linear weight must be 2-D, got {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.cpu_weights = cpu_weights
        if cpu_weights is None:
            self.register_buffer("weight", weight, persistent=False)
            self.register_buffer("bias", bias, persistent=False)
            return
        if cpu_weights not in CPU_WEIGHT_MODES:
            raise ValueError(f"cpu_weights must be one of {CPU_WEIGHT_MODES}, got {cpu_weights!r}")
        if weight.device.type != "cpu":
            raise ValueError("cpu_weights packs CPU weights only")
        self.weight = None
        packed, scale = cpu_kernels.pack_gemv_weight(weight, cpu_weights)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.float(), persistent=False)
        self._kernel = cpu_kernels.available()  # checked once: forward runs per token

    def gemv_weights(self) -> cpu_kernels.GemvWeights | None:
        """The packed weights for the C++ GEMV (fused decode layers call it directly),
        or None when this layer is not packed or the CPU kernels are unavailable."""
        if self.cpu_weights is None or not self._kernel:
            return None
        return cpu_kernels.GemvWeights(self.packed, self.scale, self.bias, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_weights is None:
            return dense_product(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features)
        # Batch-invariant mode: the GEMV at every row count (a matmul's blocking follows it).
        if (rows.shape[0] <= GEMV_MAX_ROWS or batch_invariant()) and x.dtype == torch.float32:
            gemv = cpu_kernels.gemv_cpu if self._kernel else cpu_kernels.gemv_reference
            y = gemv(rows, self.packed, self.scale, self.bias, self.out_features)
        else:
            y = self._matmul(rows).to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        # Prompts are compute-bound: one large matmul in the mode's compute precision
        # (bfloat16 for the low-precision modes, as transformers' bf16 does).
        compute = torch.float32 if self.cpu_weights == "fp32" else torch.bfloat16
        w_t = cpu_kernels.unpack_gemv_weight(self.packed, self.scale, transposed=True)
        y = (rows.to(compute) @ w_t.to(compute))[:, : self.out_features].float()
        return y + self.bias if self.bias is not None else y

    def dense_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.cpu_weights is None:
            return self.weight, self.bias
        w_t = cpu_kernels.unpack_gemv_weight(self.packed, self.scale, transposed=True)
        return w_t[:, : self.out_features].t().float(), self.bias


def pack_for_cpu(layer: Linear, cpu_weights: str) -> Linear:
    """``layer`` as a packed DenseLinear for the CPU kernel when it can give a dense
    weight (dense or dequantized EXL3), else unchanged."""
    if isinstance(layer, DenseLinear) and layer.cpu_weights == cpu_weights:
        return layer
    dense = layer.dense_weight()
    if dense is None:
        return layer
    return DenseLinear(dense[0], dense[1], cpu_weights=cpu_weights)


def _by_suffix(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name.rsplit(".", 1)[-1]: value for name, value in tensors.items()}


def _trim_bias(bias: torch.Tensor | None, out_features: int) -> torch.Tensor | None:
    if bias is None:
        return None
    bias = bias.reshape(-1)
    if bias.numel() < out_features:
        raise ModelLoadError(f".bias has {bias.numel()} entries, layer has {out_features}")
    return bias[:out_features]  # writers may store the padded length


def dense_product(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear``; in the batch-invariant mode on fixed 64-row blocks (one cuBLAS or
    CPU matmul shape for every row count: ops/batch_invariant.py)."""
    if batch_invariant():
        return padded_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def float_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in float32 for a float16/bfloat16 `weight` on CUDA, written by
    cuBLAS from its float32 accumulators (``torch.mm(..., out_dtype=torch.float32)``)
    instead of rounded to the half type first: a model's logits keep the precision its
    head computed them in (a float16 logit near 20 is a multiple of 1/64, as wide as
    the near ties that decide greedy text). Elsewhere, and in the batch-invariant mode,
    ``dense_product(...).float()``."""
    global _FLOAT_OUT
    if (_FLOAT_OUT and x.is_cuda and weight.dtype in (torch.float16, torch.bfloat16)
            and x.dtype == weight.dtype and not batch_invariant()):
        rows = x.reshape(-1, x.shape[-1])
        try:
            out = torch.mm(rows, weight.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError) as error:  # a torch without it: round as before
            log.warning("float32 logits from a half head are not available (%s)", error)
            _FLOAT_OUT = False
        else:
            return out.view(*x.shape[:-1], weight.shape[0])
    return dense_product(x, weight, None).float()


_FLOAT_OUT = True  # False once torch.mm refused out_dtype (float_product)


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
        self.k = k_bits_from_words(trellis.shape[2])
        if device.type == "cuda":
            # The kernels read float32 padded vectors: made once here, not per call.
            self.register_buffer("suh32", self.suh.float().contiguous(), persistent=False)
            self.register_buffer("svh32", self.svh.float().contiguous(), persistent=False)
            self.register_buffer("bias32", None if self.bias is None else
                                 self.bias.float().contiguous(), persistent=False)

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
            return dense_product(x, self.weight, self.bias)
        return self._forward_trellis(x)

    def uses_kernels(self, x: torch.Tensor) -> bool:
        """Whether ``forward(x)`` runs the fused CUDA kernels."""
        return (self.mode == "trellis" and x.is_cuda and hasattr(self, "suh32")
                and kernels.available())

    def forward_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``forward(x)`` written into ``out`` (..., out_features), which may be a
        column slice of a wider buffer (FusedLinear writes its parts side by side)."""
        if self.uses_kernels(x):
            return kernels.exl3_gemm(x, self.trellis, self.suh32, self.svh32, self.k,
                                     self.codebook, bias=self.bias32, out=out,
                                     out_features=self.out_features)
        return out.copy_(self.forward(x))

    def _forward_trellis(self, x: torch.Tensor) -> torch.Tensor:
        """y = H(H(x * suh) @ Ŵ) * svh: fused kernels on CUDA, else the reference path
        with Ŵ decoded now (never W)."""
        if self.uses_kernels(x):
            return kernels.exl3_gemm(x, self.trellis, self.suh32, self.svh32, self.k,
                                     self.codebook, bias=self.bias32,
                                     out_features=self.out_features)
        # float32 throughout: xh @ Ŵ is svh-times larger than y and overflows float16.
        xs = F.pad(x.float(), (0, self.padded_in - self.in_features)) * self.suh.float()
        xh = block_hadamard(xs, dim=-1)
        rotated = decode_tiles(self.trellis, codebook=self.codebook).float()
        y = block_hadamard(xh @ rotated, dim=-1) * self.svh.float()
        y = y[..., : self.out_features].to(x.dtype)
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
        if x.is_cuda and all(isinstance(p, Exl3Linear) and p.uses_kernels(x)
                             for p in self.parts):
            # Each kernel writes its column slice: no concatenation pass.
            out = x.new_empty(*x.shape[:-1], self.out_features)
            start = 0
            for part in self.parts:
                part.forward_into(x, out[..., start : start + part.out_features])
                start += part.out_features
            return out
        return torch.cat([part(x) for part in self.parts], dim=-1)


class PermutedLinear(Linear):
    """``inner`` with its outputs reordered: ``y[..., k] = inner(x)[..., order[k]]``."""

    def __init__(self, inner: Linear, order: torch.Tensor):
        super().__init__()
        if sorted(order.tolist()) != list(range(inner.out_features)):
            raise ValueError("order must be a permutation of the outputs")
        self.inner = inner
        self.in_features, self.out_features = inner.in_features, inner.out_features
        self.register_buffer("order", order.long(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).index_select(-1, self.order.to(x.device))

    def dense_weight(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        dense = self.inner.dense_weight()
        if dense is None:
            return None
        weight, bias = dense
        return weight[self.order], None if bias is None else bias[self.order]


def permute_outputs(layer: Linear, order: torch.Tensor) -> Linear:
    """``layer`` with outputs in ``order``: folded into a dense weight when the layer
    has one (no cost per token), else a ``PermutedLinear`` gather."""
    dense = layer.dense_weight()
    if dense is None:
        return PermutedLinear(layer, order)
    weight, bias = dense
    order = order.to(weight.device)
    return DenseLinear(weight[order].contiguous(), None if bias is None else bias[order],
                       cpu_weights=getattr(layer, "cpu_weights", None))


class ScaledLinear(Linear):
    """``inner`` with every output multiplied by ``factor`` (Cohere's logit scale)."""

    def __init__(self, inner: Linear, factor: float):
        super().__init__()
        self.inner, self.factor = inner, factor
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.factor

    def dense_weight(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        dense = self.inner.dense_weight()
        if dense is None:
            return None
        weight, bias = dense
        return weight * self.factor, None if bias is None else bias * self.factor


def scale_outputs(layer: Linear | torch.Tensor, factor: float,
                  cpu_weights: str | None = None) -> Linear:
    """``layer`` (or a plain (out, in) matrix) with outputs times ``factor``: a scaled
    dense copy when it has a weight, else a ``ScaledLinear``."""
    if isinstance(layer, torch.Tensor):
        return DenseLinear(layer * factor, cpu_weights=cpu_weights)
    dense = layer.dense_weight()
    if dense is None:
        return ScaledLinear(layer, factor)
    weight, bias = dense
    return DenseLinear(weight * factor, None if bias is None else bias * factor,
                       cpu_weights=getattr(layer, "cpu_weights", None))


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
