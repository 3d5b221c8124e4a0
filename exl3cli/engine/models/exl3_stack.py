"""A whole stack's decode step on the CPU in one op call (EXL3 weights kept compressed).

``DecoderLayer._decode_rows`` already runs a plain layer's decode step in two op calls
(engine/layers/cpu_exl3.Exl3DecodePlan); between them Python writes the cache and
attends, and every call re-packs the layer's weight lists: ~30% of a SmolLM2-shape token
was that Python and dispatcher work (bench/NOTES-cpu-exl3.md). Here every layer of the
model runs inside ``ops/cpu_exl3_layer.exl3_decode_stack_cpu`` (q|k|v, the paged cache
write, attention, o and the MLP per layer), with its flat arguments built once.

Public API:
- ``Exl3DecodeStack.of(layers, DecoderLayer) -> Exl3DecodeStack | None``: runs of
  consecutive plain ``DecoderLayer``s with an ``Exl3DecodePlan`` (one codebook, one head
  layout, no query scale) go through the op, any other layer in between runs as before; None when no
  layer qualifies. ``EXL3_CPU_STACK=0`` turns it off (A/B runs).
- ``stack.run(hidden [1, N, E], step, layers=None) -> [1, N, E] | None``: None when the
  model's layers are no longer the ones it was built from, the step is not
  decode rows only on a float32 CPU paged cache, a layer's projections were replaced
  since (a LoRA adapter), or a layer or projection has forward hooks (streamed layers,
  calibration captures): the caller then runs the layers one by one.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from exl3cli.engine.layers.attention import AttentionStep
from exl3cli.engine.layers.cpu_exl3 import Exl3DecodePlan
from exl3cli.engine.layers.linear import GEMV_MAX_ROWS
from exl3cli.ops.cpu_exl3_layer import Exl3StackWeights, exl3_decode_stack_cpu, stack_args


def _modules(layer: Any) -> tuple[Any, ...]:
    attention, mlp = layer.attention, layer.mlp
    return (getattr(attention, "qkv", None), getattr(attention, "o", None),
            getattr(mlp, "gate_up", None), getattr(mlp, "down", None))


def _hooked(modules: tuple[Any, ...]) -> bool:
    """Whether forward hooks would see these modules run (streamed layers' copies, a
    converter's captures): the op would skip them."""
    return any(m is not None and (m._forward_pre_hooks or m._forward_hooks) for m in modules)


class Exl3DecodeStack:
    """See the module docstring."""

    def __init__(self, layers: list[Any], segments: list[tuple[int, int, Any]]):
        self._layers = layers
        self._modules = [_modules(layer) for layer in layers]
        # (begin, end, (stack, flat args)) for a run of EXL3 layers; (begin, end, None)
        # for layers run one by one (dense or other layers in between).
        self.segments = segments

    @staticmethod
    def of(layers: Any, plain: type) -> Exl3DecodeStack | None:
        """`plain`: the decoder layer class whose instances (not subclasses) qualify."""
        if os.environ.get("EXL3_CPU_STACK", "1") == "0" or len(layers) == 0:
            return None
        plans = [_plain_exl3(layer, i, plain) for i, layer in enumerate(layers)]
        segments: list[tuple[int, int, Any]] = []
        begin = 0
        for i in range(1, len(layers) + 1):
            if i == len(layers) or (plans[i] is None) != (plans[begin] is None) or (
                    plans[i] is not None and plans[i][1:] != plans[begin][1:]):
                segments.append((begin, i, _stack(layers, plans, begin, i)))
                begin = i
        if all(held is None for _, _, held in segments):
            return None
        return Exl3DecodeStack(list(layers), segments)

    def run(self, hidden: torch.Tensor, step: AttentionStep,
            layers: Any = None) -> torch.Tensor | None:
        """`layers`: the model's layers now (None: as built); another list -> None."""
        if layers is not None and (len(layers) != len(self._layers) or any(
                a is not b for a, b in zip(layers, self._layers, strict=False))):
            return None
        cache = step.cache
        slots_of = getattr(cache, "fused_decode_slots", None)
        if (slots_of is None or hidden.dtype != torch.float32 or hidden.device.type != "cpu"
                or hidden.dim() != 3 or hidden.shape[0] != 1
                or hidden.shape[1] > GEMV_MAX_ROWS or step.blocks is not None
                or step.local_cos is not None):
            return None
        slots = slots_of()
        if slots is None:
            return None
        for layer, held in zip(self._layers, self._modules, strict=True):
            now = _modules(layer)
            if now != held or _hooked((layer, layer.attention, layer.mlp, *now)):
                return None
        write_slots, decode_slots, lengths = slots
        rows, width = hidden.shape[1], hidden.shape[2]
        pool = cache.pool  # type: ignore[union-attr]
        for begin, end, held in self.segments:
            if held is None:
                for layer in self._layers[begin:end]:
                    hidden = layer(hidden, step)
                continue
            stack, flat = held
            dim = stack.head_dim
            hidden = exl3_decode_stack_cpu(
                hidden.reshape(rows, width), stack, step.cos.reshape(-1, dim),
                step.sin.reshape(-1, dim), pool.keys[begin:end], pool.values[begin:end],
                write_slots, decode_slots, lengths, flat).view(1, rows, width)
        return hidden


def _plain_exl3(layer: Any, index: int, plain: type) -> tuple[Any, ...] | None:
    """(plan, heads, kv_heads, head_dim, codebook) of a layer the stack op can run."""
    if type(layer) is not plain:
        return None
    plan, attention = layer._decode_plan(), layer.attention
    if (not isinstance(plan, Exl3DecodePlan) or attention._query_factor is not None
            or attention.layer_index != index):
        return None
    return (plan, attention.num_heads, attention.num_kv_heads, attention.head_dim,
            plan.weights.codebook)


def _stack(layers: Any, plans: list[Any], begin: int, end: int) -> Any:
    if plans[begin] is None:
        return None
    norms = tuple((layer.input_norm.weight, layer.input_norm.eps,
                   layer.post_attention_norm.weight, layer.post_attention_norm.eps)
                  for layer in layers[begin:end])
    _, heads, kv_heads, head_dim, _ = plans[begin]
    stack = Exl3StackWeights(norms, tuple(p[0].weights for p in plans[begin:end]),
                             tuple(layer.attention.window for layer in layers[begin:end]),
                             heads, kv_heads, head_dim)
    return stack, stack_args(stack)
