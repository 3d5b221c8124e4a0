"""Mixture-of-experts MLP: a router picks `top_k` experts per token, each a gated MLP.

Tokens are grouped by expert: the (token, expert) pairs are sorted by expert, each
expert runs one batched forward over the rows routed to it (a loop over the experts
that received tokens, never over tokens), and the weighted outputs are scattered back
with one index_add. Experts and the router are `Linear`s (dense or EXL3, see
engine/layers/linear.py), so quantized experts decode exactly like any other layer. An
optional shared expert runs on every token, scaled by sigmoid(x . w) when the family
gates it (Qwen2-MoE).

Public API:
- ``Router(gate, top_k, scoring="softmax", normalize=True, score_bias=None,
  n_group=1, topk_group=1, scale=1.0)``: ``forward(rows[N, H]) -> (weights[N, k]
  float32, experts[N, k] long)``.
- ``MoEMLP(router, experts, shared=None, shared_gate=None)``: ``forward(x[..., H])``;
  ``last_counts`` holds the tokens each expert received in the latest grouped call;
  ``stack_experts()`` turns on the sync-free path for decode-sized calls
  (moe_decode.py). EXL3 experts on CUDA run calls of up to 64 rows on the MoE decode
  kernels (``exl3cli/ops/moe_kernels.py``: sync-free, graph-capturable); longer calls
  (prefill) run them on consecutive slices of 64 rows (``KERNEL_CHUNK_ROWS``): one host
  sync-free pass per slice instead of the grouped dispatch's Python loop over experts,
  which cost ~1.5 s per 128-token prompt on a Qwen3-30B-A3B shape (bench/NOTES-gpu.md,
  session 7). ``EXL3_MOE_PREFILL=grouped`` keeps long calls on the grouped dispatch.
- ``MoEMLP.decode_block(h, norm, norm_weight) -> h + self(norm(h))``: the fused decode
  layer's MoE half. With ``EXL3_MOE_DECODE=new`` (the default since run 35: 1.09x "old" at one job on the
  Qwen3-30B-A3B shape, 1.06x on Mixtral-8x7B) and a
  plain softmax router with a dense weight on the kernels, the norm, router, top-k and plan are one launch and
  the residual is added by the last kernel (``exl3cli/ops/moe_block.py``; six launches
  in all; ``EXL3_MOE_DECODE=combine``: five, the down GEMM summing the experts itself);
  ``EXL3_MOE_DECODE=old`` runs the norm module, the router's linear and
  ``forward`` (bench/NOTES-gpu.md, "MoE one-job (issue 14, session 8)").
- ``build_moe_mlp(config, moe, i, tensor, linear, activation) -> MoEMLP``: layer `i`'s
  block as a family's MoESpec describes it (the loader and the converter use it).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

from exl3cli.engine.layers.linear import Linear
from exl3cli.engine.layers.mlp import GatedMLP
from exl3cli.engine.layers.moe_decode import (
    SYNC_FREE_MAX_PAIRS,
    StackedExperts,
    exl3_expert_tables,
)
from exl3cli.engine.layers.parallel import AbsentLinear
from exl3cli.engine.spec.architecture import MoESpec
from exl3cli.engine.spec.config import ModelConfig
from exl3cli.errors import InvalidSetting, ModelLoadError, UnsupportedArchitecture
from exl3cli.ops import moe_block, moe_kernels
from exl3cli.ops.cuda_kernels import FUSED_MAX_ROWS

SCORINGS = ("softmax", "sigmoid", "topk_softmax")
KERNEL_CHUNK_ROWS = FUSED_MAX_ROWS  # the MoE decode kernels' largest call


class Router(nn.Module):
    """Expert choice and weights per token (module docstring; MoESpec for `scoring`)."""

    def __init__(self, gate: Linear, top_k: int, scoring: str = "softmax",
                 normalize: bool = True, score_bias: torch.Tensor | None = None,
                 n_group: int = 1, topk_group: int = 1, scale: float = 1.0):
        super().__init__()
        if scoring not in SCORINGS:
            raise UnsupportedArchitecture(f"unsupported router scoring {scoring!r}")
        num_experts = gate.out_features
        if not 1 <= top_k <= num_experts:
            raise ModelLoadError(f"num_experts_per_tok {top_k} must be in 1..{num_experts}")
        if n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ModelLoadError(f"cannot route {num_experts} experts in {n_group} groups "
                                 f"keeping {topk_group}")
        self.gate = gate
        self.top_k = top_k
        self.scoring = scoring
        self.normalize = normalize
        self.register_buffer("score_bias", None if score_bias is None else score_bias.float(),
                             persistent=False)
        self.n_group, self.topk_group = n_group, topk_group
        self.scale = scale

    @property
    def num_experts(self) -> int:
        return self.gate.out_features

    @property
    def plain_softmax(self) -> bool:
        """Softmax scores, top-k, optional renormalisation and scale, nothing else: what
        the MoE routing kernel computes itself (ops/moe_kernels.moe_experts_routed)."""
        return (self.scoring == "softmax" and self.score_bias is None and self.n_group == 1
                and self.num_experts <= moe_kernels.ROUTER_MAX_EXPERTS)

    def forward(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(rows).float()
        if self.scoring == "topk_softmax":
            biased = logits if self.score_bias is None else logits + self.score_bias
            top, experts = torch.topk(biased, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1) * self.scale, experts
        scores = torch.softmax(logits, dim=-1) if self.scoring == "softmax" else logits.sigmoid()
        choice = scores if self.score_bias is None else scores + self.score_bias
        if self.n_group > 1:
            choice = self._keep_best_groups(choice)
        experts = torch.topk(choice, self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (
                1e-20 if self.scoring == "sigmoid" else 0.0))
        return weights * self.scale if self.scale != 1.0 else weights, experts

    def _keep_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Grouped top-k: a group scores the sum of its two best experts; experts outside
        the `topk_group` best groups are never chosen."""
        rows = choice.shape[0]
        grouped = choice.view(rows, self.n_group, -1)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        best = group_scores.topk(self.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(rows, -1)


class MoEMLP(nn.Module):
    """Routed experts (+ an optional shared expert), see the module docstring."""

    def __init__(self, router: Router, experts: list[GatedMLP],
                 shared: GatedMLP | None = None, shared_gate: Linear | None = None):
        super().__init__()
        if len(experts) != router.num_experts:
            raise ModelLoadError(f"router scores {router.num_experts} experts, "
                                 f"{len(experts)} given")
        self.router = router
        self.experts = nn.ModuleList(experts)
        self.shared = shared
        self.shared_gate = shared_gate
        self.last_counts: list[int] = []
        self.stacked: StackedExperts | None = None  # see stack_experts
        self._absent = [isinstance(e.down, AbsentLinear) for e in experts]
        self._tables: moe_kernels.ExpertTables | None | bool = False  # False: not built yet
        self._counter: torch.Tensor | None = None  # moe_block's finished-blocks counter

    def stack_experts(self) -> bool:
        """Stack the experts' dense weights (a second copy) so that decode-sized calls
        run without host syncs (moe_decode.py); False when some expert has none."""
        if any(self._absent):  # expert parallelism: some experts live on other ranks
            return False
        self.stacked = StackedExperts.of(list(self.experts))  # type: ignore[arg-type]
        return self.stacked is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        tables = self.kernel_tables(rows)
        if tables is not None:
            out = rows.new_empty(rows.shape)  # contiguous: the kernels' output layout
            for start in range(0, rows.shape[0], KERNEL_CHUNK_ROWS):
                end = start + KERNEL_CHUNK_ROWS
                self._on_kernels(rows[start:end], tables, out[start:end])
            return self._add_shared(rows, out).view(shape)
        weights, chosen = self.router(rows)
        if self.stacked is not None and chosen.numel() <= SYNC_FREE_MAX_PAIRS:
            out = self.stacked(rows, weights, chosen)
        else:
            out = self._routed(rows, weights, chosen)
        return self._add_shared(rows, out).view(shape)

    def _on_kernels(self, rows: torch.Tensor, tables: moe_kernels.ExpertTables,
                    out: torch.Tensor) -> None:
        """The routed experts of <= 64 rows on the MoE decode kernels, into `out` (router
        fused into the routing kernel when it is a plain softmax)."""
        router = self.router
        if router.plain_softmax:
            moe_kernels.moe_experts_routed(rows, router.gate(rows), router.top_k,
                                           router.normalize, router.scale, tables, out=out)
        else:
            weights, chosen = router(rows)
            moe_kernels.moe_experts(rows, weights, chosen, tables, out=out)

    def _add_shared(self, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.shared is not None:
            shared = self.shared(rows)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(self.shared_gate(rows))
            out = out + shared
        return out

    def on_kernels(self) -> bool:
        """Whether decode-sized CUDA calls run the MoE decode kernels (EXL3 experts in
        trellis mode on CUDA that they support; the tables are built here once)."""
        if self._tables is False:
            self._tables = exl3_expert_tables(list(self.experts))  # type: ignore[arg-type]
            if self._tables is not None:  # zeroed once here, never inside a graph capture
                self._counter = torch.zeros(moe_block.counters_for(self._tables),
                                            dtype=torch.int32,
                                            device=self._tables.pointers[0].device)
        return self._tables is not None

    def decode_block(self, h: torch.Tensor, norm: nn.Module,
                     norm_weight: torch.Tensor) -> torch.Tensor:
        """``h + self(norm(h))`` (module docstring); `norm` an RMSNorm, `norm_weight` its
        weight as contiguous float32 (the fused layer's copy)."""
        rows = h.reshape(-1, h.shape[-1])
        variant = _decode_variant()
        weight = self._block_router(rows) if variant != "old" else None
        if weight is None:
            return h + self(norm(h))
        router = self.router
        out, normed, _, _ = moe_block.moe_block(
            rows, norm_weight, norm.eps, norm.unit_offset, weight, router.top_k,
            router.normalize, router.scale, self._tables, self._counter,  # type: ignore[arg-type]
            residual=self.shared is None, combine=variant == "combine")
        if self.shared is not None:  # h + (experts + shared), as forward rounds it
            out = rows + self._add_shared(normed, out)
        return out.view(h.shape)

    def _block_router(self, rows: torch.Tensor) -> torch.Tensor | None:
        """The router's dense weight when decode_block runs moe_block's fused kernels on
        these rows, else None."""
        router = self.router
        if not rows.is_cuda or not router.plain_softmax or not self.on_kernels():
            return None
        gate = router.gate
        weight = getattr(gate, "weight", None)
        if (getattr(gate, "bias", None) is not None or not isinstance(weight, torch.Tensor)
                or getattr(gate, "cpu_weights", None) is not None
                or getattr(gate, "mode", "dense") != "dense"):
            return None
        tables = self._tables
        if not moe_block.runs_on_kernels(rows, weight, router.top_k, tables):  # type: ignore[arg-type]
            return None
        return weight

    def kernel_tables(self, rows: torch.Tensor) -> moe_kernels.ExpertTables | None:
        """The MoE decode kernels' tables when they run these rows (CUDA, EXL3 experts
        they support; calls past 64 rows in slices of 64 unless EXL3_MOE_PREFILL=grouped),
        else None (built on the first CUDA call)."""
        if not rows.is_cuda or not self.on_kernels():
            return None
        tables = self._tables
        if rows.shape[0] > KERNEL_CHUNK_ROWS and _grouped_prefill():
            return None
        if tables is None or not moe_kernels.runs_on_kernels(
                rows[:KERNEL_CHUNK_ROWS], tables):  # type: ignore[arg-type]
            return None
        return tables  # type: ignore[return-value]

    def _routed(self, rows: torch.Tensor, weights: torch.Tensor,
                chosen: torch.Tensor) -> torch.Tensor:
        """Sum over each token's experts of weight * expert(token), grouped by expert."""
        top_k = chosen.shape[1]
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // top_k  # the row each sorted (token, expert) pair reads
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        self.last_counts = counts
        picked = rows.index_select(0, token)
        # Experts held by other tensor-parallel ranks (AbsentLinear) add nothing here:
        # their rows stay zero and the ranks' sums are added up after the block.
        absent = self._absent
        outputs = torch.zeros_like(picked) if any(absent) else torch.empty_like(picked)
        start = 0
        for expert, count, away in zip(self.experts, counts, absent, strict=True):
            if count and not away:
                outputs[start : start + count] = expert(picked[start : start + count])
            start += count
        scaled = outputs * weights.reshape(-1)[order, None].to(outputs.dtype)
        return torch.zeros_like(rows).index_add_(0, token, scaled)


def _grouped_prefill() -> bool:
    """EXL3_MOE_PREFILL: "kernels" (default) or "grouped" for calls past 64 rows."""
    choice = os.environ.get("EXL3_MOE_PREFILL", "kernels") or "kernels"
    if choice not in ("kernels", "grouped"):
        raise InvalidSetting(f"EXL3_MOE_PREFILL={choice!r}: use 'kernels' or 'grouped'")
    return choice == "grouped"


MOE_DECODE_VARIANTS = ("new", "combine", "old")


def _decode_variant() -> str:
    """EXL3_MOE_DECODE: "new" (moe_block's fused norm-route and residual), "combine"
    (new + the down GEMM doing moe_out's sum) or "old" (the norm module, the router's
    linear and the MoE kernels after them). "new" by default: its cuda tests passed on
    the H200 and it was the fastest at one job (bench/NOTES-gpu.md runs 35-36)."""
    choice = os.environ.get("EXL3_MOE_DECODE", "new") or "new"
    if choice not in MOE_DECODE_VARIANTS:
        raise InvalidSetting(f"EXL3_MOE_DECODE={choice!r}: use 'new', 'combine' or 'old'")
    return choice


LinearFactory = Callable[[list[str], list[tuple[int, int]], bool], Linear]


def _score_bias(moe: MoESpec, i: int,
                tensor: Callable[[str], torch.Tensor]) -> torch.Tensor | None:
    """Layer `i`'s choice bias under the family's name, else under ExLlamaV3's
    (`<router>.e_score_correction_bias`: its ERNIE 4.5 MoE folders)."""
    if not moe.score_bias:
        return None
    name = moe.score_bias.format(i=i)
    peer = moe.router.format(i=i) + ".e_score_correction_bias"
    try:
        return tensor(name)
    except ModelLoadError:
        if peer == name:
            raise
    try:
        return tensor(peer)
    except ModelLoadError as exc:
        raise ModelLoadError(f"the router's choice bias is missing: neither {name!r} nor "
                             f"{peer!r} is in the folder") from exc


def build_moe_mlp(config: ModelConfig, moe: MoESpec, i: int,
                  tensor: Callable[[str], torch.Tensor], linear: LinearFactory,
                  activation: str, bias: bool = False) -> MoEMLP:
    """Layer `i`'s experts, router and shared expert, named as `moe` says; linears come
    from `linear(prefixes, [(in, out)], bias)` (gate and up fused per expert)."""
    raw, hidden = config.raw, config.hidden_size
    num_experts = moe.num_experts(config)
    size = int(raw.get(moe.expert_size_key) or 0)
    if num_experts < 1 or size < 1:
        raise ModelLoadError(f"config.json needs {moe.experts_keys[0]} and {moe.expert_size_key} "
                             "for a mixture-of-experts model")

    act = moe.activation or activation
    clamp = {"limit": float(raw.get("swiglu_limit") or 7.0),
             "alpha": float(raw.get("swiglu_alpha") or 1.702)}

    def gated(names: tuple[str, str, str], width: int, **index: int) -> GatedMLP:
        gate, up, down = (n.format(i=i, **index) for n in names)
        gate_up = linear([gate, up], [(hidden, width), (hidden, width)], bias)
        return GatedMLP(gate_up, linear([down], [(width, hidden)], bias), act, **clamp)

    experts = [gated((moe.gate_proj, moe.up_proj, moe.down_proj), size, e=e)
               for e in range(num_experts)]
    normalize = moe.normalize
    if moe.normalize_key is not None and raw.get(moe.normalize_key) is not None:
        normalize = bool(raw[moe.normalize_key])
    router = Router(
        linear([moe.router.format(i=i)], [(hidden, num_experts)], moe.router_bias),
        moe.top_k(config), moe.scoring, normalize,
        _score_bias(moe, i, tensor),
        int(raw.get("n_group") or 1), int(raw.get("topk_group") or 1),
        float(raw.get("routed_scaling_factor") or 1.0),
    )
    shared = shared_gate = None
    width = moe.shared_size(config)
    if width and moe.shared_gate_proj and moe.shared_up_proj and moe.shared_down_proj:
        shared = gated((moe.shared_gate_proj, moe.shared_up_proj, moe.shared_down_proj), width)
        if moe.shared_expert_gate:
            shared_gate = linear([moe.shared_expert_gate.format(i=i)], [(hidden, 1)], False)
    return MoEMLP(router, experts, shared, shared_gate)

