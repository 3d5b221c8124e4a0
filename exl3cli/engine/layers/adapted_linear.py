"""A linear with per-row LoRA updates: ``inner(x)`` plus each token row's own adapter's
low-rank update (the adapters themselves: ``engine/adapters/lora.py``).

The layer holds the A and B of every adapter that touches it, stacked along the rank:
A_all [R, in], B_all^T [R, out] and, per rank column, the slot of the adapter it belongs
to (slot 0 is "no adapter"). N token rows, each with its slot, are two matmuls whatever
the mix of adapters:

    h = x @ A_all^T                      [N, R]
    h = h * (column_slot == row_slot)    rows keep only their own adapter's columns
    y = inner(x) + h @ B_all^T

so a row without an adapter adds exact zeros. The fused GPU decode layer
(``fused_layer.py``) runs the same update inside its output kernels: it makes the first
product in the GEMM's launch and asks ``low_rank_of(low)`` for the tensors the kernel
masks and multiplies (``low_rank(x_in)``: the same with the product made here).

Public API:
- ``RowSlots``: what supplies the rows' slots (``AdapterBank``): ``token_slots(rows)``
  (int64 [rows], a persistent buffer that captured CUDA graphs read) and
  ``row_mask(columns, rows, dtype)`` ([rows, R] of 0/1).
- ``AdaptedLinear(inner, slots)``; ``set_adapters(a [R, in], b [out, R], columns [R])``;
  ``forward(x)``; ``low_rank(x_in[rows, in]) -> layer_kernels.LowRank``;
  ``low_rank_of(low[rows, R])``: the same from a first product made elsewhere (the
  fused layer makes it in the GEMM launch: ``layer_kernels.gemm_parts_low``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from exl3cli.engine.layers.linear import Linear
from exl3cli.ops.layer_kernels import LowRank, lora_low, lora_workspace


class RowSlots(Protocol):
    def token_slots(self, rows: int) -> torch.Tensor: ...

    def row_mask(self, columns: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor: ...


class AdaptedLinear(Linear):
    """`inner(x)` plus the low-rank updates of the adapters selected per row."""

    def __init__(self, inner: Linear, bank: RowSlots):
        super().__init__()
        self.inner = inner
        self.in_features, self.out_features = inner.in_features, inner.out_features
        self.__dict__["bank"] = bank  # not a submodule: the bank is shared
        self.register_buffer("lora_a", None, persistent=False)
        self.register_buffer("lora_bt", None, persistent=False)
        self.register_buffer("lora_columns", None, persistent=False)

    def set_adapters(self, a: torch.Tensor, b: torch.Tensor, columns: torch.Tensor) -> None:
        """a [R, in], b [out, R] (scales folded in), columns [R] int64 (slot per rank)."""
        self.lora_a, self.lora_bt, self.lora_columns = a.contiguous(), b.t().contiguous(), columns
        lora_workspace(a.device)  # before any graph capture reads it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        rows = x.reshape(-1, self.in_features)
        low = rows.to(self.lora_a.dtype) @ self.lora_a.t()
        low = low * self.bank.row_mask(self.lora_columns, rows.shape[0], low.dtype)
        return y + (low @ self.lora_bt).to(y.dtype).view(y.shape)

    def low_rank(self, x_in: torch.Tensor) -> LowRank:
        """The update of rows `x_in` [rows, in] for an output kernel: `x_in @ A_all^T`
        (one matmul), B_all^T and the slots of the rank columns and of the rows."""
        return self.low_rank_of(lora_low(x_in, self.lora_a))

    def low_rank_of(self, low: torch.Tensor) -> LowRank:
        """The update whose first product `low` [rows, R] (x_in @ A_all^T) is made."""
        return LowRank(low, self.lora_bt, self.lora_columns, self.bank.token_slots(low.shape[0]))

    def dense_weight(self) -> None:
        return None  # never folded: the update depends on the row
