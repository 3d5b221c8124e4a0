"""Checkpoints that hold every expert of a layer in one tensor (gpt-oss), seen as the
per-expert modules EXL3 folders store (`experts.{e}.gate_proj`, `up_proj`, `down_proj`).

Hugging Face gpt-oss checkpoints store `experts.gate_up_proj` as [experts, hidden,
2 * width] with gate and up columns interleaved (gate at even columns, up at odd ones),
`experts.down_proj` as [experts, width, hidden], and their biases as
`experts.gate_up_proj_bias` [experts, 2 * width] / `experts.down_proj_bias`. The view
serves each expert's slices under the split names (as nn.Linear weights, [out, in]),
so the loader and the converter need no second code path. OpenAI's MXFP4 release
(`*_blocks` / `*_scales`) is refused in one line.

Public API:
- ``FusedExpertsReader(reader, parts)``: a WeightReader view (``keys``, ``has``, ``get``).
- ``split_fused_experts(reader, config, spec) -> reader``: the view when the checkpoint
  has the spec's fused expert tensors, else `reader` unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from exl3cli.engine.spec.architecture import ArchitectureSpec
from exl3cli.engine.spec.config import ModelConfig
from exl3cli.errors import UnsupportedArchitecture

# (fused tensor, expert, what to take): "gate" / "up" (interleaved halves) or "all".
Part = tuple[str, int, str]


class FusedExpertsReader:
    """A WeightReader view: `parts` maps a per-expert tensor name to its fused source."""

    def __init__(self, reader: Any, parts: dict[str, Part]):
        self.reader = reader
        self.folder = reader.folder
        self.parts = parts
        fused = {source for source, _, _ in parts.values()}
        self._keys = [k for k in reader.keys() if k not in fused] + list(parts)
        self._cached: tuple[str, torch.Tensor] | None = None  # one fused tensor at a time

    def keys(self) -> list[str]:
        return list(self._keys)

    def has(self, name: str) -> bool:
        return name in self.parts or (self.reader.has(name) and name in self._keys)

    def _fused(self, source: str) -> torch.Tensor:
        if self._cached is None or self._cached[0] != source:
            self._cached = (source, self.reader.get(source))
        return self._cached[1]

    def get(self, name: str, dtype: torch.dtype | None = None,
            device: torch.device | str | None = None) -> torch.Tensor:
        if name not in self.parts:
            return self.reader.get(name, dtype=dtype, device=device)
        source, expert, take = self.parts[name]
        tensor = self._fused(source)[expert]
        if take != "all":  # interleaved gate/up columns (or bias entries)
            tensor = tensor[..., 0::2] if take == "gate" else tensor[..., 1::2]
        if tensor.dim() == 2:  # [in, out] -> nn.Linear's [out, in]
            tensor = tensor.T
        return tensor.to(dtype=dtype or tensor.dtype, device=device or tensor.device).contiguous()


def split_fused_experts(reader: Any, config: ModelConfig, spec: ArchitectureSpec) -> Any:
    """`reader`, seen through FusedExpertsReader when layer 0 of a sparse layer holds
    the spec's fused expert tensors (module docstring)."""
    moe = spec.moe
    if moe is None or not (moe.fused_gate_up and moe.fused_down):
        return reader
    sparse = [i for i in range(config.num_layers) if moe.is_sparse(config, i)]
    if not sparse or not reader.has(moe.fused_gate_up.format(i=sparse[0])):
        if sparse and reader.has(moe.fused_gate_up.format(i=sparse[0]) + "_blocks"):
            raise UnsupportedArchitecture(
                f"{config.architecture}: MXFP4-packed experts (*_blocks / *_scales) are not "
                "supported; use a bfloat16 checkpoint of the model (or an EXL3 folder)")
        return reader  # split already (an EXL3 folder)
    parts: dict[str, Part] = {}
    for i in sparse:
        gate_up, down = moe.fused_gate_up.format(i=i), moe.fused_down.format(i=i)
        for e in range(moe.num_experts(config)):
            for suffix, source in ((".weight", gate_up), (".bias", gate_up + "_bias")):
                if reader.has(source):
                    parts[moe.gate_proj.format(i=i, e=e) + suffix] = (source, e, "gate")
                    parts[moe.up_proj.format(i=i, e=e) + suffix] = (source, e, "up")
            for suffix, source in ((".weight", down), (".bias", down + "_bias")):
                if reader.has(source):
                    parts[moe.down_proj.format(i=i, e=e) + suffix] = (source, e, "all")
    return FusedExpertsReader(reader, parts)
