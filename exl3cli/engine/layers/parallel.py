"""The layer pieces of tensor parallelism: partial results summed across ranks.

Each rank holds a slice of every layer (engine/models/shard.py): its attention heads
and KV heads, its columns of gate/up, its rows of o_proj and down_proj, its experts of
a mixture, its slice of the vocabulary. Column slices need no communication; a row
slice gives a partial sum, so the attention output and the MLP output each take one
all-reduce (`ReducedLinear` around o_proj and down_proj, `ReducedModule` around a
mixture of experts, whose experts live on different ranks). The embedding and the head
are split by vocabulary: `VocabShard` looks up the rank's rows (zeros elsewhere, then
an all-reduce) and gathers the logits of every rank's slice.

The communication itself is a `Collective` (engine/generation/tp_group.py over
torch.distributed: NCCL on GPUs, gloo on CPU); this module only needs its two calls.

Public API:
- ``Collective`` (Protocol): ``rank``, ``world``, ``all_reduce(t) -> t`` (sum, in
  place), ``all_gather(t) -> list[t]`` (equal shapes).
- ``ReducedLinear(inner, group)``, ``ReducedModule(inner, group)``: ``inner``'s output
  all-reduced.
- ``AbsentLinear(in, out)``: a projection this rank does not hold (an expert of
  another rank); never run (``MoEMLP`` skips experts made of it).
- ``VocabShard(start, end, vocab, group)``: ``embed(ids, weight)``, ``gather(logits)``.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from exl3cli.engine.layers.linear import Linear


class Collective(Protocol):
    """What the layers need from a tensor-parallel group."""

    rank: int
    world: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        ...

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape on all), in rank order."""
        ...


class ReducedLinear(Linear):
    """A row-parallel projection: this rank's partial product, summed over ranks."""

    def __init__(self, inner: Linear, group: Collective):
        super().__init__()
        self.inner = inner
        self.group = group
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x).contiguous())


class ReducedModule(nn.Module):
    """Any block whose output is a sum over ranks (a mixture whose experts are split)."""

    def __init__(self, inner: nn.Module, group: Collective):
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x).contiguous())


class AbsentLinear(Linear):
    """A projection held by another rank (expert parallelism): it has a shape, no
    weights, and is never run."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an expert of another tensor-parallel rank was run here")


class VocabShard:
    """This rank's vocabulary rows [start, end) of `vocab` (the embedding table and the
    head hold those rows only)."""

    def __init__(self, start: int, end: int, vocab: int, group: Collective, sizes: list[int]):
        self.start, self.end, self.vocab = start, end, vocab
        self.group = group
        self.sizes = sizes  # every rank's slice width, in rank order
        self.width = max(sizes)

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor,
              dtype: torch.dtype) -> torch.Tensor:
        """Rows of ids in this slice, zeros for the others, summed over ranks: every id
        gets exactly its one row."""
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.end - self.start)
        rows = F.embedding(local.clamp(0, self.end - self.start - 1), weight).to(dtype)
        rows = rows * inside[..., None].to(dtype)
        return self.group.all_reduce(rows.contiguous())

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """This slice's logits [..., end - start] -> the whole vocabulary [..., vocab]."""
        pad = self.width - logits.shape[-1]
        padded = F.pad(logits, (0, pad)) if pad else logits
        pieces = self.group.all_gather(padded.contiguous())
        return torch.cat([p[..., :size] for p, size in zip(pieces, self.sizes, strict=True)],
                         dim=-1)
