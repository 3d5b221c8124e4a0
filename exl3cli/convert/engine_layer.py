"""The quantizer's calibration forward: the engine's own decoder layers, for every family
the converter takes.

Each layer is assembled by ``engine.models.decoder_layer.build_decoder_layer`` (what the loader
itself uses) from ``DenseLinear`` weights and runs on the step ``CausalLM`` gives a
cache-less forward (positions, rotary tables, masks), so the activations a model is
calibrated on are the ones the engine computes: norms (1 + w, sandwich, q/k), ropes
(partial, interleaved, a separate one for sliding layers, none), windows, score scales,
soft-caps, sinks, experts. The input of one linear is read with a forward pre-hook that
stops the layer right there (nothing after it is computed). A pass after the o
projection's input is known (``attended``: from a pass with the same q/k/v) does not
recompute the attention: the layer's own o projection is applied to that input, which
is what the attention block returns (``Attention.forward`` ends with it). For the sensitivity pass
(sensitivity.py) a layer can carry probes: tensors added to the outputs of its linears,
whose gradients are the loss's gradients with respect to those outputs.

Weights come in the converter's orientation ``(in, out)`` (float32); rows of the
calibration batch go through in chunks to bound attention memory.

Public API:
- ``Dense``: module name -> ((in, out) weight, bias or None).
- ``LINEAR_SLOTS``: the four quantization groups of a layer ("qkv", "o", "gate_up",
  "down"); ``slot_module(layer, slot) -> nn.Module``, the engine module of a group.
- ``EngineLayerForward(config, spec, names, device, row_chunk=16)``:
  ``.build(i, dense, tensor, probes=None) -> DecoderLayer``, ``.step(rows, cols)``,
  ``.run(layer, hidden, attended=None) -> hidden``,
  ``.linear_input(layer, hidden, slot, attended=None) -> Tensor``,
  ``.module_input(layer, hidden, module, attended=None) -> Tensor`` (any submodule's),
  ``.embed(tokens, weight) -> hidden`` (Gemma's scale applied),
  ``.final_norm(hidden, weight)``, ``.logits(hidden, norm_weight, head_weight)``
  (Gemma 2's final soft-cap applied).
- ``activation_dtype(config) -> torch.dtype``: the checkpoint's dtype (the engine
  rounds Gemma's embedding scale to its activation dtype).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from exl3cli.engine.layers.attention import Attention, AttentionStep
from exl3cli.engine.layers.linear import DenseLinear, Linear
from exl3cli.engine.layers.rope import RotaryEmbedding
from exl3cli.engine.models.causal_lm import DecoderLayer, softcap_logits
from exl3cli.engine.models.decoder_layer import build_decoder_layer, family_norm
from exl3cli.engine.spec.architecture import ArchitectureSpec, TensorNames
from exl3cli.engine.spec.config import ModelConfig

Dense = dict[str, tuple[torch.Tensor, torch.Tensor | None]]  # module -> ((in, out), bias)

LINEAR_SLOTS = ("qkv", "o", "gate_up", "down")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def activation_dtype(config: ModelConfig) -> torch.dtype:
    """The checkpoint's dtype: what the model runs in (transformers, the engine on GPU)."""
    return _DTYPES.get(str(config.torch_dtype).removeprefix("torch."), torch.float32)


def slot_module(layer: DecoderLayer, slot: str) -> nn.Module:
    """The engine module of group `slot` in `layer` (a dense MLP's for gate_up and
    down; a mixture of experts' are per expert: moe_layer.py)."""
    if slot not in LINEAR_SLOTS:
        raise ValueError(f"slot must be one of {LINEAR_SLOTS}, got {slot!r}")
    owner = layer.attention if slot in ("qkv", "o") else layer.mlp
    return getattr(owner, slot)


class _Probed(Linear):
    """``inner`` with a fixed tensor added to its output (a sensitivity probe). It gives
    no dense weight, so a permutation of its outputs wraps it rather than folding it."""

    def __init__(self, inner: Linear, probe: torch.Tensor):
        super().__init__()
        self.inner, self.probe = inner, probe
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + self.probe


class _Replayed(nn.Module):
    """An attention block whose output is `o(attended)`: what it returned in an earlier
    pass with the same q/k/v, for the o projection the layer has now."""

    def __init__(self, o: nn.Module, attended: torch.Tensor):
        super().__init__()
        self.o, self.attended = o, attended

    def forward(self, _x: torch.Tensor, _step: AttentionStep) -> torch.Tensor:
        return self.o(self.attended)


class _Stop(Exception):
    """Raised by the capture hook: the layer's remaining work is not needed."""


class EngineLayerForward:
    """Builds and runs engine decoder layers from plain weight tensors."""

    def __init__(self, config: ModelConfig, spec: ArchitectureSpec, names: TensorNames,
                 device: torch.device, row_chunk: int = 16):
        self.config, self.spec, self.names = config, spec, names
        self.device = device
        self.row_chunk = row_chunk
        self.layer_types = spec.layer_types(config)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling,
            config.max_position_embeddings, device, torch.float32,
        )
        self.local_rotary = None
        if config.sliding_rope_theta is not None:  # as CausalLM: only when configured
            self.local_rotary = RotaryEmbedding(
                config.head_dim, config.sliding_rope_theta,
                config.sliding_rope_scaling or {"rope_type": "default"},
                config.max_position_embeddings, device, torch.float32,
            )
        # Gemma: sqrt(hidden_size) rounded to the activation dtype, as CausalLM scales.
        self.embed_scale = (torch.tensor(config.hidden_size**0.5,
                                         dtype=activation_dtype(config)).item()
                            if spec.embed_scale else None)

    def embed(self, tokens: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The hidden state the first layer gets for `tokens` [R, C]."""
        hidden = F.embedding(tokens, weight)
        return hidden if self.embed_scale is None else hidden * self.embed_scale

    def final_norm(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The family's final norm (e.g. 1 + w for Gemma) with `weight`."""
        return family_norm(self.config, self.spec, weight)(hidden)

    def logits(self, hidden: torch.Tensor, norm_weight: torch.Tensor,
               head_weight: torch.Tensor) -> torch.Tensor:
        """Logits for the last layer's output, `head_weight` (hidden, vocab)."""
        logits = self.final_norm(hidden, norm_weight) @ head_weight
        return softcap_logits(logits, self.config.final_logit_softcapping)

    def build(self, i: int, dense: Dense, tensor: Callable[[str], torch.Tensor],
              probes: dict[str, torch.Tensor] | None = None) -> DecoderLayer:
        """Layer `i` with the linears in `dense` and the norms read through `tensor`,
        assembled by the engine loader's own `build_decoder_layer`. `probes` (module ->
        tensor shaped like its output) are added to those modules' outputs."""

        def linear(prefixes: list[str], _shapes: list[tuple[int, int]],
                   _bias: bool) -> Linear:
            parts = [dense[p] for p in prefixes]
            weight = torch.cat([w.T for w, _ in parts]).contiguous()
            bias = None
            if any(b is not None for _, b in parts):
                bias = torch.cat([b if b is not None else w.new_zeros(w.shape[1])
                                  for w, b in parts])
            layer = DenseLinear(weight, bias)
            if probes is not None and all(p in probes for p in prefixes):
                return _Probed(layer, torch.cat([probes[p] for p in prefixes], dim=-1))
            return layer

        return build_decoder_layer(self.config, self.spec, self.names, i,
                                   self.layer_types[i], tensor, linear).eval()

    def step(self, rows: int, cols: int) -> AttentionStep:
        """What CausalLM._step gives a cache-less forward of [rows, cols] tokens."""
        positions = torch.arange(cols, device=self.device).expand(rows, cols)
        cos, sin = self.rotary.lookup(positions, cols)
        local_cos = local_sin = None
        if self.local_rotary is not None:
            local_cos, local_sin = (t.unsqueeze(2) for t in self.local_rotary.lookup(positions, cols))
        return AttentionStep(positions=positions, cos=cos.unsqueeze(2), sin=sin.unsqueeze(2),
                             span=cols, start=0, cache=None,
                             local_cos=local_cos, local_sin=local_sin)

    def _chunks(self, layer: DecoderLayer, hidden: torch.Tensor,
                attended: torch.Tensor | None) -> Iterator[torch.Tensor]:
        """The row chunks of `hidden`; while one is out, `layer`'s attention replays
        the chunk's rows of `attended` (when given and the block is a plain Attention)."""
        attention = layer.attention
        replay = attended is not None and type(attention) is Attention
        try:
            for start in range(0, hidden.shape[0], self.row_chunk):
                end = start + self.row_chunk
                if replay:
                    layer.attention = _Replayed(attention.o, attended[start:end])
                yield hidden[start:end]
        finally:
            layer.attention = attention

    def run(self, layer: DecoderLayer, hidden: torch.Tensor,
            attended: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output for hidden [R, C, hidden_size]; `attended`: the o
        projection's input from a pass with the same q/k/v (module docstring)."""
        return torch.cat([layer(x, self.step(*x.shape[:2]))
                          for x in self._chunks(layer, hidden, attended)])

    def linear_input(self, layer: DecoderLayer, hidden: torch.Tensor, slot: str,
                     attended: torch.Tensor | None = None) -> torch.Tensor:
        """What the linear at `slot` ("qkv", "o", "gate_up", "down") receives;
        `attended` as for `run` (not for "qkv" and "o", which come before it)."""
        if attended is not None and slot in ("qkv", "o"):
            raise ValueError(f"the {slot} projection's input comes before the attention")
        return self.module_input(layer, hidden, slot_module(layer, slot), attended, slot)

    def module_input(self, layer: DecoderLayer, hidden: torch.Tensor, module: nn.Module,
                     attended: torch.Tensor | None = None, what: str = "module") -> torch.Tensor:
        """What `module` (a part of `layer`, e.g. MLA's kv_b projection) receives."""
        seen: list[torch.Tensor] = []

        def capture(_module: nn.Module, args: tuple) -> None:
            seen.append(args[0])
            raise _Stop

        handle = module.register_forward_pre_hook(capture)
        try:
            for x in self._chunks(layer, hidden, attended):
                try:
                    layer(x, self.step(*x.shape[:2]))
                except _Stop:
                    pass
        finally:
            handle.remove()
        if len(seen) != -(-hidden.shape[0] // self.row_chunk):
            raise RuntimeError(f"the {what} projection was not reached in every row chunk")
        return torch.cat(seen)
