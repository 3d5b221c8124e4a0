"""Checkpoints that store q/k/v or gate/up as one matrix (Phi-3, GLM-4), seen by the
converter as separate modules: EXL3 folders store them split (EXL3-FORMAT.md section 2:
`qkv_proj` -> `q_proj`, `k_proj`, `v_proj`; `gate_up_proj` -> `gate_proj`, `up_proj`).

Public API:
- ``split_fused(reader, config, names) -> (reader, names)``: when `names` has fused
  modules, a reader whose split module names are row slices of the fused tensors (the
  fused names hidden), and `names` without the fused entries; else both unchanged.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from exl3cli.engine.models.weights import WeightReader
from exl3cli.engine.spec.architecture import TensorNames
from exl3cli.engine.spec.config import ModelConfig


class SplitFusedReader:
    """A WeightReader view: `parts` maps a split tensor name to (fused name, rows)."""

    def __init__(self, reader: WeightReader, parts: dict[str, tuple[str, slice]]):
        self.reader = reader
        self.folder = reader.folder
        self.parts = parts
        fused = {source for source, _ in parts.values()}
        self._keys = [k for k in reader.keys() if k not in fused] + list(parts)

    def keys(self) -> list[str]:
        return list(self._keys)

    def has(self, name: str) -> bool:
        return name in self.parts or (self.reader.has(name) and name in self._keys)

    def get(self, name: str, dtype: torch.dtype | None = None,
            device: torch.device | str | None = None) -> torch.Tensor:
        if name not in self.parts:
            return self.reader.get(name, dtype=dtype, device=device)
        source, rows = self.parts[name]
        return self.reader.get(source, dtype=dtype, device=device)[rows].contiguous()


def split_fused(reader: WeightReader, config: ModelConfig,
                names: TensorNames) -> tuple[WeightReader | SplitFusedReader, TensorNames]:
    if not (names.qkv_fused or names.gate_up_fused):
        return reader, names
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    parts: dict[str, tuple[str, slice]] = {}
    for i in range(config.num_layers):
        groups = []
        if names.qkv_fused:
            groups.append((names.qkv_fused, [(names.q_proj, 0, q), (names.k_proj, q, q + kv),
                                             (names.v_proj, q + kv, q + 2 * kv)]))
        if names.gate_up_fused:
            groups.append((names.gate_up_fused, [(names.gate_proj, 0, inter),
                                                 (names.up_proj, inter, 2 * inter)]))
        for fused, splits in groups:
            for suffix in (".weight", ".bias"):
                source = fused.format(i=i) + suffix
                if reader.has(source):
                    for split, start, end in splits:
                        parts[split.format(i=i) + suffix] = (source, slice(start, end))
    return SplitFusedReader(reader, parts), replace(names, qkv_fused=None, gate_up_fused=None)
