"""CUDA Viterbi tile encoder (``csrc/ops/cuda/viterbi_cuda.cu``), compiled on first use.

Built on its own with ``torch.utils.cpp_extension.load`` (JIT, ninja) into a cache
folder keyed by the source, torch, CUDA and the GPU architecture; ``exl3cli.ops.cuda_kernels``
builds the decode/GEMM kernels from a fixed source list, so this module loads the
encoder separately (to be folded into one build later). When no GPU, compiler or ninja
is present, or ``EXL3_NO_EXT=1`` is set, callers use the PyTorch reference instead.

Public API:
- ``available() -> bool`` / ``unavailable_reason() -> str | None``
- ``viterbi_states_cuda(targets[N, 256] (CUDA), k_bits, codebook="mul1")
  -> states[int64, (N, 256)]`` on targets' device: the same states as
  ``exl3cli.ops.viterbi.viterbi_states_reference``.
- ``viterbi_states_segments_cuda(targets, k_bits[list], counts[list], codebook)``: tiles
  in consecutive segments of their own K (at most ``MAX_SEGMENTS``), one launch.
Environment: ``EXL3_NO_EXT=1``, ``EXL3_KERNEL_CACHE`` (default ``~/.cache/exl3/kernels``),
``EXL3_EXT_VERBOSE=1`` as for ``exl3cli.ops.cuda_kernels``.
"""

from __future__ import annotations

import shutil
from types import ModuleType

import torch

from exl3cli.ops.build import CSRC, LazyExtension, build_extension

SOURCE = CSRC / "ops" / "cuda" / "viterbi_cuda.cu"

_luts: dict[tuple[str, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _why_not() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if torch.version.cuda is None:
        return "this torch build has no CUDA"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return "no CUDA compiler (CUDA_HOME/nvcc not found)"
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401
        except ImportError:
            return "ninja not found"
    return None


def _build() -> ModuleType:
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}a" if (major, minor) == (9, 0) else f"{major}{minor}"
    # No fast-math: the search must round exactly like the PyTorch reference.
    return build_extension(
        "exl3_viterbi", [SOURCE], f"{torch.__version__}|{torch.version.cuda}",
        cuda_cflags=["-O3", "-lineinfo", f"-gencode=arch=compute_{arch},code=sm_{arch}"])


_EXTENSION = LazyExtension(
    "CUDA Viterbi kernel", _why_not, _build,
    announce=lambda _reason: torch.cuda.is_available(),
    fallback="using the PyTorch reference on the GPU")


def _extension() -> ModuleType | None:
    return _EXTENSION.get()


def available() -> bool:
    """Whether the CUDA Viterbi kernel can be used (builds it on first call)."""
    return _EXTENSION.available()


def unavailable_reason() -> str | None:
    """Why the kernel is not in use, or None when it is."""
    return _EXTENSION.unavailable_reason()


def _device_luts(codebook: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (codebook, device)
    if key not in _luts:
        from exl3cli.codec.codebooks import codebook_lut, codebook_lut_float32

        _luts[key] = (codebook_lut_float32(codebook).to(device),
                      codebook_lut(codebook).to(device))
    return _luts[key]


def viterbi_states_cuda(
    targets: torch.Tensor, k_bits: float, codebook: str = "mul1"
) -> torch.Tensor:
    """Best tail-biting states (N, 256) int64 for CUDA targets (N, 256) in step order;
    raises RuntimeError when the kernel is unavailable."""
    from exl3cli.codec.bitstream import STEPS, bits_per_step

    ext = _extension() if available() else None
    if ext is None:
        raise RuntimeError(f"CUDA Viterbi kernel unavailable: {unavailable_reason()}")
    if not targets.is_cuda or targets.dim() != 2 or targets.shape[1] != STEPS:
        raise ValueError(f"targets must be a CUDA tensor (N, {STEPS}), got "
                         f"{tuple(targets.shape)} on {targets.device}")
    per_step = bits_per_step(k_bits)
    if codebook != "mul1" and not float(k_bits).is_integer():
        raise ValueError("half-integer bits per weight need the mul1 codebook")
    device = targets.device
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    lut, lut_h = _device_luts(codebook, device)
    return ext.viterbi_states(targets.detach().to(torch.float32), [per_step],
                              [targets.shape[0]], lut, lut_h)


MAX_SEGMENTS = 4  # kMaxSegments in viterbi_cuda.cu


def viterbi_states_segments_cuda(
    targets: torch.Tensor, k_bits: list[float], counts: list[int], codebook: str = "mul1"
) -> torch.Tensor:
    """``viterbi_states_cuda`` of consecutive segments of ``targets`` (``counts[i]``
    tiles at ``k_bits[i]``; at most MAX_SEGMENTS) in one launch: the same states as one
    call per segment."""
    from exl3cli.codec.bitstream import bits_per_step

    ext = _extension() if available() else None
    if ext is None:
        raise RuntimeError(f"CUDA Viterbi kernel unavailable: {unavailable_reason()}")
    if not 1 <= len(k_bits) <= MAX_SEGMENTS or len(k_bits) != len(counts):
        raise ValueError(f"1..{MAX_SEGMENTS} segments, one count each, got {k_bits} {counts}")
    if codebook != "mul1" and not all(float(k).is_integer() for k in k_bits):
        raise ValueError("half-integer bits per weight need the mul1 codebook")
    device = targets.device
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    lut, lut_h = _device_luts(codebook, device)
    return ext.viterbi_states(targets.detach().to(torch.float32),
                              [bits_per_step(k) for k in k_bits], list(counts), lut, lut_h)
