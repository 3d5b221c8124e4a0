"""Measured cost of each tensor's quantization error, for the bit allocation (knapsack.py).

For a linear ``y = x W`` quantized at ``K`` bits, the trellis error is about i.i.d. in
the rotated domain with variance ``D(K)`` per unit-RMS weight; LDLQ shapes it so that
output column ``j`` gets a mean squared error of about

    E_j(K) = D(K) · tr(D_rot) · side_j²

where ``side_j`` is the column's scale (its RMS, the sign aside) and ``D_rot`` the
block-diagonal factor of the damped, rotated Hessian (ldlq.py: the proxy error is
``Σ_k tr(ε_kᵀ D_k ε_k)``). How much an output error costs the model is measured with
the diagonal Fisher information of that output, ``F_j = E[(∂ℓ/∂y_j)²]``, where ``ℓ`` is
the log-likelihood of tokens sampled from the unquantized model's own predictions (so
``½ δᵀ F δ`` is the expected KL divergence a small output change ``δ`` adds). The
tensor's cost per unit codec MSE is then ``½ · tr(D_rot) · Σ_j F_j side_j²``.

The pass: one forward of the unquantized model over a few calibration rows (keeping
each layer's input), the head's loss on sampled tokens, then layer by layer from the
top a recomputation with zero "probes" added to every linear output, whose gradients
are ``∂ℓ/∂y``. Layers are the engine's own (engine_layer.py), as in the quantization
itself. Memory is one layer's activations plus the layer inputs. Hessians come from
the same forward, read by hooks on the layer's linears. Mixtures of experts are not
measured (the caller falls back to the fixed order).

The same ``F_j`` also sets each tensor's output-channel scales when
``options.out_scales == "fisher"`` (quantize_layer.fisher_out_scales); the costs are
then computed with those scales, as the quantization will use them.

Public API:
- ``measure(conv, tokens, head_weight, seed=0) -> Sensitivity(costs, fisher)``:
  ``conv`` is the pipeline's converter (names, weights, layer modules, options);
  ``costs[module]`` a float, ``fisher[module]`` the float32 CPU vector ``F`` over its
  output channels. ``measure_costs(...)``: ``measure(...).costs``.
- ``predicted_error(hessian, names, weights, seed, damping, out_weights=None, strength=1)
  -> list[Tensor]``: per tensor, ``tr(D_rot) · side_j²`` for each output column (times
  ``D(K)``: the expected output MSE).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from exl3cli.convert.engine_layer import slot_module
from exl3cli.convert.hessian import HessianAccumulator, damp_hessian, pad_hessian, rotate_hessian
from exl3cli.convert.ldlq import block_ldl_diagonal
from exl3cli.convert.quantize_layer import group_scales


def predicted_error(hessian: torch.Tensor, names: list[str], weights: list[torch.Tensor],
                    seed: int, damping: float,
                    out_weights: list[torch.Tensor | None] | None = None,
                    strength: float = 1.0) -> list[torch.Tensor]:
    """Per tensor of a group, ``tr(D_rot) · side_j²`` per padded output column."""
    weights = [w.to(torch.float32) for w in weights]
    scales = group_scales(names, weights, seed, out_weights, strength)
    h = damp_hessian(pad_hessian(hessian.to(weights[0].device, torch.float64),
                                 scales.suh.numel()), damping)
    d = block_ldl_diagonal(rotate_hessian(h, scales.suh))
    trace = float(d.diagonal(dim1=1, dim2=2).sum())
    return [trace * s.double().pow(2) for s in scales.sides]


def _accumulate(hessians: dict[str, HessianAccumulator], group: str) -> Callable:
    """A forward pre-hook adding its module's input to ``hessians[group]``."""

    def hook(_module: nn.Module, args: tuple) -> None:
        x = args[0].detach()
        hessians.setdefault(group, HessianAccumulator(x.shape[-1], x.device)).add(x)

    return hook


class _Layer:
    """One decoder layer of the unquantized model, with optional probes and Hessians."""

    def __init__(self, conv, index: int):
        self.conv, self.i = conv, index
        self.mods = conv.layer_modules(index)

    def __call__(self, hidden: torch.Tensor, probes: dict | None = None,
                 hessians: dict | None = None) -> torch.Tensor:
        conv, engine = self.conv, self.conv.engine_layers
        dense = {m: (conv.weight(m), conv.bias(m)) for ms in self.mods.values() for m in ms}
        layer = engine.build(self.i, dense, conv.tensor, probes)
        handles = []
        if hessians is not None:
            handles = [slot_module(layer, group).register_forward_pre_hook(
                _accumulate(hessians, group)) for group in self.mods]
        try:  # every row at once: the probes are shaped like the whole batch's outputs
            return layer(hidden, engine.step(*hidden.shape[:2]))
        finally:
            for handle in handles:
                handle.remove()

    def out_features(self) -> dict[str, int]:
        return {m: self.conv.reader.get(m + ".weight").shape[0]
                for ms in self.mods.values() for m in ms}


def _head_gradient(conv, hidden: torch.Tensor, head_weight: torch.Tensor,
                   seed: int) -> torch.Tensor:
    """∂ℓ/∂hidden for ℓ = Σ log p(sampled token), one row at a time."""
    gen = torch.Generator(device=hidden.device)
    gen.manual_seed(seed + 7)
    norm = conv.tensor(conv.names.final_norm)
    grads = []
    for row in hidden:
        h = row.detach().clone().requires_grad_(True)
        with torch.enable_grad():
            logp = F.log_softmax(conv.engine_layers.logits(h, norm, head_weight), dim=-1)
            sampled = torch.multinomial(logp.detach().exp(), 1, generator=gen)
            loss = logp.gather(-1, sampled).sum()
            grad, = torch.autograd.grad(loss, h)
        grads.append(grad)
    return torch.stack(grads)


@dataclass
class Sensitivity:
    costs: dict[str, float]
    fisher: dict[str, torch.Tensor]


def measure_costs(conv, tokens: torch.Tensor, head_weight: torch.Tensor,
                  seed: int = 0) -> dict[str, float]:
    """Each layer linear's expected error per unit codec MSE (module name -> cost)."""
    return measure(conv, tokens, head_weight, seed).costs


def measure(conv, tokens: torch.Tensor, head_weight: torch.Tensor, seed: int = 0) -> Sensitivity:
    """Costs per unit codec MSE and output Fisher information of every layer linear."""
    by_fisher = getattr(conv.options, "out_scales", "rms") == "fisher"
    layers = [_Layer(conv, i) for i in range(conv.config.num_layers)]
    inputs, hessians = [], []
    with torch.no_grad():
        hidden = conv.embeddings(tokens).float()
        for layer in layers:
            inputs.append(hidden)
            found: dict[str, HessianAccumulator] = {}
            hidden = layer(hidden, hessians=found)
            hessians.append({g: acc.hessian() for g, acc in found.items()})
    grad = _head_gradient(conv, hidden, head_weight, seed)
    del hidden
    costs: dict[str, float] = {}
    kept: dict[str, torch.Tensor] = {}
    for i in reversed(range(len(layers))):
        layer = layers[i]
        shape = inputs[i].shape[:-1]
        probes = {m: torch.zeros(*shape, n, device=conv.device, requires_grad=True)
                  for m, n in layer.out_features().items()}
        start = inputs[i].detach().clone().requires_grad_(True)
        with torch.enable_grad():
            out = layer(start, probes=probes)
            found = torch.autograd.grad(out, [start, *probes.values()], grad)
        grad = found[0]
        fisher = {m: g.pow(2).reshape(-1, g.shape[-1]).mean(0).double()
                  for m, g in zip(probes, found[1:], strict=True)}
        kept.update({m: f.float().cpu() for m, f in fisher.items()})
        for group, modules in layer.mods.items():
            weights = [conv.weight(m) for m in modules]
            out_weights = [fisher[m] for m in modules] if by_fisher else None
            for m, per_col in zip(modules, predicted_error(
                    hessians[i][group], modules, weights, conv.options.seed,
                    conv.options.damping, out_weights,
                    getattr(conv.options, "fisher_strength", 1.0)), strict=True):
                f = fisher[m]
                costs[m] = 0.5 * float((per_col[: f.numel()] * f).sum())
        inputs[i] = None
    return Sensitivity(costs, kept)
