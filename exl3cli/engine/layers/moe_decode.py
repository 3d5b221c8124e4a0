"""A mixture-of-experts step without host syncs, for decode-sized token counts.

`MoEMLP`'s grouped dispatch reads each expert's token count back to the host
(`bincount(...).tolist()`) to slice its rows: fine for prefill, but a CUDA graph cannot
capture it and every decode step waits on it per layer. Here each (token, expert) pair
gathers its expert's weights from tensors stacked over the experts and runs one batched
matmul per projection: shapes depend only on the number of pairs, nothing is read back,
and only the chosen experts' weights are read. Pure PyTorch over dense weights (dense
experts, or EXL3 experts dequantized at load).

EXL3 experts on CUDA take the kernels of ``exl3cli/ops/moe_kernels.py`` instead (the
same sync-free step reading the chosen experts' trellis, ``exl3_expert_tables``): MoEMLP
uses them for calls of up to 64 rows (decode steps, so the generator's CUDA graphs
capture MoE layers too); longer calls (prefill) keep the grouped dispatch.

Public API:
- ``StackedExperts.of(experts) -> StackedExperts | None`` (None when an expert has no
  dense weight): ``forward(rows[N, H], weights[N, k], chosen[N, k]) -> [N, H]``.
- ``SYNC_FREE_MAX_PAIRS``: up to this many (token, expert) pairs MoEMLP takes this path
  once its experts are stacked (``MoEMLP.stack_experts()``).
- ``exl3_expert_tables(experts) -> ExpertTables | None``: the kernels' tables when every
  expert is a gated MLP of EXL3 linears in trellis mode on CUDA that the kernels run
  (``EXL3_MOE_KERNEL=0`` turns them off), else None.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from exl3cli.engine.layers.linear import Exl3Linear, FusedLinear
from exl3cli.engine.layers.mlp import GatedMLP
from exl3cli.ops import cuda_kernels as kernels
from exl3cli.ops.moe_kernels import ExpertTables

SYNC_FREE_MAX_PAIRS = 64  # decode batches; prefill keeps the grouped dispatch


def _stack(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    if all(t is None for t in tensors):
        return None
    if any(t is None for t in tensors):
        raise ValueError("some experts have a bias and some do not")
    return torch.stack(tensors)  # type: ignore[arg-type]


class StackedExperts(nn.Module):
    """Every expert's gate/up and down weights stacked: [E, 2I, H], [E, H, I]."""

    def __init__(self, gate_up: torch.Tensor, gate_up_bias: torch.Tensor | None,
                 down: torch.Tensor, down_bias: torch.Tensor | None, activation: GatedMLP):
        super().__init__()
        self.register_buffer("gate_up", gate_up, persistent=False)
        self.register_buffer("gate_up_bias", gate_up_bias, persistent=False)
        self.register_buffer("down", down, persistent=False)
        self.register_buffer("down_bias", down_bias, persistent=False)
        self.activation = activation  # an expert: its `gated` is the activation

    @classmethod
    def of(cls, experts: list[GatedMLP]) -> StackedExperts | None:
        dense = [(e.gate_up.dense_weight(), e.down.dense_weight()) for e in experts]
        if not dense or any(gu is None or d is None for gu, d in dense):
            return None
        return cls(torch.stack([gu[0] for gu, _ in dense]), _stack([gu[1] for gu, _ in dense]),
                   torch.stack([d[0] for _, d in dense]), _stack([d[1] for _, d in dense]),
                   experts[0])

    def forward(self, rows: torch.Tensor, weights: torch.Tensor,
                chosen: torch.Tensor) -> torch.Tensor:
        count, top_k = chosen.shape
        pairs = chosen.reshape(-1)
        x = rows.repeat_interleave(top_k, dim=0).to(self.gate_up.dtype)  # [P, H]
        gate_up = torch.bmm(self.gate_up.index_select(0, pairs), x[:, :, None])[..., 0]
        if self.gate_up_bias is not None:
            gate_up = gate_up + self.gate_up_bias.index_select(0, pairs)
        mid = self.activation.gated(gate_up)
        out = torch.bmm(self.down.index_select(0, pairs), mid[:, :, None])[..., 0]
        if self.down_bias is not None:
            out = out + self.down_bias.index_select(0, pairs)
        out = out * weights.reshape(-1, 1).to(out.dtype)
        return out.view(count, top_k, -1).sum(dim=1).to(rows.dtype)


def exl3_expert_tables(experts: list[GatedMLP]) -> ExpertTables | None:
    """See the module docstring."""
    if os.environ.get("EXL3_MOE_KERNEL", "1") == "0" or not experts:
        return None
    groups: list[list[Exl3Linear]] = [[], [], []]
    for expert in experts:
        gate_up = getattr(expert, "gate_up", None)
        if not isinstance(gate_up, FusedLinear) or len(gate_up.parts) != 2:
            return None
        for group, layer in zip(groups, (*gate_up.parts, expert.down), strict=True):
            if (not isinstance(layer, Exl3Linear) or layer.mode != "trellis"
                    or not layer.trellis.is_cuda):
                return None
            group.append(layer)
    if len({e.activation for e in experts}) != 1 or not kernels.available():
        return None
    return ExpertTables.build(*groups, experts[0].activation, experts[0].down.out_features)
