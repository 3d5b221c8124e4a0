"""Which modules of a layer the converter quantizes, and the mixture-of-experts part:
per-expert Hessians from the calibration tokens routed to each expert.

A dense layer has four groups (qkv, o, gate_up, down). In a mixture-of-experts layer
the gate_up group is every expert's gate and up (and the shared expert's), the down
group every expert's down: they share the layer's bit width, but each expert is
quantized on its own Hessian, built from the rows its router sent it. An expert that
saw fewer rows than it has inputs would get a rank-deficient Hessian; it is topped up
with the Hessian pooled over all rows of the block (``pooled_hessian``), weighted as
the missing rows, so rarely chosen experts still quantize well. The shared expert sees
every row and is quantized on its own Hessian (its down projection may be wider than
the routed experts', Qwen2-MoE). The router and the shared expert's sigmoid gate stay
at 16 bits (tiny, and routing is sensitive).

Public API:
- ``layer_modules(spec, names, config, i) -> dict[group, list[module]]``
- ``kept_dense_modules(spec, config, i) -> list[module]``
- ``moe_units(spec, config, i, group) -> list[(modules, source)]``: the modules quantized
  together and where their input comes from ("expert", index) or ("shared", None).
- ``MoEInputs`` / ``capture_moe_inputs(engine, layer, hidden, group, attended=None)``:
  the rows each expert (and the shared expert) received, and the block's input rows.
- ``pooled_hessian(rows, pool, features) -> Tensor``.
- ``stored_name(spec, i, name) -> str``: the name a kept tensor of layer `i` is written
  under: the router's choice bias as ExLlamaV3 stores it
  (``<router>.e_score_correction_bias``; ERNIE 4.5 MoE checkpoints keep it in
  ``mlp.moe_statics``), everything else as the checkpoint names it.
- ``quantize_experts(conv, i, hidden, dense, group, k_bits, attended=None)
  -> (results, counts)``; ``attended`` as for ``EngineLayerForward.run``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from exl3cli.convert.hessian import HessianAccumulator
from exl3cli.convert.mla_layer import latent_modules
from exl3cli.engine.spec.architecture import ArchitectureSpec, MoESpec, TensorNames
from exl3cli.engine.spec.config import ModelConfig


def _moe(spec: ArchitectureSpec, config: ModelConfig, i: int) -> MoESpec | None:
    moe = spec.moe
    return moe if moe is not None and moe.is_sparse(config, i) else None


def _shared(moe: MoESpec, config: ModelConfig) -> tuple[str, str, str] | None:
    names = (moe.shared_gate_proj, moe.shared_up_proj, moe.shared_down_proj)
    if not moe.shared_size(config) or not all(names):
        return None
    return names  # type: ignore[return-value]


def moe_units(spec: ArchitectureSpec, config: ModelConfig, i: int,
              group: str) -> list[tuple[list[str], tuple[str, int | None]]]:
    """The quantization units of a sparse layer's `group` ("gate_up" or "down")."""
    moe = _moe(spec, config, i)
    if moe is None:
        return []
    parts = (moe.gate_proj, moe.up_proj) if group == "gate_up" else (moe.down_proj,)
    units = [([p.format(i=i, e=e) for p in parts], ("expert", e))
             for e in range(moe.num_experts(config))]
    shared = _shared(moe, config)
    if shared is not None:
        picked = shared[:2] if group == "gate_up" else shared[2:]
        units.append(([p.format(i=i) for p in picked], ("shared", None)))
    return units


def layer_modules(spec: ArchitectureSpec, names: TensorNames, config: ModelConfig,
                  i: int) -> dict[str, list[str]]:
    """Every quantized module of layer `i`, by group (multi-head latent attention's
    qkv group: mla_layer.py)."""
    modules = {
        "qkv": (latent_modules(names, config, i) if spec.mla else
                [names.q_proj.format(i=i), names.k_proj.format(i=i), names.v_proj.format(i=i)]),
        "o": [names.o_proj.format(i=i)],
    }
    if _moe(spec, config, i) is None:
        modules["gate_up"] = [names.gate_proj.format(i=i), names.up_proj.format(i=i)]
        modules["down"] = [names.down_proj.format(i=i)]
    else:
        for group in ("gate_up", "down"):
            modules[group] = [m for unit, _ in moe_units(spec, config, i, group) for m in unit]
    return modules


def stored_name(spec: ArchitectureSpec, i: int, name: str) -> str:
    """Where the EXL3 folder keeps layer `i`'s tensor `name` (module docstring)."""
    moe = spec.moe
    if moe is not None and moe.score_bias and name == moe.score_bias.format(i=i):
        return moe.router.format(i=i) + ".e_score_correction_bias"
    return name


def kept_dense_modules(spec: ArchitectureSpec, config: ModelConfig, i: int) -> list[str]:
    """Linears of layer `i` written at 16 bits: the router and a shared expert's gate."""
    moe = _moe(spec, config, i)
    if moe is None:
        return []
    kept = [moe.router.format(i=i)]
    if moe.shared_expert_gate and _shared(moe, config) is not None:
        kept.append(moe.shared_expert_gate.format(i=i))
    return kept


@dataclass
class MoEInputs:
    """What one pass through a sparse layer fed the linears of one group."""

    block: list[torch.Tensor] = field(default_factory=list)  # the router's input rows
    experts: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    shared: list[torch.Tensor] = field(default_factory=list)

    def of(self, source: tuple[str, int | None]) -> torch.Tensor | None:
        kind, index = source
        parts = self.shared if kind == "shared" else self.experts.get(int(index or 0), [])
        return torch.cat(parts) if parts else None

    def token_counts(self) -> list[int]:
        return [sum(p.shape[0] for p in self.experts.get(e, []))
                for e in range(max(self.experts, default=-1) + 1)]


def capture_moe_inputs(engine, layer: nn.Module, hidden: torch.Tensor, group: str,
                       attended: torch.Tensor | None = None) -> MoEInputs:
    """Run `layer` (an engine DecoderLayer with a MoEMLP) over `hidden` through
    `engine` (EngineLayerForward, replaying the attention from `attended` when given)
    and record each expert's `group` input."""
    moe = layer.mlp
    seen = MoEInputs(experts={e: [] for e in range(len(moe.experts))})

    def keep(store: list[torch.Tensor]):
        def hook(_module: nn.Module, args: tuple) -> None:
            store.append(args[0].reshape(-1, args[0].shape[-1]).detach().clone())
        return hook

    slot = "gate_up" if group == "gate_up" else "down"
    targets = [(moe.router.gate, seen.block)]
    targets += [(getattr(expert, slot), seen.experts[e]) for e, expert in enumerate(moe.experts)]
    if moe.shared is not None:
        targets.append((getattr(moe.shared, slot), seen.shared))
    handles = [module.register_forward_pre_hook(keep(store)) for module, store in targets]
    try:
        engine.run(layer, hidden, attended)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def pooled_hessian(rows: torch.Tensor | None, pool: torch.Tensor, features: int) -> torch.Tensor:
    """The Hessian of an expert's `rows`, topped up to `features` rows with `pool` (the
    Hessian over every row of its kind) when it saw fewer: (S + m * pool) / (n + m)."""
    acc = HessianAccumulator(features, pool.device)
    if rows is not None and rows.shape[0]:
        acc.add(rows)
    missing = max(0, features - acc.rows)
    if not missing:
        return acc.hessian()
    total = acc.hessian() * acc.rows if acc.rows else torch.zeros_like(pool)
    return (total + pool.to(total.dtype) * missing) / (acc.rows + missing)


def quantize_experts(conv, i: int, hidden: torch.Tensor, dense: dict[str, tuple],
                     group: str, k_bits: int,
                     attended: torch.Tensor | None = None) -> tuple[list, list[int]]:
    """Quantize a sparse layer's `group` ("gate_up" or "down") for the converter `conv`
    (pipeline._Converter): each expert (and the shared expert) on the rows it received,
    topped up with the pooled Hessian; also the rows each routed expert received."""
    engine = conv.engine_layers
    seen = capture_moe_inputs(engine, engine.build(i, dense, conv.tensor), hidden, group,
                              attended)
    if group == "gate_up":
        pool_rows = torch.cat(seen.block)
    else:
        pool_rows = torch.cat([x for parts in seen.experts.values() for x in parts])
    pool = HessianAccumulator(pool_rows.shape[-1], conv.device)
    pool.add(pool_rows)
    results = []
    for modules, source in moe_units(conv.spec, conv.config, i, group):
        rows = seen.of(source)
        # The shared expert sees every row (and its down projection may be wider than
        # the routed experts', Qwen2-MoE): its own Hessian, as a dense MLP's.
        h = (None if source[0] == "shared" else
             pooled_hessian(rows, pool.hessian(), pool_rows.shape[-1]))
        results += conv.quantize(modules, rows, k_bits, hessian=h)
    return results, seen.token_counts()
