"""Decide the bits of every tensor of a conversion: recipe, then measurement or fixed order.

1. The recipe (``--recipe``, recipe.py) fixes the tensors its patterns match (the head
   too, by its module name, e.g. ``lm_head``; else ``--head-bits``). 16 = unquantized:
   such tensors are outside the bit budget, like the head. The token embedding
   (``--embed-bits``, default 16) is set only by an entry naming it exactly
   (``model.embed_tokens``): a wildcard that happens to match it leaves it alone.
2. The other layer tensors share what is left of the budget ``bpw x stored weights of
   all quantized layer tensors``:
   - "measured" (default): each tensor's cost comes from a sensitivity pass over a few
     calibration rows (sensitivity.py) and a knapsack chooses bits per tensor
     (knapsack.py), per tensor or, with ``allocation_unit="group"``, per group of
     tensors sharing an input (one LDLQ pass per group, as the fixed order has);
   - "fixed": allocation.py's fixed promotion order over groups (the behaviour before
     measurement), recipe overrides applied on top.
   Mixtures of experts use the fixed order (with its attention bonus), and so does
   multi-head latent attention (its qkv group reads three inputs); a recipe that
   leaves no tensor free needs neither. Every other family is measured (the
   sensitivity pass runs the engine's own layers, as the quantization does).

3. With ``out_scales="fisher"`` (default) the same sensitivity pass also gives every
   layer tensor the Fisher information of its output channels (``BitPlan.fisher``,
   saved next to the plan), which sets its output-channel scales; it runs then even
   when the bits come from the fixed order or a full recipe, so that a recipe fed back
   reproduces the files. Mixtures of experts keep RMS output scales.

Public API:
- ``BitPlan(tensor_bits, head_bits, average, method, fisher={}, embed_bits=16)``;
  ``.to_dict()``, ``.from_dict(d)``, ``.recipe_bits(head_name, embed_name=None) ->
  dict[name, bits]`` (what ``write_recipe`` writes: the embedding, every tensor, the head).
- ``make_plan(conv, shapes, tokens, head_name, head_weight, embed_name=None) -> BitPlan``
  (``head_weight(conv) -> (in, out)`` tensor, only called for a measurement).
- ``representative_bits(layer_modules, bits) -> dict[group, int]``: per group the most
  bits of its quantized tensors (16 when all are kept).
- ``average_tensor_bits(bits, sizes) -> float``: weighted by stored size, over quantized
  tensors.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from exl3cli.codec.format import padded_size
from exl3cli.convert.allocation import GroupShape, allocate_bits
from exl3cli.convert.knapsack import TensorCost, allocate_measured
from exl3cli.convert.recipe import resolve, unused_patterns
from exl3cli.errors import ConversionError

ALLOCATIONS = ("measured", "fixed")
OUT_SCALES = ("fisher", "rms")


@dataclass
class BitPlan:
    tensor_bits: dict[str, int]
    head_bits: int
    average: float
    method: str
    fisher: dict[str, torch.Tensor] = field(default_factory=dict)  # not in to_dict
    embed_bits: int = 16  # the token embedding table (16: kept as it is)

    def to_dict(self) -> dict:
        return {"tensor_bits": self.tensor_bits, "head_bits": self.head_bits,
                "average": self.average, "method": self.method, "embed_bits": self.embed_bits}

    @classmethod
    def from_dict(cls, data: dict) -> BitPlan:
        return cls({k: int(v) for k, v in data["tensor_bits"].items()}, int(data["head_bits"]),
                   float(data["average"]), str(data["method"]),
                   embed_bits=int(data.get("embed_bits", 16)))

    def recipe_bits(self, head_name: str, embed_name: str | None = None) -> dict[str, int]:
        embed = {} if embed_name is None else {embed_name: self.embed_bits}
        return {**embed, **self.tensor_bits, head_name: self.head_bits}


def representative_bits(layer_modules: dict[str, list[str]],
                        bits: dict[str, int]) -> dict[str, int]:
    out = {}
    for group, modules in layer_modules.items():
        quantized = [bits[m] for m in modules if bits[m] <= 8]
        out[group] = max(quantized) if quantized else 16
    return out


def average_tensor_bits(bits: dict[str, int], sizes: dict[str, int]) -> float:
    quantized = [m for m in bits if bits[m] <= 8]
    total = sum(sizes[m] for m in quantized)
    return sum(sizes[m] * bits[m] for m in quantized) / total if total else 16.0


def _sizes(conv) -> dict[str, int]:
    sizes = {}
    for i in range(conv.config.num_layers):
        for modules in conv.layer_modules(i).values():
            for m in modules:
                out_f, in_f = conv.reader.get(m + ".weight").shape
                sizes[m] = padded_size(in_f) * padded_size(out_f)
    return sizes


def _fixed_order(conv, shapes: list[GroupShape], bpw: float) -> dict[str, int]:
    groups = allocate_bits(shapes, bpw, attention_bonus=2 if conv.spec.moe else 0)
    return {m: groups[(i, g)] for i in range(conv.config.num_layers)
            for g, ms in conv.layer_modules(i).items() for m in ms}


def _by_group(conv, costs: dict[str, float], sizes: dict[str, int], bpw: float,
              fixed: dict[str, int]) -> dict[str, int]:
    """The knapsack over whole groups (q/k/v, gate/up share bits: one LDLQ pass each);
    a group with a recipe-fixed tensor keeps its other tensors' items separate."""
    items, members = [], {}
    for i in range(conv.config.num_layers):
        for group, modules in conv.layer_modules(i).items():
            if any(m in fixed for m in modules):
                items += [TensorCost(m, sizes[m], costs[m]) for m in modules]
                members.update({m: [m] for m in modules})
                continue
            key = f"{i}:{group}"
            items.append(TensorCost(key, sum(sizes[m] for m in modules),
                                    sum(costs[m] for m in modules)))
            members[key] = modules
    chosen = allocate_measured(items, bpw, fixed)
    return {m: b for key, b in chosen.items() for m in members.get(key, [key])}


def _embed_bits(recipe: tuple, embed_name: str | None, default: int) -> tuple[tuple, int]:
    """The recipe without its embedding entries, and the embedding's bits: set only by
    an entry that names the table exactly (a pattern such as "*" leaves it alone, as
    ``--embed-bits`` does); 1..8 or 16."""
    bits, rest = default, []
    for pattern, value in recipe:
        if embed_name is not None and pattern == embed_name:
            bits = value
        else:
            rest.append((pattern, value))
    return tuple(rest), bits


def make_plan(conv, shapes: list[GroupShape], tokens: torch.Tensor, head_name: str,
              head_weight: Callable, embed_name: str | None = None) -> BitPlan:
    options = conv.options
    if options.allocation not in ALLOCATIONS:
        raise ConversionError(f"allocation must be one of {', '.join(ALLOCATIONS)}, "
                              f"got {options.allocation!r}")
    if options.out_scales not in OUT_SCALES:
        raise ConversionError(f"out_scales must be one of {', '.join(OUT_SCALES)}, "
                              f"got {options.out_scales!r}")
    if getattr(options, "embed_bits", 16) not in (*range(1, 9), 16):
        raise ConversionError(f"embed_bits must be 1..8 or 16, got {options.embed_bits!r}")
    sizes = _sizes(conv)
    names = list(sizes)
    recipe, embed_bits = _embed_bits(tuple(options.recipe), embed_name,
                                     getattr(options, "embed_bits", 16))
    fixed = resolve(recipe, [*names, head_name])
    if recipe:
        unused = unused_patterns(recipe, [*names, head_name])
        if unused:
            raise ConversionError(f"recipe pattern(s) match no tensor of this model: "
                                  f"{', '.join(unused)} (names look like {names[0]})")
        if conv.spec.moe:
            raise ConversionError("--recipe is not supported for mixtures of experts yet")
    head_bits = fixed.pop(head_name, options.head_bits)
    free = [m for m in names if m not in fixed]
    sensitivity = None
    quantized = bool(free) or any(b <= 8 for b in fixed.values())
    if options.out_scales == "fisher" and not conv.spec.moe and quantized:
        sensitivity = _measure(conv, tokens, head_weight, len(names))
    if not free:
        bits, method = fixed, "recipe"
        average = average_tensor_bits(bits, sizes)
        if options.bits is not None and average > options.bits + 1e-6:
            raise ConversionError(f"the recipe needs {average:.3f} bits per weight, more "
                                  f"than -b {options.bits}")
    elif options.bits is None:
        raise ConversionError(f"the recipe leaves {len(free)} tensor(s) without bits (e.g. "
                              f"{free[0]}): give -b BPW for them, or cover them with '*'")
    elif options.allocation == "fixed" or conv.spec.moe or conv.spec.mla:
        bits = {**_fixed_order(conv, shapes, options.bits), **fixed}
        method = "fixed order" + (" and recipe" if fixed else "")
    else:
        sensitivity = sensitivity or _measure(conv, tokens, head_weight, len(names))
        costs = sensitivity.costs
        if options.allocation_unit == "group":
            bits = _by_group(conv, costs, sizes, options.bits, fixed)
        else:
            items = [TensorCost(m, sizes[m], costs[m]) for m in names]
            bits = allocate_measured(items, options.bits, fixed)
        method = "measurement" + (" and recipe" if fixed else "")
    bits = {m: bits[m] for m in names}
    fisher = sensitivity.fisher if sensitivity and options.out_scales == "fisher" else {}
    return BitPlan(bits, int(head_bits), average_tensor_bits(bits, sizes), method, fisher,
                   int(embed_bits))


def _measure(conv, tokens: torch.Tensor, head_weight: Callable, count: int):
    """The sensitivity pass (sensitivity.py) over the first rows of the calibration."""
    from exl3cli.convert.sensitivity import measure

    options = conv.options
    rows = tokens[: max(1, min(options.sensitivity_rows, tokens.shape[0]))]
    conv.progress(f"measuring the sensitivity of {count} tensors on "
                  f"{rows.shape[0]} x {rows.shape[1]} calibration tokens")
    started = time.perf_counter()
    found = measure(conv, rows, head_weight(conv), options.seed)
    conv.progress(f"sensitivity measured in {time.perf_counter() - started:.1f}s")
    return found
