"""EXL3 CPU kernels (``csrc/ops/cpu/*.cpp``), compiled on first use, with a pure-PyTorch
fallback.

The extension is built with ``torch.utils.cpp_extension.load`` (JIT, ninja) with
``-O3 -march=native`` and ``-fopenmp`` (``openmp_flags``: the kernels' ``at::parallel_for``
splits across ``torch.get_num_threads()`` threads only then); a ``-march=native`` binary only runs on CPUs like the one that
built it, so the cache folder is keyed by the sources, torch and the CPU's model and
feature flags. When no compiler or ninja is present, or ``EXL3_NO_EXT=1`` is set,
callers use the PyTorch reference instead (one line on stderr says why, once).

Public API:
- ``available() -> bool`` / ``unavailable_reason() -> str | None``
- ``openmp_flags()`` (ops/build.py, re-exported): the OpenMP compile flag.
- ``parallel_threads() -> int``: how many threads the kernels' ``at::parallel_for``
  split a loop across now (1 when the build has no OpenMP).
- ``simd_level() -> str``: which inner loop was compiled ("avx512", "avx2", "scalar").
- ``viterbi_states_cpu(targets[N, 256], k_bits, codebook="mul1") -> states[int64, (N, 256)]``:
  the same states as ``exl3cli.ops.viterbi.viterbi_states_reference``.
- ``pack_gemv_weight(weight[out, in], mode) -> (packed, scale | None)`` (mode "fp32",
  "bf16", "int8"), ``unpack_gemv_weight(packed, scale=None, transposed=False)``,
  ``gemv_cpu(x[M, K], packed, scale, bias, n) -> y[M, n]`` (float32; the decode matmul of
  ``engine/layers/linear.py``, ``csrc/ops/cpu/gemv_cpu.cpp``) and its twin ``gemv_reference``.
Environment: ``EXL3_NO_EXT=1`` forces the fallback; ``EXL3_KERNEL_CACHE`` sets the build
cache folder (default ``~/.cache/exl3/kernels``); ``EXL3_EXT_VERBOSE=1`` shows the build.
"""

from __future__ import annotations

import os
import platform
import shutil
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch

from exl3cli.ops import reference
from exl3cli.ops.build import CSRC, LazyExtension, build_extension, openmp_flags

CSRC_CPU = CSRC / "ops" / "cpu"
_FLAGS = ["-O3", "-march=native"]


def _cpu_fingerprint() -> str:
    """CPU model and feature flags: what a ``-march=native`` binary depends on."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()}|{platform.processor()}"
    wanted = [line for line in text.splitlines()
              if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "|".join(sorted(set(wanted)))


def _why_not() -> str | None:
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler"
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401
        except ImportError:
            return "ninja not found"
    if not any(CSRC_CPU.glob("*.cpp")):
        return f"no sources in {CSRC_CPU}"
    return None


def _build() -> ModuleType:
    # No fast-math: the search must round exactly like the PyTorch reference.
    return build_extension("exl3_cpu", sorted(CSRC_CPU.glob("*.cpp")),
                           f"{torch.__version__}|{_cpu_fingerprint()}",
                           hashed=sorted(CSRC_CPU.glob("*.h")),
                           cflags=[*_FLAGS, *openmp_flags()])


_EXTENSION = LazyExtension("CPU kernels", _why_not, _build, announce=lambda _reason: True)


def _extension() -> ModuleType | None:
    return _EXTENSION.get()


def available() -> bool:
    """Whether the compiled CPU kernels can be used (builds them on first call).

    ``EXL3_NO_EXT`` is read on every call, so setting it later still takes effect."""
    return _EXTENSION.available()


def unavailable_reason() -> str | None:
    """Why the kernels are not in use, or None when they are."""
    return _EXTENSION.unavailable_reason()


def parallel_threads(items: int = 64) -> int:
    """Threads one ``at::parallel_for`` of ``items`` items in these kernels runs on."""
    return int(_ops().exl3_parallel_threads(int(items)))


def simd_level() -> str:
    """The node-cost loop the extension was compiled with ("avx512", "avx2", "scalar")."""
    ext = _extension()
    if ext is None:
        raise RuntimeError(f"CPU kernels unavailable: {unavailable_reason()}")
    return ext.simd_level()


def viterbi_states_cpu(
    targets: torch.Tensor, k_bits: float, codebook: str = "mul1"
) -> torch.Tensor:
    """Best tail-biting states (N, 256) int64 for targets (N, 256) in step order, on
    the CPU kernel; raises RuntimeError when it is unavailable."""
    from exl3cli.codec.bitstream import STEPS, bits_per_step
    from exl3cli.codec.codebooks import codebook_lut_float32

    ext = _extension() if available() else None
    if ext is None:
        raise RuntimeError(f"CPU kernels unavailable: {unavailable_reason()}")
    if targets.dim() != 2 or targets.shape[1] != STEPS:
        raise ValueError(f"targets must have shape (N, {STEPS}), got {tuple(targets.shape)}")
    kbits = torch.tensor(bits_per_step(k_bits), dtype=torch.int32)
    lut = codebook_lut_float32(codebook)
    return ext.viterbi_states(targets.detach().to("cpu", torch.float32), kbits, lut)


# --- Dense GEMV for decode (csrc/ops/cpu/gemv_cpu.cpp, op torch.ops.exl3_cpu.gemv) ---
# Layout: W^T (in, out) cut into 32-column blocks, each contiguous: (ceil(out/32), in, 32),
# zero-padded past out; int8 weights carry one float32 scale per output column.

GEMV_BLOCK = 32
_GEMV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}


def pack_gemv_weight(weight: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, in) weight -> (blocked weights, int8 scales or None) for ``mode`` "fp32",
    "bf16" (round to nearest) or "int8" (symmetric, absmax / 127 per output row)."""
    if mode not in _GEMV_DTYPES:
        raise ValueError(f"unknown GEMV weight mode {mode!r}")
    out_features, in_features = weight.shape
    w = weight.detach().to("cpu", torch.float32)
    scale = None
    if mode == "int8":
        scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
        w = torch.round(w / scale[:, None])
    w = torch.nn.functional.pad(w, (0, 0, 0, -out_features % GEMV_BLOCK))
    blocked = w.to(_GEMV_DTYPES[mode]).view(-1, GEMV_BLOCK, in_features).transpose(1, 2)
    return blocked.contiguous(), scale


def unpack_gemv_weight(packed: torch.Tensor, scale: torch.Tensor | None = None,
                       transposed: bool = False) -> torch.Tensor:
    """The (padded out, in) matrix of ``pack_gemv_weight`` (``transposed``: (in, padded
    out), contiguous), in the stored dtype, or float32 times the scales for int8."""
    blocks, in_features, _ = packed.shape
    if transposed:
        w = packed.permute(1, 0, 2).reshape(in_features, blocks * GEMV_BLOCK)
        return w if scale is None else w.float() * _pad_to(scale, w.shape[1])
    w = packed.transpose(1, 2).reshape(blocks * GEMV_BLOCK, in_features)
    return w if scale is None else w.float() * _pad_to(scale, w.shape[0])[:, None]


def _pad_to(v: torch.Tensor, n: int) -> torch.Tensor:
    return torch.nn.functional.pad(v, (0, n - v.numel()))


def gemv_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor | None,
                   bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """PyTorch twin of ``gemv_cpu``: float32 ``x (M, K) @ W`` over the first n columns."""
    w_t = unpack_gemv_weight(packed, scale, transposed=True)[:, :n].float()
    y = x.float() @ w_t
    return y + bias[:n] if bias is not None else y


def gemv_cpu(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor | None,
             bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """``gemv_reference`` on the compiled kernel (float32 x (M, K), packed weights
    float32/bfloat16/int8); raises RuntimeError when the kernels are unavailable."""
    if _extension() is None:
        raise RuntimeError(f"CPU kernels unavailable: {unavailable_reason()}")
    return torch.ops.exl3_cpu.gemv(x, packed, scale, bias, n)


# --- Fused decode ops (csrc/ops/cpu/decode_ops.cpp), float32 only, each with its twin ---
# The engine checks `available()` once per module and calls `*_cpu` or `*_reference`.

def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension."""
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, rms_norm(x + residual)): a pre-norm block's residual add and the
    next norm."""
    total = x + residual
    return total, rms_norm_reference(total, weight, eps)


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     heads: int) -> torch.Tensor:
    """Rotate pairs (i, i + D/2) of heads 0..heads-1 of x [N, H, D] in place with
    cos/sin [N, D] (ops/reference.py's apply_rotary); returns x."""
    part = x[:, :heads]
    part.copy_(reference.apply_rotary(part, cos[:, None], sin[:, None]))
    return x


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] on the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def attend_decode_reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                            slots: torch.Tensor | None = None,
                            lengths: torch.Tensor | None = None,
                            window: int | None = None) -> torch.Tensor:
    """One query per row: query [B, H, D] over keys/values [B, KV, S, D], or, with slots
    [B, S], over a paged store [N, KV, D] read at those slots. Row b sees keys
    max(0, len - window) .. len - 1, len = lengths[b] (S without lengths). [B, H, D]."""
    if slots is not None:
        keys = keys[slots].transpose(1, 2)  # [B, KV, S, D]
        values = values[slots].transpose(1, 2)
    batch, heads, dim = query.shape
    kv_heads, span = keys.shape[1], keys.shape[2]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)) * dim**-0.5
    if lengths is not None or window is not None:
        pos = torch.arange(span)
        length = (lengths if lengths is not None else torch.full((batch,), span))[:, None]
        allowed = pos < length
        if window is not None:
            allowed &= pos >= length - window
        scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values).reshape(batch, heads, dim)


def gemv_rows_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight.T for a row-major (N, K) weight, float32 out."""
    return x @ weight.float().t()


def _ops():
    if _extension() is None:
        raise RuntimeError(f"CPU kernels unavailable: {unavailable_reason()}")
    return torch.ops.exl3_cpu


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm_reference`` in one pass (float32, contiguous)."""
    return _ops().rms_norm(x, weight, eps)


def add_rms_norm_cpu(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm_reference`` in one pass (float32, contiguous)."""
    return _ops().add_rms_norm(x, residual, weight, eps)


def rotary_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """``rotary_reference`` in one pass, in place (float32, head_dim contiguous)."""
    return _ops().rotary_(x, cos.contiguous(), sin.contiguous(), heads)


def silu_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu_mul_reference`` in one pass (float32, contiguous)."""
    return _ops().silu_mul(gate_up)


def attend_decode_cpu(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      slots: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
                      window: int | None = None) -> torch.Tensor:
    """``attend_decode_reference`` in one op, reading the cache in place (float32)."""
    return _ops().attend_decode(query.contiguous(), keys, values, slots, lengths,
                                0 if window is None else window)


def gemv_rows_cpu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``gemv_rows_reference`` streaming the row-major weight once (float32/bfloat16)."""
    return _ops().gemv_rows(x, weight)


# --- A decoder layer's decode step in two calls (csrc/ops/cpu/decode_ops.cpp) ---

class GemvWeights(NamedTuple):
    """One packed linear for ``gemv_cpu``: blocked weights, int8 scales, bias, out size."""

    packed: torch.Tensor
    scale: torch.Tensor | None
    bias: torch.Tensor | None
    n: int


def norm_qkv_rope_reference(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            qkv: GemvWeights, cos: torch.Tensor, sin: torch.Tensor,
                            head_dim: int, rot_heads: int) -> torch.Tensor:
    """rms_norm(x [M, E]) @ qkv, then heads 0..rot_heads-1 rotated: [M, qkv.n]."""
    out = gemv_reference(rms_norm_reference(x, norm_weight, eps), *qkv)
    rotary_reference(out.view(x.shape[0], -1, head_dim), cos, sin, rot_heads)
    return out


def out_mlp_reference(x: torch.Tensor, attn: torch.Tensor, o: GemvWeights,
                      norm_weight: torch.Tensor, eps: float, gate_up: GemvWeights,
                      down: GemvWeights) -> torch.Tensor:
    """The rest of a pre-norm layer: h = x + attn @ o; h + down(silu_mul(norm(h) @ gate_up))."""
    mid, normed = add_rms_norm_reference(x, gemv_reference(attn, *o), norm_weight, eps)
    return mid + gemv_reference(silu_mul_reference(gemv_reference(normed, *gate_up)), *down)


def norm_qkv_rope_cpu(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      qkv: GemvWeights, cos: torch.Tensor, sin: torch.Tensor,
                      head_dim: int, rot_heads: int) -> torch.Tensor:
    """``norm_qkv_rope_reference`` in one op."""
    return _ops().norm_qkv_rope(x, norm_weight, eps, *qkv, cos.contiguous(), sin.contiguous(),
                                head_dim, rot_heads)


def out_mlp_cpu(x: torch.Tensor, attn: torch.Tensor, o: GemvWeights, norm_weight: torch.Tensor,
                eps: float, gate_up: GemvWeights, down: GemvWeights) -> torch.Tensor:
    """``out_mlp_reference`` in one op."""
    return _ops().out_mlp(x, attn.contiguous(), o.packed, o.scale, o.bias, norm_weight, eps,
                          gate_up.packed, gate_up.scale, gate_up.bias, gate_up.n,
                          down.packed, down.scale, down.bias)


# --- EXL3 layers read from the packed trellis (csrc/ops/cpu/exl3_gemm_cpu.cpp) ---
# trellis_t is the file's (kb, nb, words) trellis with its tile axes swapped, (nb, kb,
# words), contiguous: the tiles of one 16-column strip lie together.

EXL3_CODEBOOK_IDS = {"3inst": 0, "mcg": 1, "mul1": 2}


def _codebook_id(codebook: str) -> int:
    if codebook not in EXL3_CODEBOOK_IDS:
        raise ValueError(f"unknown EXL3 codebook {codebook!r}")
    return EXL3_CODEBOOK_IDS[codebook]


@cache
def _scalar_lut(codebook: str) -> torch.Tensor | None:
    """The codebook table for a build without AVX-512 (which decodes through it)."""
    if simd_level() == "avx512":
        return None
    from exl3cli.codec.codebooks import codebook_lut_float32

    return codebook_lut_float32(codebook)


def exl3_decode_reference(trellis_t: torch.Tensor, k_bits: float, codebook: str) -> torch.Tensor:
    """Ŵ (16 kb, 16 nb) float32 of a (nb, kb, words) trellis (engine/quant decode_tiles)."""
    from exl3cli.codec.dequant import decode_tiles

    return decode_tiles(trellis_t.transpose(0, 1), k_bits, codebook).float()


def exl3_matmul_reference(xh: torch.Tensor, trellis_t: torch.Tensor, k_bits: float,
                          codebook: str) -> torch.Tensor:
    """xh (M, 16 kb) @ Ŵ, float32."""
    return xh.float() @ exl3_decode_reference(trellis_t, k_bits, codebook)


def exl3_linear_reference(x: torch.Tensor, trellis_t: torch.Tensor, suh: torch.Tensor,
                          svh: torch.Tensor, bias: torch.Tensor | None, k_bits: float,
                          codebook: str, n: int) -> torch.Tensor:
    """y = H(H(pad(x) * suh) @ Ŵ) * svh (+ bias) over the first n outputs, float32
    (x (M, in) with in <= 16 kb; H the 128-point block Hadamard): ops/reference.py's
    exl3_linear on the kernel's (nb, kb, words) layout."""
    y = reference.exl3_linear(x, trellis_t.transpose(0, 1), suh, svh, k_bits, codebook)[:, :n]
    return y + bias[:n] if bias is not None else y


def exl3_decode_cpu(trellis_t: torch.Tensor, k_bits: float, codebook: str) -> torch.Tensor:
    """``exl3_decode_reference`` on the compiled kernel (bit-identical values)."""
    return _ops().exl3_decode(trellis_t, float(k_bits), _codebook_id(codebook),
                              _scalar_lut(codebook))


def exl3_gemv_kind(k_bits: float, rows: int) -> str:
    """Which product the kernel runs for ``rows`` rows at K = ``k_bits``: "steps" (the
    trellis-step-order GEMV, AVX512-FP16 builds, 1-2 rows), "steps-int" (the same for a
    mul1 layer in the "fast" GEMV mode, ops/cpu_gemv_mode.py), "rows" (tile row pairs /
    rows), "scalar" (the codebook table, CPUs without AVX-512) or "strips" (more than 8
    rows: decoded strips and a matrix product)."""
    return _ops().exl3_gemv_kind(float(k_bits), int(rows))


def exl3_matmul_cpu(xh: torch.Tensor, trellis_t: torch.Tensor, k_bits: float,
                    codebook: str) -> torch.Tensor:
    """``exl3_matmul_reference`` with each tile decoded in registers (<= 8 rows) or in
    decoded column strips (more rows)."""
    return _ops().exl3_matmul(xh, trellis_t, float(k_bits), _codebook_id(codebook),
                              _scalar_lut(codebook))


def exl3_linear_cpu(x: torch.Tensor, trellis_t: torch.Tensor, suh: torch.Tensor,
                    svh: torch.Tensor, bias: torch.Tensor | None, k_bits: float,
                    codebook: str, n: int) -> torch.Tensor:
    """``exl3_linear_reference`` in one op (float32, contiguous suh/svh/bias)."""
    return _ops().exl3_linear(x, trellis_t, suh, svh, bias, float(k_bits),
                              _codebook_id(codebook), n, _scalar_lut(codebook))
