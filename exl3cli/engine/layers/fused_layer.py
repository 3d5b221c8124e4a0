"""The fused decode path of one pre-norm layer with EXL3 linears on the GPU.

``DecoderLayer`` runs a layer as about 45 kernels per token: three per linear (input
Hadamard, GEMM, output Hadamard), and the norms, rotary, SiLU, products and residual
adds between them. At batch 1 every kernel is a few microseconds of launch and
latency, so those small kernels cost as much as the weights' bandwidth. Here one
layer is eleven launches plus the cache write and attention:

    norm + suh + H (q, k, v)   | GEMM (q, k, v)   | H + svh + bias + rotary (q, k, v)
    attention (``Attention.attend``: the cache write, then paged attention)
    suh + H (o)                | GEMM (o)         | H + svh + bias + residual
    norm + suh + H (gate, up)  | GEMM (gate, up)  | H + svh + act(gate) * up + suh + H (down)
    GEMM (down)                | H + svh + bias + residual

with the kernels of ``exl3cli.ops.layer_kernels`` (their PyTorch twins on CPU, which is
how the CPU tests check this module against ``DecoderLayer``). Every rounding to the
activation dtype happens where the unfused path rounds.

Layers with q/k norms (Qwen3) norm and rotate q and k after the q/k/v output kernel (it
would rotate before the norm): one more launch for per-head RMSNorm weights
(``layer_kernels.qk_norm_rope``), the module and PyTorch's rotary for other norms. A mixture-of-experts MLP
whose EXL3 experts run on the MoE decode kernels (``exl3cli/ops/moe_kernels.py``:
Mixtral, Qwen3-MoE) takes the place of the last five launches: ``MoEMLP.decode_block``
(by default the norm module, the router's linear, seven MoE kernels and the residual add;
with ``EXL3_MOE_DECODE=new`` six launches: norm + router + top-k in one, the residual in
the last).

``EXL3_LAYER_FOLD`` (``exl3cli/ops/layer_fold.py``) takes up to five more launches out:
"kv" stores the new keys/values in the q/k/v output kernel (fp16/bf16 cache of a fixed
decode step), "combine" makes the o input from attention's uncombined chunks, "norm"
runs the o output + the MLP's input side as one launch and the down output + the next
layer's input side as one (the next plan links itself at run time: ``successor``, the
hand-over in ``AttentionStep.carry``, taken only for the very tensor the layer returned).
"pro" (not in "all") has the q/k/v, o, gate/up and down GEMMs make their own input side
at 1..8 rows (``Parts.norm_gemm`` / ``Parts.glu_gemm``, ``ops/gemm_pro.py``): no
norm_hadamard or glu_hadamard launch, the same bits.

A projection wrapped in an ``AdaptedLinear`` (LoRA adapters, ``adapted_linear.py``) stays
on this path: the first low-rank product ``x_in @ A_all^T`` (one per input: q|k|v and
gate|up share theirs), on the normed input that ``norm_hadamard`` writes next to its
Hadamard outputs (for down: act(gate) * up from ``glu_hadamard``), is made by extra
blocks of the input's GEMM launch (``layer_kernels.gemm_parts_low``; no launch of its
own), and the output kernel masks it by the rows' adapter slots, multiplies by B^T and
adds it after svh and bias, before rotary, the activation or the residual, as
``AdaptedLinear`` does. The adapters' tensors and the rows' slots (a persistent
buffer) are read at every forward, never kept.

Public API:
- ``FusedDecodeLayer.of(layer, force=False) -> FusedDecodeLayer | None``: the plan
  for a plain pre-norm layer (RMSNorm, q/k norms allowed, no position query scale, no
  sandwich norms, a gated MLP with SiLU or tanh-GELU or an ``MoEMLP`` on the MoE
  kernels, every linear an ``Exl3Linear`` in trellis mode, or such a linear wrapped in
  an ``AdaptedLinear``), or None.
  Without ``force`` it also needs CUDA kernels and ``EXL3_FUSED_LAYER`` not "0".
- ``plan.accepts(x) -> bool`` (1..64 rows on the plan's device; with
  ``EXL3_PREFILL=fused`` also a prompt's rows, up to ``PREFILL_MAX_ROWS``, in a layer
  without MoE or adapters) and ``plan.forward(x[B, T, hidden], step) -> [B, T, hidden]``.

A prompt runs the same launches with each GEMM as decode + cuBLAS with float32 sums
(``layer_kernels.gemm_parts`` past 64 rows, ``cuda_kernels.dense_sums``): one norm, rotary,
activation and residual pass fewer per layer than ``DecoderLayer``'s ops, and no
float16 fold of svh into Ŵ (bench/NOTES-gpu.md, "Prefill at 2,048").
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from exl3cli.engine.layers.adapted_linear import AdaptedLinear
from exl3cli.engine.layers.attention import Attention, AttentionStep
from exl3cli.engine.layers.fused_parts import Parts
from exl3cli.engine.layers.linear import Exl3Linear, FusedLinear, Linear
from exl3cli.engine.layers.mlp import GatedMLP
from exl3cli.engine.layers.moe import MoEMLP
from exl3cli.engine.layers.norm import RMSNorm
from exl3cli.ops import cuda_kernels as kernels
from exl3cli.ops import gemm_pro, layer_fold, layer_kernels
from exl3cli.ops.batch_invariant import batch_invariant
from exl3cli.ops.reference import apply_rotary

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
PREFILL_MAX_ROWS = 65535  # norm_hadamard's grid has a row per z index


def _split(linear: Linear) -> list[Linear]:
    linear = _base(linear)
    return list(linear.parts) if isinstance(linear, FusedLinear) else [linear]


def _base(linear: Linear) -> Linear:
    return linear.inner if isinstance(linear, AdaptedLinear) else linear


def _adapted(linear: Linear) -> AdaptedLinear | None:
    return linear if isinstance(linear, AdaptedLinear) else None


def _plain_norm(norm: nn.Module) -> bool:
    return type(norm) is RMSNorm and norm.weight.dim() == 1


class FusedDecodeLayer:
    """See the module docstring."""

    def __init__(self, layer: nn.Module, qkv: Parts, o: Parts, gate_up: Parts | None,
                 down: Parts | None, activation: str):
        self.attention: Attention = layer.attention
        self.norm1 = layer.input_norm
        self.norm2 = layer.post_attention_norm
        self.norm1_weight = self.norm1.weight.float().contiguous()
        self.norm2_weight = self.norm2.weight.float().contiguous()
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.moe: MoEMLP | None = layer.mlp if isinstance(layer.mlp, MoEMLP) else None
        # The adapted projections (their current adapters are read at each forward).
        self.qkv_lora, self.o_lora = _adapted(layer.attention.qkv), _adapted(layer.attention.o)
        self.gate_up_lora = _adapted(getattr(layer.mlp, "gate_up", None))
        self.down_lora = _adapted(getattr(layer.mlp, "down", None))
        self.activation = activation
        self.device = qkv.trellises[0].device
        attention = self.attention
        heads, kv_heads, dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        self.qkv_width = (heads + 2 * kv_heads) * dim
        # Columns of each q/k/v part that rotate: the first (heads + kv_heads) * dim.
        rotating, start = (heads + kv_heads) * dim, 0
        self.rope_cols = []
        for width in qkv.widths:
            self.rope_cols.append(max(0, min(width, rotating - start)))
            start += width
        # q/k norms come before the rotation: then it is qk_norm_rope's (or PyTorch's).
        self.fused_rope = attention.rope and dim in (64, 128) and attention.qk_norm is None
        norm = attention.qk_norm
        # EXL3_LAYER_FOLD (ops/layer_fold.py): the cache write in the q/k/v output kernel
        # and the attention's chunk combine in the o input kernel, where they apply.
        # Both need q and k final out of the output kernel (no q/k norm, rotary there).
        plain = (attention.softcap is None and attention.sinks is None
                 and attention._query_factor is None and attention.qk_norm is None
                 and (self.fused_rope or not attention.rope))
        folds = layer_fold.active_folds()
        self.kv_ranges = (layer_fold.kv_ranges(qkv.widths, heads, kv_heads, dim)
                          if "kv" in folds and plain else None)
        self.fold_combine = ("combine" in folds and plain and self.o_lora is None
                             and dim in (64, 128, 256))
        self.fold_norm = ("norm" in folds and self.o_lora is None
                          and self.gate_up_lora is None and self.moe is None)
        self.counters = layer_fold.out_norm_counters(self.device) if self.fold_norm else None
        self.fold_pro = "pro" in folds  # input sides inside the GEMMs (ops/gemm_pro.py)
        self.pro_rows = gemm_pro.pro_rows() if self.fold_pro else 0
        # The next layer's plan, linked at run time (forward: the "norm" fold across layers).
        self.successor: FusedDecodeLayer | None = None
        self.qk_weight = None  # per-head RMSNorm weights [heads + kv heads, head_dim]
        if (type(norm) is RMSNorm and not norm.unit_offset
                and tuple(norm.weight.shape) == (heads + kv_heads, dim)):
            self.qk_weight = norm.weight.float().contiguous()

    @staticmethod
    def of(layer: nn.Module, force: bool = False) -> FusedDecodeLayer | None:
        attention, mlp = getattr(layer, "attention", None), getattr(layer, "mlp", None)
        if type(attention) is not Attention or type(mlp) not in (GatedMLP, MoEMLP):
            return None  # a subclass may compute what Attention.forward does differently
        if getattr(layer, "attention_out_norm", None) is not None:
            return None
        if getattr(attention, "position_query_scale", None) is not None:
            return None  # Ministral 3's per-position query scale lives in Attention.forward
        if not (_plain_norm(layer.input_norm) and _plain_norm(layer.post_attention_norm)):
            return None
        qkv, o = Parts.of(_split(attention.qkv)), Parts.of([_base(attention.o)])
        if qkv is None or o is None:
            return None
        heads, kv_heads, dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        if sum(qkv.widths) != (heads + 2 * kv_heads) * dim or o.pad_in < heads * dim:
            return None
        if isinstance(mlp, MoEMLP):
            if not mlp.on_kernels():
                return None
            gate_up = down = None
            activation = ""
        else:
            activation = _ACTIVATIONS.get(mlp.activation)
            gate_up, down = Parts.of(_split(mlp.gate_up)), Parts.of([_base(mlp.down)])
            if activation is None or gate_up is None or down is None or len(gate_up.widths) != 2:
                return None
            inter = gate_up.widths[0]
            if gate_up.widths[1] != inter or down.pad_in != _padded_out(mlp.gate_up):
                return None
        if not force:
            if os.environ.get("EXL3_FUSED_LAYER", "1") == "0":
                return None
            if qkv.trellises[0].device.type != "cuda" or not kernels.available():
                return None
        return FusedDecodeLayer(layer, qkv, o, gate_up, down, activation)

    def accepts(self, x: torch.Tensor) -> bool:
        rows = x.shape[0] * x.shape[1]
        if x.device != self.device or rows < 1:
            return False
        if rows <= kernels.FUSED_MAX_ROWS:
            return True
        # Batch-invariant mode: a prompt's rows take the unfused layer, whose EXL3 linears
        # run the fused GEMM per 64 rows (cuda_kernels.exl3_gemm), not decode + cuBLAS.
        return rows <= PREFILL_MAX_ROWS and not batch_invariant() and self._prefill_ok()

    def _prefill_ok(self) -> bool:
        """Whether a prompt's rows (more than FUSED_MAX_ROWS) take this path: with
        EXL3_PREFILL=fused, no MoE block, no adapter (their many-row products stay
        on the unfused path) and decode + cuBLAS available (cuda_kernels.dense_sums);
        EXL3_PREFILL=half: the same with float16 sums (Parts.half_sums)."""
        if kernels.prefill_mode() not in ("fused", "half") or self.moe is not None:
            return False
        if any(a is not None for a in (self.qkv_lora, self.o_lora, self.gate_up_lora,
                                       self.down_lora)):
            return False
        return kernels.dense_sums_available(self.device)

    def forward(self, x: torch.Tensor, step: AttentionStep) -> torch.Tensor:
        batch, steps, hidden = x.shape
        rows = batch * steps
        x2 = x.reshape(rows, hidden)
        attended, xo = self._attention(x2, step, batch, steps, self._carried(x, step))
        o_sums = None  # the "pro" fold: o's split sums, its input side made in its GEMM
        if xo is None and self._pro(rows) and self.o_lora is None:
            o_sums = self.o.norm_gemm(attended, None, None)
        elif xo is None:
            xo = layer_kernels.norm_hadamard(attended, None, 0.0, False, self.o.pres,
                                             self.o.pad_in)
        h = x2.new_empty(rows, hidden)
        mlp = self.gate_up
        if self.fold_norm and mlp is not None:
            partials = o_sums if o_sums is not None else self.o.gemm(xo)[0]
            xg, xu = layer_fold.out_norm(partials[0], self.o.posts[0], self.o.biases[0], x2, h,
                                         self.norm2_weight, self.norm2.eps,
                                         self.norm2.unit_offset, mlp.pres, mlp.pad_in,
                                         self.counters)
            return self._mlp(x, h, xg, xu, None, step)
        if o_sums is not None:
            layer_kernels.hadamard_out(o_sums, self.o.posts_for(o_sums), self.o.biases, [h], [0],
                                       residual=x2)
        else:
            self._project(self.o, xo, [h], residual=x2, adapted=self.o_lora, x_in=attended)
        if self.moe is not None:
            return self.moe.decode_block(h, self.norm2, self.norm2_weight).view(
                batch, steps, hidden)
        assert mlp is not None and self.down is not None
        if self._pro(rows) and self.gate_up_lora is None:
            return self._mlp(x, h, None, None, None, step)
        normed = x2.new_empty(rows, hidden) if self.gate_up_lora is not None else None
        xg, xu = layer_kernels.norm_hadamard(h, self.norm2_weight, self.norm2.eps,
                                             self.norm2.unit_offset, mlp.pres, mlp.pad_in,
                                             normed=normed)
        return self._mlp(x, h, xg, xu, normed, step)

    def _pro(self, rows: int) -> bool:
        """Whether the "pro" fold runs a step of `rows` rows (a decode step's few rows)."""
        return rows <= self.pro_rows

    def _carried(self, x: torch.Tensor, step: AttentionStep) -> list[torch.Tensor] | None:
        """The rotated q/k/v input the layer before made for this one (the "norm" fold
        across layers), or None. The hand-over holds only for the very tensor that layer
        returned (anything between the layers makes a new one); an unlinked producer is
        linked here, so from its next forward on it makes this layer's input."""
        carry, step.carry = getattr(step, "carry", None), None
        if carry is None or carry[1] is not x:
            return None
        producer, _, xhs = carry
        if not self.fold_norm or self.qkv_lora is not None:
            producer.successor = None  # e.g. an adapter arrived: this plan takes none
            return None
        if producer.successor is self:
            return xhs
        producer.successor = self
        return None

    def _mlp(self, x: torch.Tensor, h: torch.Tensor, xg: torch.Tensor | None,
             xu: torch.Tensor | None, normed: torch.Tensor | None,
             step: AttentionStep) -> torch.Tensor:
        """The gated MLP from its rotated inputs (None: the "pro" fold makes them inside
        the gate/up GEMM from h) and the residual h: the layer's output."""
        batch, steps, hidden = x.shape
        rows = batch * steps
        x2 = x.reshape(rows, hidden)
        mlp = self.gate_up
        assert mlp is not None and self.down is not None
        if xg is None or xu is None:
            (gate, up), lora = mlp.norm_gemm(h, self.norm2, self.norm2_weight), None
        else:
            (gate, up), lora = mlp.gemm([xg, xu], self.gate_up_lora, normed)
        inter = mlp.widths[0]
        product = x2.new_empty(rows, inter) if self.down_lora is not None else None
        down_sums = None  # the "pro" fold: down's split sums, its input made in its GEMM
        if self._pro(rows) and lora is None and product is None:
            down_sums = [self.down.glu_gemm(gate, up, mlp, self.activation, x.dtype)]
        else:
            posts = mlp.posts_for([gate])
            xd = layer_kernels.glu_hadamard(gate, up, posts[0], posts[1], mlp.biases[0],
                                            mlp.biases[1], inter, self.activation,
                                            self.down.pres[0], x.dtype, lora=lora,
                                            product=product)
        out = x2.new_empty(rows, hidden)
        nxt = self.successor if self.fold_norm and self.down_lora is None else None
        if nxt is None:
            if down_sums is not None:
                layer_kernels.hadamard_out(down_sums, self.down.posts_for(down_sums),
                                           self.down.biases, [out], [0], residual=h)
            else:
                self._project(self.down, [xd], [out], residual=h, adapted=self.down_lora,
                              x_in=product)
            result = out.view(batch, steps, hidden)
            if self.fold_norm and self.down_lora is None:
                step.carry = (self, result, None)  # the next layer links itself
            return result
        partials = down_sums if down_sums is not None else self.down.gemm([xd])[0]
        xhs = layer_fold.out_norm(partials[0], self.down.posts[0], self.down.biases[0], h, out,
                                  nxt.norm1_weight, nxt.norm1.eps, nxt.norm1.unit_offset,
                                  nxt.qkv.pres, nxt.qkv.pad_in, self.counters)
        result = out.view(batch, steps, hidden)
        step.carry = (self, result, xhs)
        return result

    def _attention(self, x2: torch.Tensor, step: AttentionStep, batch: int, steps: int,
                   xhs: list[torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """q/k/v from the normed input (rotated in the output kernel), the cache write and
        attention: the o projection's input (rows, heads * head_dim) and, where the chunk
        combine is folded (``fold_combine``), its rotated form (else None)."""
        attention = self.attention
        heads, kv_heads, dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        rows = x2.shape[0]
        normed = x2.new_empty(x2.shape) if self.qkv_lora is not None else None
        if xhs is None and self._pro(rows) and normed is None:  # the input side in the GEMM
            partials, lora = self.qkv.norm_gemm(x2, self.norm1, self.norm1_weight), None
        else:
            if xhs is None:  # else the layer before made them (the "norm" fold)
                xhs = layer_kernels.norm_hadamard(x2, self.norm1_weight, self.norm1.eps,
                                                  self.norm1.unit_offset, self.qkv.pres,
                                                  self.qkv.pad_in, normed=normed)
            partials, lora = self.qkv.gemm(xhs, self.qkv_lora, normed)
        qkv = x2.new_empty(rows, self.qkv_width)
        outs, start = [], 0
        for width in self.qkv.widths:
            outs.append(qkv[:, start : start + width])
            start += width
        cos = sin = None
        rope_cols = [0] * len(outs)
        if attention.rope:
            cos4, sin4 = step.rope(attention.local_rope)
            if self.fused_rope:
                cos, sin = cos4.reshape(rows, dim), sin4.reshape(rows, dim)
                rope_cols = self.rope_cols
        cache = step.cache
        target = None
        if self.kv_ranges is not None and hasattr(cache, "kv_target"):
            target = cache.kv_target(attention.layer_index, x2.dtype)
        if target is not None:
            layer_fold.hadamard_out_kv(partials, self.qkv.posts_for(partials), self.qkv.biases,
                                       outs, rope_cols, cos, sin, dim if cos is not None else 0,
                                       layer_fold.KvStore(*target, self.kv_ranges), lora=lora)
        else:
            layer_kernels.hadamard_out(partials, self.qkv.posts_for(partials), self.qkv.biases, outs,
                                       rope_cols, cos=cos, sin=sin,
                                       head_dim=dim if cos is not None else 0, lora=lora)
        qkv4 = qkv.view(batch, steps, heads + 2 * kv_heads, dim)
        if (target is not None or self.fold_combine) and hasattr(cache, "attend_parts"):
            return self._attend_folded(qkv, target is not None, step)
        qk = qkv4[:, :, : heads + kv_heads]
        if self.qk_weight is not None:
            rotate = attention.rope
            qk = layer_kernels.qk_norm_rope(
                qk.reshape(rows, heads + kv_heads, dim), self.qk_weight,
                attention.qk_norm.eps, cos4.reshape(rows, dim) if rotate else None,
                sin4.reshape(rows, dim) if rotate else None,
            ).view(batch, steps, heads + kv_heads, dim)
        elif attention.qk_norm is not None:
            qk = attention.qk_norm(qk)
        if attention.rope and not self.fused_rope and self.qk_weight is None:
            qk = apply_rotary(qk, cos4, sin4)
        attended = attention.attend(qk, qkv4[:, :, heads + kv_heads :], step)
        return attended.reshape(rows, -1), None

    def _attend_folded(self, qkv: torch.Tensor, written: bool, step: AttentionStep
                       ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """A fixed decode step's attention over qkv (rows, (H + 2 KV) * D; its rows, in
        order, are the step's rows) with the folds of ``layer_fold``: keys/values already
        stored (``written``), the chunk combine in the o input kernel (``fold_combine``)."""
        attention = self.attention
        heads, kv_heads, dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        rows = qkv.shape[0]
        qkv3 = qkv.view(rows, heads + 2 * kv_heads, dim)
        key = None if written else qkv3[:, heads : heads + kv_heads]
        value = None if written else qkv3[:, heads + kv_heads :]
        part_acc, part_ml, out = step.cache.attend_parts(
            attention.layer_index, qkv3[:, :heads], key, value, attention.window,
            combine=not self.fold_combine)
        attended = out.reshape(rows, heads * dim)
        if part_acc is None or part_ml is None:
            return attended, None
        return attended, [layer_fold.combine_hadamard(part_acc, part_ml, attended,
                                                      self.o.pres[0], self.o.pad_in)]

    def _project(self, parts: Parts, xhs: list[torch.Tensor], outs: list[torch.Tensor],
                 residual: torch.Tensor | None = None, adapted: AdaptedLinear | None = None,
                 x_in: torch.Tensor | None = None) -> None:
        partials, lora = parts.gemm(xhs, adapted, x_in)
        layer_kernels.hadamard_out(partials, parts.posts_for(partials), parts.biases, outs,
                                   [0] * len(outs), residual=residual, lora=lora)


def _padded_out(linear: Any) -> int:
    parts = _split(linear)
    return parts[0].padded_out if isinstance(parts[0], Exl3Linear) else -1
