"""Memory planning and layer placement: what a load needs, and where each layer goes.

Before any weight is read, the loader adds up what the model will hold: the weights
(from the safetensors headers, at the dtype they will have), the KV cache for
``num_ctx`` tokens and a workspace. The first ``gpu_layers`` decoder layers keep their
weights on the main device (the GPU); the weights of the others live in host memory at
their compressed size and run on the CPU (engine/layers/offload.py). Embeddings, norms, the
head and the KV cache of every layer stay on the main device, so the hidden state never
leaves it for more than one linear.

``gpu_layers`` is Ollama's ``num_gpu``: a count, -1 or None for the largest count that
fits the main device's free memory. A load that cannot fit refuses with one clear
ModelLoadError naming both figures, instead of dying of an out-of-memory error midway.

Public API:
- ``parse_bytes(text) -> int``: "8GiB", "512MiB", "4G", "1.5GB", "123456".
- ``gpu_budget(device) -> int | None``: ``EXL3_GPU_MEMORY`` when set, else the CUDA
  device's free memory less a reserve, else None (no GPU).
- ``cpu_budget() -> int | None``: ``EXL3_CPU_MEMORY`` when set, else MemAvailable.
- ``MemoryEstimate`` (layers, other, cache_per_layer, workspace) and
  ``estimate_memory(folder, config, dtype, num_ctx=4096) -> MemoryEstimate``.
- ``Placement`` (num_layers, gpu_layers, gpu_bytes, cpu_bytes, streamed, ``processor``:
  "100% GPU", "100% CPU" or "48%/52% CPU/GPU") and ``plan_placement(estimate, gpu_budget,
  cpu_budget, gpu_layers=None, streamed=False) -> Placement``.
- ``offload_mode(value=None) -> str``: how offloaded layers run, ``EXL3_OFFLOAD``:
  "cpu" (the default: their projections on the CPU, engine/layers/offload.py) or
  "stream" (their weights in pinned host memory, copied to the GPU layer by layer,
  engine/layers/streamed.py; the GPU then also holds two slots of the largest layer).
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from exl3cli.engine.spec.config import ModelConfig
from exl3cli.errors import InvalidOption, ModelLoadError

DEFAULT_NUM_CTX = 4096
# Held back from the free GPU memory: CUDA context, allocator slack, kernel workspaces.
GPU_RESERVE_BYTES = 512 * 2**20
# Activations of one prefill chunk of this many tokens count as workspace.
WORKSPACE_TOKENS = 2048

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}
_FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_ELEMENT_BYTES = {**_FLOAT_DTYPES, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


OFFLOAD_MODES = ("cpu", "stream")


def offload_mode(value: str | None = None) -> str:
    """`value`, else ``EXL3_OFFLOAD``, else "cpu"; a clear error for anything else."""
    mode = (value or os.environ.get("EXL3_OFFLOAD", "") or "cpu").strip().lower()
    if mode not in OFFLOAD_MODES:
        raise InvalidOption(f"EXL3_OFFLOAD must be one of {', '.join(OFFLOAD_MODES)}, "
                            f"got {mode!r}")
    return mode


def parse_bytes(text: str) -> int:
    """A memory size: a number with an optional unit (K/M/G/T, KB.., KiB..)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise InvalidOption(f"invalid memory size {text!r} (use e.g. 8GiB, 512MiB, 4G)")
    return int(float(match.group(1)) * _UNITS[unit])


def gpu_budget(device: torch.device) -> int | None:
    """Bytes the main device may take: ``EXL3_GPU_MEMORY``, else CUDA's free memory
    less ``GPU_RESERVE_BYTES``; None for a CPU device without the variable."""
    forced = os.environ.get("EXL3_GPU_MEMORY", "")
    if forced:
        return parse_bytes(forced)
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return max(0, free - GPU_RESERVE_BYTES)


def cpu_budget() -> int | None:
    """Bytes host memory may take: ``EXL3_CPU_MEMORY``, else MemAvailable (Linux)."""
    forced = os.environ.get("EXL3_CPU_MEMORY", "")
    if forced:
        return parse_bytes(forced)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _headers(folder: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (safetensors dtype, shape) from every file's header."""
    found: dict[str, tuple[str, list[int]]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with path.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
        except (OSError, ValueError, struct.error) as exc:
            raise ModelLoadError(f"cannot read the header of {path}: {exc}") from exc
        for name, info in header.items():
            if name != "__metadata__":
                found[name] = (info["dtype"], [int(d) for d in info["shape"]])
    return found


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a load holds: weights per decoder layer, the other weights (embeddings,
    head, norms), the KV cache per layer and the workspace."""

    layers: tuple[int, ...]
    other: int
    cache_per_layer: int
    workspace: int

    @property
    def total(self) -> int:
        return (sum(self.layers) + self.other + self.cache_per_layer * len(self.layers)
                + self.workspace)


def estimate_memory(folder: str | Path, config: ModelConfig, dtype: torch.dtype,
                    num_ctx: int = DEFAULT_NUM_CTX,
                    dequantized_bytes: int | None = None) -> MemoryEstimate:
    """What loading `folder` will hold with activations in `dtype`: floating tensors at
    `dtype`'s size, EXL3 trellises as stored (or at `dequantized_bytes` per weight when
    the load expands them: the dense CPU modes); a `num_ctx`-token cache in `dtype`."""
    size = torch.finfo(dtype).bits // 8
    layers = [0] * config.num_layers
    other = 0
    for name, (kind, shape) in _headers(Path(folder)).items():
        count = 1
        for dim in shape:
            count *= dim
        nbytes = count * (size if kind in _FLOAT_DTYPES else _ELEMENT_BYTES.get(kind, 1))
        if dequantized_bytes and name.endswith(".trellis") and len(shape) == 3:
            nbytes = shape[0] * shape[1] * 256 * dequantized_bytes
        match = _LAYER_KEY.search(name)
        index = int(match.group(1)) if match else -1
        if 0 <= index < config.num_layers:
            layers[index] += nbytes
        else:
            other += nbytes
    cache = 2 * config.num_kv_heads * config.head_dim * num_ctx * size
    workspace = WORKSPACE_TOKENS * (2 * config.hidden_size + 2 * config.intermediate_size) * 4
    workspace += WORKSPACE_TOKENS * config.vocab_size * 4 // 16  # chunked logits
    return MemoryEstimate(tuple(layers), other, cache, workspace)


@dataclass(frozen=True)
class Placement:
    """The first `gpu_layers` of `num_layers` on the main device, the rest offloaded."""

    num_layers: int
    gpu_layers: int
    gpu_bytes: int
    cpu_bytes: int
    streamed: bool = False  # offloaded layers copied to the GPU per forward

    @property
    def offloaded(self) -> bool:
        return self.gpu_layers < self.num_layers

    @property
    def processor(self) -> str:
        """Ollama's PROCESSOR column: "100% GPU", "100% CPU" or "48%/52% CPU/GPU"."""
        total = self.gpu_bytes + self.cpu_bytes
        if total <= 0 or self.gpu_bytes <= 0:
            return "100% CPU"
        gpu = round(100 * self.gpu_bytes / total)
        return "100% GPU" if gpu >= 100 else f"{100 - gpu}%/{gpu}% CPU/GPU"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def plan_placement(estimate: MemoryEstimate, gpu_budget: int | None, cpu_budget: int | None,
                   gpu_layers: int | None = None, streamed: bool = False) -> Placement:
    """Where the layers go. No GPU budget, or ``gpu_layers`` 0 without `streamed`:
    everything in host memory (the loader then loads on the CPU). ``gpu_layers`` None
    or -1: as many layers as fit; else exactly that many (capped at the layer count),
    refused when they do not fit. Refused too when host memory cannot hold its part.
    The main device always holds embeddings, head, norms, cache, workspace, and with
    `streamed` offloaded layers two slots of the largest of them."""
    n = len(estimate.layers)
    if gpu_layers is not None and gpu_layers < -1:
        raise InvalidOption(f"num_gpu must be -1 (automatic) or a layer count, got {gpu_layers}")
    fixed = estimate.other + estimate.cache_per_layer * n + estimate.workspace
    if gpu_budget is None or (gpu_layers == 0 and not streamed):  # Ollama's num_gpu 0
        _check_host(estimate.total, cpu_budget, "the model")
        return Placement(n, n if gpu_budget is None else 0, 0, estimate.total)

    def needed(count: int) -> int:  # device bytes with the first `count` layers resident
        slots = 2 * max(estimate.layers[count:]) if streamed and count < n else 0
        return fixed + sum(estimate.layers[:count]) + slots

    if gpu_layers is None or gpu_layers == -1:
        count = n
        while count > 0 and needed(count) > gpu_budget:
            count -= 1
        if needed(count) > gpu_budget:
            what = "two streamed layers, " if streamed else ""
            raise ModelLoadError(
                f"the model needs at least {_gib(needed(count))} on the GPU (embeddings, "
                f"head, {what}KV cache for the context, workspace), {_gib(gpu_budget)} "
                "free: use a smaller num_ctx or run it on the CPU")
    else:
        count = min(gpu_layers, n)
        if needed(count) > gpu_budget:
            raise ModelLoadError(
                f"num_gpu {gpu_layers} needs {_gib(needed(count))} on the GPU, "
                f"{_gib(gpu_budget)} free: lower num_gpu or leave it unset for an "
                "automatic split")
    host = sum(estimate.layers[count:])
    _check_host(host, cpu_budget, f"{n - count} offloaded layers")
    return Placement(n, count, needed(count), host, streamed=streamed and count < n)


def _check_host(needed: int, budget: int | None, what: str) -> None:
    if budget is not None and needed > budget:
        raise ModelLoadError(f"{what}: {_gib(needed)} of host memory needed, "
                             f"{_gib(budget)} available (EXL3_CPU_MEMORY)")
