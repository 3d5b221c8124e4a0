"""LoRA adapters on a loaded model, several at once, chosen per token row.

`AdapterBank.of(model)` (made on first use, kept as `model.adapters`) holds the adapters
loaded on one base model. Loading one wraps each projection it adapts in an
`AdaptedLinear` (engine/layers/adapted_linear.py); the base layer (dense, EXL3 trellis,
fused, packed) is left as it is:

    y = W x + s * B (A x)          (s folded into B: peft.py)

Every adapted projection holds the A and B of all the adapters that touch it, stacked
along the rank, with the slot of the adapter each rank column belongs to (slot 0 is "no
adapter"): a forward over N token rows, each with its slot, is two matmuls whatever the
mix of adapters in the batch, and a row without an adapter adds exact zeros. On the GPU
the fused decode layer adds the same update inside its output kernels. `select_rows(names, counts)` sets the
slot of every token of the next forward on the calling thread (the generator calls it
before each step and `release()` after; rows past the selection, e.g. a decode step's
padding, and forwards of other threads get slot 0); it writes into one persistent
device buffer, so a captured decode graph reads the current slots.

Fused projections (q|k|v, gate|up) get one block-diagonal B over their parts; a q/k
head permutation of the loader (partial or interleaved rope) is applied to B's rows.
Adapters fit their base or are refused: a module the engine cannot adapt (embeddings,
the head, mixture-of-experts experts), a name this architecture does not have, or
shapes that differ from the base layer raise AdapterError naming the adapter.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from exl3cli.engine.adapters.peft import PeftAdapter
from exl3cli.engine.kvcache.paged_cache import ROOT_HASH
from exl3cli.engine.layers.adapted_linear import AdaptedLinear
from exl3cli.engine.layers.linear import Linear
from exl3cli.errors import AdapterError, InvalidOption

_SLOT_CAPACITY = 4096  # token rows the persistent slot buffer holds before it grows


@dataclass
class _Target:
    """One engine projection that adapters may touch: `getattr(owner, attr)`, whose
    output is the concatenation of `parts` (checkpoint module, out features),
    reordered by `order` when the loader permuted it."""

    owner: nn.Module
    attr: str
    parts: list[tuple[str, int]]
    order: torch.Tensor | None = None

    def base(self) -> Linear:
        layer = getattr(self.owner, self.attr)
        return layer.inner if isinstance(layer, AdaptedLinear) else layer


@dataclass
class _Loaded:
    adapter: PeftAdapter
    key: bytes  # unique per load: pages cached under one adapter never serve another


class AdapterBank:
    """The adapters loaded on one model (see the module docstring)."""

    def __init__(self, model: Any):
        self.model = model
        self.lock = threading.RLock()
        self._loaded: OrderedDict[str, _Loaded] = OrderedDict()
        self._targets = _model_targets(model)
        self._by_module = {module: (target, index) for target in self._targets
                           for index, (module, _) in enumerate(target.parts)}
        self._wrapped: dict[int, AdaptedLinear] = {}
        self._slots = torch.zeros(_SLOT_CAPACITY, dtype=torch.long, device=model.device)
        self._selected = 0  # rows of _slots set by the last selection
        self._owner: int | None = None  # the thread whose forward the selection is for
        self._masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        self._base_slots = torch.zeros(_SLOT_CAPACITY, dtype=torch.long, device=model.device)

    @classmethod
    def of(cls, model: Any) -> AdapterBank:
        bank = getattr(model, "adapters", None)
        if bank is None and getattr(model, "tensor_parallel", None):
            raise AdapterError("LoRA adapters are not applied to a tensor-parallel model "
                               "(its projections are split over ranks); load it on one "
                               "device or with a layer split")
        if bank is None:
            bank = cls(model)
            model.adapters = bank
        return bank

    # ---- which adapters ----------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return list(self._loaded)

    def get(self, name: str) -> PeftAdapter:
        return self._loaded[name].adapter

    def __contains__(self, name: object) -> bool:
        return name in self._loaded

    def load(self, adapter: PeftAdapter) -> None:
        """Add (or replace) `adapter` under its name; AdapterError when it does not fit."""
        with self.lock:
            self.check(adapter)
            self._loaded[adapter.name] = _Loaded(adapter, os.urandom(16))
            self._rebuild()

    def unload(self, name: str) -> bool:
        with self.lock:
            if self._loaded.pop(name, None) is None:
                return False
            self._rebuild()
            return True

    def check(self, adapter: PeftAdapter) -> None:
        """AdapterError naming the first module of `adapter` this model cannot take."""
        shapes = {module: (target.base().in_features, target.parts[index][1])
                  for module, (target, index) in self._by_module.items()}
        check_adapter_fits(adapter, shapes, self.model.config.architecture)

    # ---- per-row selection ---------------------------------------------------------------

    def slot(self, name: str | None) -> int:
        """The slot of adapter `name` (0 for None); InvalidOption if not loaded."""
        if name is None:
            return 0
        for index, loaded_name in enumerate(self._loaded, start=1):
            if loaded_name == name:
                return index
        raise InvalidOption(f"adapter {name!r} is not loaded on this model"
                            f" (loaded: {', '.join(self._loaded) or 'none'})")

    def root_hash(self, name: str | None) -> bytes:
        """The prefix-cache root of a sequence run under adapter `name`."""
        if name is None or name not in self._loaded:
            return ROOT_HASH
        return hashlib.blake2b(ROOT_HASH + self._loaded[name].key, digest_size=16).digest()

    def select_rows(self, names: list[str | None], counts: list[int]) -> None:
        """The adapter of each row of the next forward: row i's `counts[i]` tokens use
        adapter `names[i]` (None: the base model)."""
        slots = [self.slot(name) for name in names]
        total = sum(counts)
        if total > self._slots.numel():
            self._slots = torch.zeros(total, dtype=torch.long, device=self._slots.device)
            self._invalidate_graphs()
        values = torch.tensor(slots, dtype=torch.long).repeat_interleave(
            torch.tensor(counts, dtype=torch.long))
        self._slots[:total].copy_(values, non_blocking=True)
        if self._selected > total:
            self._slots[total:self._selected].zero_()
        self._selected = total
        self._owner = threading.get_ident()
        self._masks.clear()

    def release(self) -> None:
        """The selection is spent: forwards from here on (any thread) run the base
        model until the next selection."""
        self._owner = None
        self._masks.clear()

    def select(self, name: str | None, rows: int) -> None:
        """Every one of the next forward's `rows` token rows uses adapter `name`."""
        self.select_rows([name], [rows])

    def row_mask(self, columns: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """[rows, R]: 1 where a rank column belongs to the row's adapter. Made once per
        forward for each stacking of columns (most projections share one), not per layer."""
        key = (id(columns), rows, dtype)
        # Never cached while a CUDA graph is captured: a tensor made in the capture and
        # freed after it (release() clears the cache) goes back to the graphs' shared
        # memory pool, where the next capture may place its own tensors while this
        # graph's replays still write the mask there.
        mine = (self._owner == threading.get_ident()
                and not (columns.is_cuda and torch.cuda.is_current_stream_capturing()))
        mask = self._masks.get(key) if mine else None
        if mask is None:
            mask = (columns[None, :] == self.token_slots(rows)[:, None]).to(dtype)
            if mine:
                self._masks[key] = mask
        return mask

    def token_slots(self, rows: int) -> torch.Tensor:
        """The slots of the current forward's `rows` token rows: the selection made on
        this thread, else (another thread's forward, e.g. an embedding request, or
        none made) slot 0 for every row."""
        if self._owner != threading.get_ident():
            if self._base_slots.numel() < rows:
                self._base_slots = torch.zeros(rows, dtype=torch.long, device=self._slots.device)
            return self._base_slots[:rows]
        if rows > self._slots.numel():  # rows past any selection: the base model
            grown = torch.zeros(rows, dtype=torch.long, device=self._slots.device)
            grown[: self._selected].copy_(self._slots[: self._selected])
            self._slots = grown
            self._invalidate_graphs()
        return self._slots[:rows]

    # ---- the wrapped layers -----------------------------------------------------------

    def _rebuild(self) -> None:
        """Stack every loaded adapter into the projections it touches; unwrap the rest."""
        dtype, device = self.model.dtype, self.model.device
        self._masks.clear()
        for target in self._targets:
            pieces = []
            for slot, loaded in enumerate(self._loaded.values(), start=1):
                block = _target_block(target, loaded.adapter)
                if block is not None:
                    pieces.append((slot, *block))
            if not pieces:
                self._unwrap(target)
                continue
            a = torch.cat([p[1] for p in pieces]).to(device, dtype).contiguous()
            b = torch.cat([p[2] for p in pieces], dim=1).to(device, dtype).contiguous()
            columns = torch.cat([torch.full((p[1].shape[0],), p[0], dtype=torch.long)
                                 for p in pieces]).to(device)
            self._wrap(target).set_adapters(a, b, columns)
        for layer in self.model.layers:  # CPU decode plans hold the unwrapped layers
            if hasattr(layer, "_plan"):
                layer._plan = False
        self._invalidate_graphs()

    def _invalidate_graphs(self) -> None:
        """Captured decode graphs (decode_step.py) hold the layers and tensors of their
        capture: a new `adapter_version` of the model makes them stale."""
        self.model.adapter_version = getattr(self.model, "adapter_version", 0) + 1

    def _wrap(self, target: _Target) -> AdaptedLinear:
        layer = getattr(target.owner, target.attr)
        if not isinstance(layer, AdaptedLinear):
            layer = AdaptedLinear(layer, self)
            setattr(target.owner, target.attr, layer)
        return layer

    @staticmethod
    def _unwrap(target: _Target) -> None:
        layer = getattr(target.owner, target.attr)
        if isinstance(layer, AdaptedLinear):
            setattr(target.owner, target.attr, layer.inner)


def check_adapter_fits(adapter: PeftAdapter, shapes: dict[str, tuple[int, int]],
                       architecture: str) -> None:
    """AdapterError unless every module `adapter` touches (and every name in a list of
    target_modules) is one of `shapes` ({module: (in, out)}) with the same shape."""
    what = (f"which this {architecture} model does not have as an adaptable projection "
            "(exl3 adapts the attention q/k/v/o and dense MLP gate/up/down projections)")
    targets = adapter.target_modules
    if isinstance(targets, list):  # (a regular expression: the tensors say what it hit)
        unknown = [t for t in targets if not isinstance(t, str) or not any(
            module == t or module.endswith("." + t) for module in shapes)]
        if unknown:
            raise AdapterError(f"adapter {adapter.name}: target_modules names "
                               f"{_few(map(str, unknown))}, {what}")
    unknown = sorted(m for m in adapter.modules if m not in shapes)
    if unknown:
        raise AdapterError(f"adapter {adapter.name}: targets {_few(unknown)}, {what}")
    for module, pair in adapter.modules.items():
        got, want = (pair.a.shape[1], pair.b.shape[0]), shapes[module]
        if got != want:
            raise AdapterError(
                f"adapter {adapter.name}: shape mismatch at {module}: the adapter maps "
                f"{got[0]} -> {got[1]} features, the model's layer {want[0]} -> {want[1]} "
                "(an adapter trained for another base model?)")


def config_module_shapes(config: Any, spec: Any, names: Any) -> dict[str, tuple[int, int]]:
    """{checkpoint module: (in, out)} of the projections an adapter may touch, from the
    config alone (what `create` checks an ADAPTER against without loading the model)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, int]] = {}
    for i in range(config.num_layers):
        if names.qkv_fused:
            shapes[names.qkv_fused.format(i=i)] = (hidden, q_size + 2 * kv_size)
        else:
            shapes[names.q_proj.format(i=i)] = (hidden, q_size)
            shapes[names.k_proj.format(i=i)] = (hidden, kv_size)
            shapes[names.v_proj.format(i=i)] = (hidden, kv_size)
        shapes[names.o_proj.format(i=i)] = (q_size, hidden)
        if spec.moe is not None and spec.moe.is_sparse(config, i):
            continue
        if names.gate_up_fused:
            shapes[names.gate_up_fused.format(i=i)] = (hidden, 2 * inter)
        else:
            shapes[names.gate_proj.format(i=i)] = (hidden, inter)
            shapes[names.up_proj.format(i=i)] = (hidden, inter)
        shapes[names.down_proj.format(i=i)] = (inter, hidden)
    return shapes


def _target_block(target: _Target, adapter: PeftAdapter
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(A [r_total, in], B [out, r_total]) of `adapter` on `target`: its parts' A stacked,
    their B placed block-diagonally at each part's output rows, rows permuted like the
    base layer's outputs. None when the adapter touches no part."""
    pairs = [adapter.modules.get(module) for module, _ in target.parts]
    if all(p is None for p in pairs):
        return None
    out_total = sum(size for _, size in target.parts)
    rank_total = sum(p.rank for p in pairs if p is not None)
    a_rows, b = [], torch.zeros(out_total, rank_total)
    row = column = 0
    for pair, (_, size) in zip(pairs, target.parts, strict=True):
        if pair is not None:
            a_rows.append(pair.a)
            b[row : row + size, column : column + pair.rank] = pair.b
            column += pair.rank
        row += size
    if target.order is not None:
        b = b[target.order]
    return torch.cat(a_rows), b


def _model_targets(model: Any) -> list[_Target]:
    """The projections of `model` an adapter may touch, with their checkpoint names."""
    from exl3cli.engine.layers.mlp import GatedMLP
    from exl3cli.engine.models.decoder_layer import fused_qkv_order, rope_head_order

    config, names = model.config, getattr(model, "tensor_names", None)
    if names is None:
        raise AdapterError("this model does not say its tensor names; adapters need a "
                           "model built by the loader")
    hidden = config.hidden_size
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    head_order = rope_head_order(config, model.spec)
    qkv_order = None if head_order is None else fused_qkv_order(config, head_order)
    targets = []
    for i, layer in enumerate(model.layers):
        attention = layer.attention
        if names.qkv_fused:
            qkv = [(names.qkv_fused.format(i=i), q_size + 2 * kv_size)]
        else:
            qkv = [(names.q_proj.format(i=i), q_size), (names.k_proj.format(i=i), kv_size),
                   (names.v_proj.format(i=i), kv_size)]
        targets.append(_Target(attention, "qkv", qkv, qkv_order))
        targets.append(_Target(attention, "o", [(names.o_proj.format(i=i), hidden)]))
        if isinstance(layer.mlp, GatedMLP):
            width = layer.mlp.down.in_features
            if names.gate_up_fused:
                gate_up = [(names.gate_up_fused.format(i=i), 2 * width)]
            else:
                gate_up = [(names.gate_proj.format(i=i), width),
                           (names.up_proj.format(i=i), width)]
            targets.append(_Target(layer.mlp, "gate_up", gate_up))
            targets.append(_Target(layer.mlp, "down", [(names.down_proj.format(i=i), hidden)]))
    return targets


def _few(items: Any, shown: int = 3) -> str:
    items = list(items)
    text = ", ".join(items[:shown])
    return text + (f" and {len(items) - shown} more" if len(items) > shown else "")


# ---- changing the adapters of a model that a generator is serving ----------------------

def load_adapter(model: Any, adapter: PeftAdapter, generator: Any = None) -> None:
    """Put `adapter` on `model` between two steps of `generator` (when one serves it)."""
    bank = AdapterBank.of(model)
    bank.check(adapter)  # a misfit fails before waiting for the step in progress
    with generator.lock if generator is not None else contextlib.nullcontext():
        bank.load(adapter)


def unload_adapter(model: Any, name: str, generator: Any = None) -> bool:
    """Take adapter `name` off `model`; InvalidOption while a job of `generator` uses it.
    False when it was not loaded."""
    bank = getattr(model, "adapters", None)
    if bank is None:
        return False
    with generator.lock if generator is not None else contextlib.nullcontext():
        if generator is not None and name in generator.adapters_in_use():
            raise InvalidOption(f"adapter {name!r} is in use by running requests; unload it "
                                "when they finish")
        return bank.unload(name)
