"""EXL3 CUDA kernels (``csrc/``), compiled on first use, with a pure-PyTorch fallback.

The extension is built with ``torch.utils.cpp_extension.load`` (JIT, ninja) into a
cache folder keyed by the sources, torch, CUDA and the GPU architecture, so a second
process loads it in well under a second. When no GPU, compiler or ninja is present, or
``EXL3_NO_EXT=1`` is set, every wrapper runs the reference codec of
``exl3cli.codec`` instead (one line on stderr says why, once).

Public API:
- ``available() -> bool`` / ``unavailable_reason() -> str | None``
- ``exl3_decode(trellis, k, codebook, out=None) -> Tensor[float16, (16*kb, 16*nb)]``:
  the rotated weight Ŵ, bit-exact with ``decode_tiles``.
- ``exl3_gemm(x, trellis, suh, svh, k, codebook, bias=None, out=None, out_features=None)
  -> y``: ``y = x @ W + bias`` with ``W = diag(suh)·Hblk·Ŵ·Hblk·diag(svh)``, in x's dtype.
  1..64 rows: fused decode-GEMM kernel; more rows: decode + cuBLAS (``prefill_mode``).
- ``dense_sums(xh, trellis, k2, cb, scale=None) -> float32 | float16 | None``: ``xh @ Ŵ``
  by decode + cuBLAS (float16 sums of ``Ŵ * scale`` with a scale).
- ``hadamard128(x, pre=None, post=None, bias=None, out_dtype=None) -> Tensor``.
- ``gemm_variant() -> int | None``: the fused GEMM's build-time variant (0 = default).
Environment: ``EXL3_NO_EXT=1`` forces the fallback; ``EXL3_KERNEL_CACHE`` sets the
build cache folder (default ``~/.cache/exl3/kernels``); ``EXL3_NVCC_FLAGS`` adds nvcc
flags (part of the cache key), e.g. ``-DEXL3_GEMM_VARIANT=N`` for a variant of the fused
GEMM (csrc/ops/cuda/gemm_lean.cuh; bench/NOTES-gpu.md).
"""

from __future__ import annotations

import os
import shutil
from types import ModuleType

import torch

from exl3cli.codec import block_hadamard, decode_tiles
from exl3cli.errors import InvalidSetting
from exl3cli.ops import reference
from exl3cli.ops.batch_invariant import ROW_BLOCK, batch_invariant
from exl3cli.ops.build import CSRC, LazyExtension, build_extension

_SOURCES = ("bindings.cpp", "layer_bindings.cpp", "fold_bindings.cpp", "moe_bindings.cpp",
            "decode.cu", "gemm_mul1.cu", "gemm_mcg.cu", "gemm_3inst.cu", "paged_attention.cu", "hadamard.cu",
            "layer_fused.cu", "qk_norm_rope.cu", "moe_decode.cu", "moe_gemm_mul1.cu", "moe_gemm_mcg.cu",
            "moe_gemm_3inst.cu", "moe_norm_route.cu", "lora_low.cu", "layer_fold.cu",
            "gemm_pro_mul1.cu", "gemm_pro_mcg.cu", "gemm_pro_3inst.cu")
# csrc/ mirrors the package: ops/cuda (these kernels), ops/cpu, codec (the format's
# decode and Hadamard, included by the kernels).
CUDA_DIR = CSRC / "ops" / "cuda"
_CODEBOOK_IDS = {"3inst": 0, "mcg": 1, "mul1": 2}
FUSED_MAX_ROWS = 64


def _arch_flags(major: int, minor: int) -> list[str]:
    """Machine code for the GPU at hand (sm_90a on Hopper) plus compute_80 PTX."""
    if (major, minor) == (9, 0):
        own = ["-gencode=arch=compute_90a,code=sm_90a"]
    else:
        own = [f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"]
    return own + ["-gencode=arch=compute_80,code=compute_80"]


def _why_not() -> str | None:  # EXL3_NO_EXT: checked by LazyExtension (build.py)
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if torch.version.cuda is None:
        return "this torch build has no CUDA"
    major, _ = torch.cuda.get_device_capability()
    if major < 8:
        return "GPU older than sm_80 (Ampere)"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return "no CUDA compiler (CUDA_HOME/nvcc not found)"
    if shutil.which("ninja") is None and not _has_ninja_module():
        return "ninja not found"
    return None


def _has_ninja_module() -> bool:
    try:
        import ninja  # noqa: F401
    except ImportError:
        return False
    return True


def _build() -> ModuleType:
    major, minor = torch.cuda.get_device_capability()
    flags = _arch_flags(major, minor)
    # No fast-math: the decode must round exactly as the format says.
    return build_extension(
        "exl3_kernels", [CUDA_DIR / s for s in _SOURCES],
        f"{torch.__version__}|{torch.version.cuda}",
        hashed=[*(CUDA_DIR / h for h in ("exl3_ops.h", "gemm_impl.cuh", "gemm_lean.cuh",
                                         "exl3_convert.cuh", "gemm_lora.cuh",
                                         "exl3_launch.cuh", "exl3_lora.cuh", "exl3_moe.cuh",
                                         "moe_gemm_impl.cuh", "moe_route.cuh", "moe_combine.cuh",
                                         "bindings_util.h", "gemm_pro.cuh",
                                         "layer_prologue.cuh")),
                *(CSRC / "codec" / h for h in ("exl3_trellis.cuh", "exl3_hadamard.cuh"))],
        cuda_cflags=["-O3", "-lineinfo", *flags, *os.environ.get("EXL3_NVCC_FLAGS", "").split()])


_EXTENSION = LazyExtension("CUDA kernels", _why_not, _build,
                           announce=lambda _reason: torch.cuda.is_available())


def _extension() -> ModuleType | None:
    return _EXTENSION.get()


def available() -> bool:
    """Whether the compiled CUDA kernels can be used (builds them on first call)."""
    return _extension() is not None


def unavailable_reason() -> str | None:
    """Why the kernels are not in use, or None when they are."""
    _extension()
    return _EXTENSION.reason


# The fused GEMM's build-time variant when EXL3_NVCC_FLAGS names none: the lean loop at
# every row count, tensor-core byte sums at 9-64 rows (csrc/ops/cuda/gemm_lean.cuh; 0 is
# the previous kernel, kept for A/B). tests/kernels/test_gemm_default.py checks the header.
DEFAULT_GEMM_VARIANT = 4


def gemm_variant() -> int | None:
    """The fused GEMM's build-time variant (``EXL3_GEMM_VARIANT``, default
    ``DEFAULT_GEMM_VARIANT``), or None without the extension."""
    ext = _extension()
    return None if ext is None else int(ext.gemm_variant())


def _k2(k: float) -> int:
    k2 = round(2 * float(k))
    if k2 / 2 != float(k) or k2 not in (2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16):
        raise ValueError(f"unsupported EXL3 bits per weight {k!r}")
    return k2


def _codebook_id(codebook: str, k2: int) -> int:
    if codebook not in _CODEBOOK_IDS:
        raise ValueError(f"unknown EXL3 codebook {codebook!r}")
    if k2 % 2 and codebook != "mul1":
        raise ValueError(f"K={k2 / 2} needs the mul1 codebook, got {codebook}")
    return _CODEBOOK_IDS[codebook]


def _use_ext(*tensors: torch.Tensor) -> ModuleType | None:
    if not all(t.is_cuda for t in tensors):
        return None
    return _extension()


def exl3_decode(
    trellis: torch.Tensor, k: float, codebook: str = "mul1", out: torch.Tensor | None = None
) -> torch.Tensor:
    """Decode a packed trellis (kb, nb, 16*K) int16 to Ŵ (16*kb, 16*nb) float16."""
    k2 = _k2(k)
    cb = _codebook_id(codebook, k2)
    ext = _use_ext(trellis)
    if ext is None:
        result = decode_tiles(trellis, k2 / 2, codebook)
        if out is None:
            return result
        return out.copy_(result)
    kb, nb = trellis.shape[0], trellis.shape[1]
    if out is None:
        out = torch.empty(16 * kb, 16 * nb, dtype=torch.float16, device=trellis.device)
    ext.decode(trellis.contiguous(), k2, cb, out)
    return out


def _as_f32(t: torch.Tensor | None) -> torch.Tensor | None:
    # The kernels read float32 vectors; callers that keep float32 copies pay nothing.
    if t is None:
        return None
    return t.reshape(-1).to(torch.float32).contiguous()


def _padded_f32(t: torch.Tensor, size: int) -> torch.Tensor:
    t = _as_f32(t)
    return t if t.numel() == size else torch.nn.functional.pad(t, (0, size - t.numel()))


def hadamard128(
    x: torch.Tensor,
    pre: torch.Tensor | None = None,
    post: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``H128(x * pre) * post + bias`` over the last dimension (a multiple of 128)."""
    out_dtype = out_dtype or x.dtype
    width = x.shape[-1]
    ext = _use_ext(x)
    if ext is None or width % 128:
        y = x.to(torch.float32)
        if pre is not None:
            y = y * pre.to(torch.float32)
        y = block_hadamard(y, dim=-1)
        if post is not None:
            y = y * post.to(torch.float32)
        if bias is not None:
            y = y + bias.to(torch.float32)
        return y.to(out_dtype)
    rows = x.reshape(1, -1, width)
    if rows.stride(2) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[1], width, dtype=out_dtype, device=x.device)
    ext.hadamard(rows, _as_f32(pre), _as_f32(post), _as_f32(bias), out, width)
    return out.view(*x.shape[:-1], width)


def choose_splits(kb: int, nb: int, device: torch.device, warps_per_sm: int | None = None,
                  rows: int = 1) -> int:
    """Runs of tile rows ("splits") for the fused GEMM of ``rows`` rows over kb x nb tiles:
    enough warps to fill the GPU (``warps_per_sm``, default ``EXL3_GEMM_WARPS_PER_SM``),
    each run at least 8 tile rows long.

    Up to 8 rows a warp's run is latency-bound and more warps in flight pay: 64 per SM,
    at most 32 splits (the output kernels sum every split: bench/NOTES-gpu.md, runs 7-8,
    gate/up 48.9 -> 40.4 us and the head 190 -> 174 us against 16 warps per SM). More
    rows multiply the partial sums each split writes: 16 warps per SM there. In the
    batch-invariant mode (ops/batch_invariant.py) the row count is ignored: 16 warps per
    SM at every count, so a row's split sums add in one order however many rows share
    the launch."""
    few = rows <= 8 and not batch_invariant()
    if warps_per_sm is None:
        warps_per_sm = int(os.environ.get("EXL3_GEMM_WARPS_PER_SM", "") or (64 if few else 16))
    sms = _sm_count(device)
    groups = -(-nb // 4)
    want = -(-warps_per_sm * sms // groups)
    if few:
        want = min(want, 32)
    return max(1, min(want, kb // 8 if kb >= 8 else 1))


_SMS: dict[torch.device, int] = {}


def _sm_count(device: torch.device) -> int:
    device = torch.device(device)
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def exl3_gemm(
    x: torch.Tensor,
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    k: float,
    codebook: str = "mul1",
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_features: int | None = None,
) -> torch.Tensor:
    """``y = x @ W + bias`` for an EXL3 linear (x: (..., in), y: (..., out), x's dtype).

    ``suh``/``svh`` may be shorter than the padded trellis (zero padding); ``out_features``
    (default ``svh.numel()``) trims the padded output."""
    k2 = _k2(k)
    cb = _codebook_id(codebook, k2)
    kb, nb = trellis.shape[0], trellis.shape[1]
    pad_in, pad_out = 16 * kb, 16 * nb
    n_out = out_features if out_features is not None else min(svh.numel(), pad_out)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    if x2.shape[-1] > pad_in or n_out > pad_out:
        raise ValueError(f"x/out ({x2.shape[-1]}, {n_out}) exceed the trellis {pad_in}x{pad_out}")
    ext = _use_ext(x, trellis)
    if ext is None or x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or rows == 0:
        y = reference.exl3_linear(x2, trellis, suh, svh, k2 / 2, codebook)[:, :n_out]
        if bias is not None:
            y = y + bias.to(torch.float32)[:n_out]
        y = y.to(x.dtype).reshape(*lead, n_out)
        return y if out is None else out.copy_(y)

    suh32 = _padded_f32(suh, pad_in)
    svh32 = _padded_f32(svh, pad_out)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    xh = torch.empty(rows, pad_in, dtype=torch.float16, device=x.device)
    ext.hadamard(x2.unsqueeze(0), suh32, None, None, xh, pad_in)
    if out is None:
        out = torch.empty(*lead, n_out, dtype=x.dtype, device=x.device)
    if rows > FUSED_MAX_ROWS and batch_invariant():
        # Every row through the fused kernel, as when it decodes (ops/batch_invariant.py).
        splits = choose_splits(kb, nb, x.device, rows=ROW_BLOCK)
        flat = out.view(rows, n_out)
        for start in range(0, rows, ROW_BLOCK):
            part = xh[start : start + ROW_BLOCK]
            acc = torch.empty(splits, part.shape[0], pad_out, dtype=torch.float32, device=x.device)
            ext.gemm_partial(part, trellis.contiguous(), k2, cb, acc)
            ext.hadamard(acc, None, svh32, _as_f32(bias), flat[start : start + part.shape[0]],
                         pad_out)
        return out
    if rows <= FUSED_MAX_ROWS:
        # Rows 33..64 run as one launch of 8 row groups (two launches of 32 rows measured
        # 10% slower at 64 jobs: bench/NOTES-gpu.md, run 4).
        splits = choose_splits(kb, nb, x.device, rows=rows)
        acc = torch.empty(splits, rows, pad_out, dtype=torch.float32, device=x.device)
        ext.gemm_partial(xh, trellis.contiguous(), k2, cb, acc)
        ext.hadamard(acc, None, svh32, _as_f32(bias), out.view(rows, n_out), pad_out)
        return out
    sums = dense_sums(xh, trellis, k2, cb) if prefill_mode() != "old" else None
    if sums is not None:
        acc = sums.unsqueeze(0)  # float32: no overflow, so no fold of svh into Ŵ
    else:
        weight = torch.empty(pad_in, pad_out, dtype=torch.float16, device=x.device)
        ext.decode(trellis.contiguous(), k2, cb, weight)
        # xh @ Ŵ is svh-times larger than the output (Ŵ has unit RMS): in float16 it
        # overflows on models with large activations. Fold the largest |svh| into Ŵ.
        scale = svh32.abs().amax().clamp_min(1e-8)
        weight.mul_(scale.to(torch.float16))
        svh32 = svh32 / scale
        acc = (xh @ weight).unsqueeze(0)
    ext.hadamard(acc, None, svh32, _as_f32(bias), out.view(rows, n_out), pad_out)
    return out


PREFILL_MODES = ("old", "fp32", "fused", "half")


def prefill_mode() -> str:
    """``EXL3_PREFILL``: how linears of more than ``FUSED_MAX_ROWS`` rows (prompts) run,
    read at each call so one process can A/B them (bench/prefill_bench.py). "old":
    decode + float16 cuBLAS, svh's largest value folded into Ŵ by an extra pass; "fp32":
    ``dense_sums`` (no fold); "fused" (the default: 1.05x the peer at 2,048 tokens on the
    8B shape, bench/NOTES-gpu.md run 37): that, and the fused layer kernels around it
    (engine/layers/fused_layer.py) instead of one op per norm, rotary, activation and
    residual; "half": "fused" with float16 sums (``dense_sums`` with a
    scale: max|svh| folded into Ŵ by the decode kernel itself), half the sums' traffic."""
    mode = os.environ.get("EXL3_PREFILL", "") or "fused"
    if mode not in PREFILL_MODES:
        raise InvalidSetting(f"EXL3_PREFILL must be one of {', '.join(PREFILL_MODES)}, got {mode!r}")
    return mode


_MM_F32: dict[torch.device, bool] = {}  # whether torch.mm takes out_dtype there
# Decoded Ŵ per (device, stream), grown, reused by every linear (one stream's launches
# run in order, so the next decode never overwrites a weight a GEMM still reads).
_WORKSPACE: dict[tuple[torch.device, int], torch.Tensor] = {}


def dense_sums_available(device: torch.device) -> bool:
    """Whether ``dense_sums`` runs on ``device`` (the kernels, and a torch whose CUDA
    ``mm`` takes ``out_dtype``); probed once per device."""
    device = torch.device(device)
    if device.type != "cuda" or _extension() is None:
        return False
    if device not in _MM_F32:
        tiny = torch.zeros(1, 8, dtype=torch.float16, device=device)
        try:
            torch.mm(tiny, tiny.t(), out_dtype=torch.float32)
            _MM_F32[device] = True
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_F32[device] = False
    return _MM_F32[device]


def dense_sums(xh: torch.Tensor, trellis: torch.Tensor, k2: int, cb: int,
               scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """``xh @ Ŵ`` in float32 (rows, 16 * nb) for xh float16 (rows, 16 * kb): Ŵ decoded into
    a per-device workspace, then one cuBLAS GEMM with float16 inputs and float32 output
    (``reference.dense_sums`` is the twin); None where that cannot run. With ``scale``
    (one float16 on the device): ``xh @ (Ŵ * scale)`` in float16, Ŵ scaled as it is
    decoded (the caller divides svh by it: float16 sums then keep svh's range)."""
    ext = _use_ext(xh, trellis)
    if ext is None or xh.dtype != torch.float16 or not dense_sums_available(xh.device):
        return None
    kb, nb = trellis.shape[0], trellis.shape[1]
    size = 256 * kb * nb
    key = (xh.device, torch.cuda.current_stream(xh.device).cuda_stream)
    space = _WORKSPACE.get(key)
    if space is None or space.numel() < size:
        _WORKSPACE.pop(key, None)  # free the smaller one before the larger
        space = _WORKSPACE[key] = torch.empty(size, dtype=torch.float16, device=xh.device)
    weight = space[:size].view(16 * kb, 16 * nb)
    if scale is not None:
        ext.decode_scaled(trellis.contiguous(), k2, cb, weight, scale)
        return torch.mm(xh, weight)
    ext.decode(trellis.contiguous(), k2, cb, weight)
    return torch.mm(xh, weight, out_dtype=torch.float32)


def paged_attention(
    query: torch.Tensor,
    keys: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    values: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    key_bits: int,
    value_bits: int,
    page_table: torch.Tensor,
    lengths: torch.Tensor,
    page_size: int,
    window: int | None,
    *,
    softcap: float | None = None,
    scale: float | None = None,
    parts: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """Decode attention straight over a paged cache, or None where no kernel applies
    (the caller then runs the PyTorch reference, engine/generation/decode_step.py).

    query [B, H, D]; keys/values: one layer's pool storage, [slots, KV, D] in the
    query's dtype, or (bit-packed codes [slots, KV*D/8*bits] uint8, float16 scales
    [slots, KV*D/32]) for a quantized cache (key_bits/value_bits < 16); page_table
    [B, P] (int64 page indices), lengths [B] (keys per row, the query's own included).
    Row b attends to its positions max(0, lengths[b] - window) .. lengths[b] - 1,
    scores q.k * scale (default D**-0.5), soft-capped when `softcap` is set.
    `parts` (float32 (B, H, attention_chunks(P, page_size), D) and (.., 2)): with more
    than one chunk the unnormalised chunk results stay there, uncombined (the caller
    combines them: ops/layer_fold.py combine_hadamard) and the output is not written."""
    ext = _use_ext(query)
    if ext is None or not hasattr(ext, "paged_attention"):
        return None
    if query.dtype not in (torch.float16, torch.bfloat16) or query.shape[-1] not in (64, 128, 256):
        return None
    quantized = isinstance(keys, tuple)
    if quantized != isinstance(values, tuple):
        return None
    if not quantized and (keys.dtype != query.dtype or values.dtype != query.dtype):
        return None
    batch, heads, dim = query.shape
    empty = query.new_empty(0)
    k_codes, k_scales = keys if quantized else (keys, empty)
    v_codes, v_scales = values if quantized else (values, empty)
    kv_heads = (k_scales.shape[1] * 32 // dim) if quantized else keys.shape[1]
    group = heads // kv_heads if heads % kv_heads == 0 else 0
    if not 0 < group <= 16 or group * (dim // 32) > 64:
        return None  # more accumulators per lane than the kernel keeps
    query = query.contiguous()
    out = torch.empty_like(query)
    ext.paged_attention(
        query, k_codes, k_scales, v_codes, v_scales,
        key_bits if quantized else 16, value_bits if quantized else 16,
        page_table.contiguous(), lengths.contiguous(), out, int(page_size), kv_heads,
        -1 if window is None else int(window),
        0.0 if softcap is None else float(softcap),
        dim**-0.5 if scale is None else float(scale),
        *(parts if parts is not None else (None, None)))
    return out


def attention_chunks(pages: int, page_size: int) -> int:
    """The 64-position chunks paged_attention splits a row of `pages` pages into."""
    return (pages * page_size + 63) // 64


def kv_quant_write(rows: torch.Tensor, slots: torch.Tensor, bits: int, codes: torch.Tensor,
                   scales: torch.Tensor) -> bool:
    """Quantize rows [N, C] into a quantized KV store at `slots` [N] (kv_quant.quantize_rows
    then pack_codes, in one kernel); False where no kernel applies (the caller then runs
    those PyTorch functions)."""
    ext = _use_ext(rows)
    if ext is None or not hasattr(ext, "kv_quant_write"):
        return False
    if rows.dtype not in (torch.float16, torch.bfloat16, torch.float32) or rows.shape[-1] % 32:
        return False
    if rows.dim() != 2 or rows.stride(-1) != 1:
        rows = rows.reshape(rows.shape[0], -1).contiguous()  # any row stride will do
    ext.kv_quant_write(rows, slots.contiguous(), int(bits), codes, scales)
    return True
