"""Tensor-parallel shards: which slice of a checkpoint each rank holds, and reading it.

Rank r of N holds (Megatron's split, the one ExLlamaV3 and vLLM use):
- attention: KV heads [k0, k1) (KV heads must divide by N) and the query heads of
  those groups; q/k/v cut by columns (their heads), o_proj by rows, so the attention
  output is a partial sum (one all-reduce, engine/layers/parallel.py);
- dense MLP: gate/up columns and down rows [i0, i1) of the intermediate width (one
  all-reduce);
- mixture of experts: whole experts [e0, e1) (expert parallelism; the router on every
  rank, the shared expert on rank 0), one all-reduce of the block's output;
- embedding rows and head columns [v0, v1) of the vocabulary (cut on 128-row blocks).
EXL3 modules are cut on whole 128-wide Hadamard blocks without re-quantizing
(codec/split.py); a cut that misses a block is refused before anything loads. Dense
tensors are cut anywhere.

Public API:
- ``ShardPlan`` and ``plan_shards(config, spec, names, reader, rank, world)``
  (refuses what cannot be split: ``ModelLoadError`` with the reason).
- ``local_config(config, plan)``: the config a rank's model is built from.
- ``ShardedReader(reader, names, spec, config, plan)``: ``has``/``get``/``keys`` of the
  rank's slice; ``absent(prefix)`` names the modules another rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from exl3cli.codec.format import read_exl3_linear
from exl3cli.codec.split import BLOCK, check_cut, slice_exl3
from exl3cli.engine.spec.architecture import ArchitectureSpec, TensorNames
from exl3cli.engine.spec.config import ModelConfig
from exl3cli.errors import ModelLoadError

Range = tuple[int, int]


def split_range(total: int, world: int, rank: int, unit: int = 1) -> Range:
    """Rank `rank`'s part of `total` items cut in `unit`s as evenly as possible (the
    first ranks take one unit more); the last part ends at `total`."""
    units = -(-total // unit)
    base, extra = divmod(units, world)
    first = rank * base + min(rank, extra)
    count = base + (1 if rank < extra else 0)
    return min(total, first * unit), min(total, (first + count) * unit)


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `world`: its heads, KV heads, intermediate columns, vocabulary
    rows and experts (ranges over the whole model's)."""

    rank: int
    world: int
    heads: Range
    kv_heads: Range
    inter: Range
    vocab: Range
    vocab_sizes: tuple[int, ...]  # every rank's vocabulary slice width
    experts: Range  # (0, 0) without a mixture

    def owns_expert(self, e: int) -> bool:
        return self.experts[0] <= e < self.experts[1]


def _refuse(message: str) -> ModelLoadError:
    return ModelLoadError(f"tensor parallel: {message}")


def plan_shards(config: ModelConfig, spec: ArchitectureSpec, names: TensorNames,
                reader: Any, rank: int, world: int) -> ShardPlan:
    """What rank `rank` of `world` holds; refuses models that cannot be split."""
    if world < 1 or not 0 <= rank < world:
        raise _refuse(f"rank {rank} of {world}")
    if spec.mla:
        raise _refuse("latent attention (DeepSeek-V3 MLA) is not split across ranks")
    if spec.uses_qk_norm(config) and spec.qk_norm == "rms_full":
        raise _refuse(f"{config.architecture} normalises q and k over all heads at once")
    if names.qkv_fused or names.gate_up_fused:
        raise _refuse("checkpoints with fused q/k/v or gate/up matrices are not split; "
                      "convert the model to EXL3 first (it stores them split)")
    heads, kv = config.num_heads, config.num_kv_heads
    if kv % world or heads % kv:
        raise _refuse(f"{kv} KV heads do not divide over {world} ranks (each rank needs "
                      "whole KV heads: use a width that divides the KV heads)")
    quantized = reader.has(names.q_proj.format(i=0) + ".trellis")
    k0, k1 = split_range(kv, world, rank)
    group = heads // kv
    inter = split_range(config.intermediate_size, world, rank, BLOCK if quantized else 1)
    vocab_sizes = tuple(b - a for a, b in (split_range(config.vocab_size, world, r, BLOCK)
                                           for r in range(world)))
    if min(vocab_sizes) < 1:
        raise _refuse(f"a vocabulary of {config.vocab_size} has too few 128-row blocks "
                      f"for {world} ranks")
    experts = (0, 0)
    if spec.moe is not None:
        experts = split_range(spec.moe.num_experts(config), world, rank)
    plan = ShardPlan(rank, world, (k0 * group, k1 * group), (k0, k1), inter,
                     split_range(config.vocab_size, world, rank, BLOCK), vocab_sizes, experts)
    if quantized:
        _check_blocks(config, plan)
    return plan


def _check_blocks(config: ModelConfig, plan: ShardPlan) -> None:
    """The refusal for EXL3 cuts off 128-wide blocks, before any weight is read."""
    d = config.head_dim
    for what, (a, b), scale, total in (
            ("query heads", plan.heads, d, config.num_heads),
            ("KV heads", plan.kv_heads, d, config.num_kv_heads),
            ("intermediate columns", plan.inter, 1, config.intermediate_size)):
        if a < b:
            check_cut(a * scale, b * scale, total * scale,
                      f"{config.architecture} {what} [{a}, {b}) x {scale}")


def local_config(config: ModelConfig, plan: ShardPlan) -> ModelConfig:
    """The rank's model as the loader builds it: its heads, width and vocabulary."""
    return replace(config, num_heads=plan.heads[1] - plan.heads[0],
                   num_kv_heads=plan.kv_heads[1] - plan.kv_heads[0],
                   intermediate_size=max(0, plan.inter[1] - plan.inter[0]),
                   vocab_size=plan.vocab[1] - plan.vocab[0])


@dataclass(frozen=True)
class _Cut:
    dim: str  # "out": columns of W (rows of an HF weight); "in": its input rows
    start: int
    end: int
    logical: int


class ShardedReader:
    """A `WeightReader` view of one rank's slice (module docstring)."""

    def __init__(self, reader: Any, names: TensorNames, spec: ArchitectureSpec,
                 config: ModelConfig, plan: ShardPlan):
        self.reader, self.names, self.plan = reader, names, plan
        d = config.head_dim
        (h0, h1), (k0, k1), (i0, i1) = plan.heads, plan.kv_heads, plan.inter
        q_width, kv_width, inter = config.num_heads * d, config.num_kv_heads * d, \
            config.intermediate_size
        self._cuts: dict[str, _Cut] = {}
        self._heads: dict[str, tuple[Range, bool]] = {}
        self._absent: set[str] = set()
        moe = spec.moe
        for i in range(config.num_layers):
            cuts = {names.q_proj: _Cut("out", h0 * d, h1 * d, q_width),
                    names.k_proj: _Cut("out", k0 * d, k1 * d, kv_width),
                    names.v_proj: _Cut("out", k0 * d, k1 * d, kv_width),
                    names.o_proj: _Cut("in", h0 * d, h1 * d, q_width)}
            if i0 < i1:
                cuts.update({names.gate_proj: _Cut("out", i0, i1, inter),
                             names.up_proj: _Cut("out", i0, i1, inter),
                             names.down_proj: _Cut("in", i0, i1, inter)})
            for template, cut in cuts.items():
                self._cuts[template.format(i=i)] = cut
            self._heads[names.sinks.format(i=i)] = (plan.heads, True)
            self._heads[names.q_norm.format(i=i)] = (plan.heads, False)
            self._heads[names.k_norm.format(i=i)] = (plan.kv_heads, False)
            if moe is not None:
                for e in range(moe.num_experts(config)):
                    if not plan.owns_expert(e):
                        self._absent.update(n.format(i=i, e=e) for n in
                                            (moe.gate_proj, moe.up_proj, moe.down_proj))
                if plan.rank != 0:  # the shared expert runs on rank 0 only
                    self._absent.update(n.format(i=i) for n in (
                        moe.shared_gate_proj, moe.shared_up_proj, moe.shared_down_proj,
                        moe.shared_expert_gate) if n)
        head = names.lm_head.removesuffix(".weight")
        self._cuts[head] = _Cut("out", *plan.vocab, config.vocab_size)
        self._sliced: tuple[str, dict[str, torch.Tensor]] | None = None

    def keys(self) -> list[str]:
        return self.reader.keys()

    def has(self, name: str) -> bool:
        return self.reader.has(name)

    def absent(self, prefix: str) -> bool:
        """Whether module `prefix` belongs to another rank (not read here)."""
        return prefix in self._absent

    def get(self, name: str, dtype: torch.dtype | None = None,
            device: torch.device | str | None = None) -> torch.Tensor:
        tensor = self._slice(name)
        if dtype is not None or device is not None:
            tensor = tensor.to(dtype=dtype or tensor.dtype, device=device or tensor.device)
        return tensor

    def _slice(self, name: str) -> torch.Tensor:
        if name == self.names.embed:
            v0, v1 = self.plan.vocab
            return self.reader.get(name)[v0:v1]
        if name in self._heads:
            (a, b), always = self._heads[name]
            tensor = self.reader.get(name)
            # sinks: one per query head; q/k norms only when stored per head (Cohere),
            # a [head_dim] weight shared by all heads is every rank's.
            return tensor[a:b] if always or tensor.dim() == 2 else tensor
        prefix, _, suffix = name.rpartition(".")
        cut = self._cuts.get(prefix)
        if cut is None:
            return self.reader.get(name)
        if self.reader.has(f"{prefix}.trellis"):
            return self._exl3(prefix, cut)[suffix]
        tensor = self.reader.get(name)
        if suffix == "bias":
            if cut.dim == "in":  # a row-parallel bias is added once: on rank 0
                return tensor if self.plan.rank == 0 else torch.zeros_like(tensor)
            return tensor.reshape(-1)[cut.start : cut.end]
        if suffix != "weight" or tensor.dim() != 2:
            return tensor
        if cut.dim == "out":
            return tensor[cut.start : cut.end]
        return tensor[:, cut.start : cut.end]

    def _exl3(self, prefix: str, cut: _Cut) -> dict[str, torch.Tensor]:
        if self._sliced is None or self._sliced[0] != prefix:
            found = read_exl3_linear(self.reader, prefix)
            if found is None:
                raise ModelLoadError(f"{prefix} has no .trellis")
            sliced = slice_exl3(found, cut.dim, cut.start, cut.end, cut.logical, prefix)
            if cut.dim == "in" and self.plan.rank != 0 and "bias" in sliced:
                sliced["bias"] = torch.zeros_like(sliced["bias"])
            self._sliced = (prefix, sliced)
        return self._sliced[1]
