"""Layer split (ExLlama's gpu_split / auto-split): whole decoder layers on each device
in turn, for a model that does not fit on one.

The first device holds the embeddings, final norm and head with its layers; each
device holds its layers' KV cache. A forward runs the layers in order, moving the
hidden state [tokens, hidden] to the next device at each boundary (a few kB per token,
the only traffic) and back to the first for the head. The generator's page pool
(``page_pool``) holds the first stage's layers; each later stage has a pool with the
same pages on its own device, and the step (a ``PagedBatch`` or ``FixedDecodeStep``)
is mirrored onto it (``cache.mirror(pool)``: same pages, lengths, rows). Nothing here
is specific to CUDA: the CPU tests run it with "cpu" standing for every device.

Sizing: ``plan_layer_split(estimate, budgets)`` fills each device in turn with whole
layers (weights plus their cache for the context) within its budget: the free memory
less a reserve ("auto"), or the GiB a ``gpu_split`` list gives per device.

Public API: ``parse_gpu_split(value) -> list[float] | None`` (None: "auto"),
``plan_layer_split(estimate, budgets) -> list[int]``, ``LayerStages``,
``load_layer_split(folder, devices=None, split=None, *, counts=None, dtype=None,
num_ctx=None, linear_mode=None, cpu_weights=None) -> CausalLM``.
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from exl3cli.engine.kvcache.kv_quant import KVCacheType
from exl3cli.engine.kvcache.paged_cache import PagePool
from exl3cli.engine.layers.attention import AttentionStep
from exl3cli.engine.layers.fused_experts import split_fused_experts
from exl3cli.engine.models.causal_lm import CausalLM
from exl3cli.engine.models.loader import build_causal_lm, default_dtype
from exl3cli.engine.models.placement import (
    DEFAULT_NUM_CTX,
    GPU_RESERVE_BYTES,
    MemoryEstimate,
    estimate_memory,
)
from exl3cli.engine.models.weights import WeightReader
from exl3cli.engine.spec.architecture import get_architecture, load_family_config
from exl3cli.engine.spec.config import ModelConfig
from exl3cli.errors import InvalidOption, ModelLoadError


def parse_gpu_split(value: Any) -> list[float] | None:
    """GiB per device ("20,24", [20, 24]), or None for "auto" (free memory)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        split = [float(item) for item in items]
    except (TypeError, ValueError) as exc:
        raise InvalidOption(f"gpu_split must be 'auto' or GiB per device such as "
                            f"'20,24', got {value!r}") from exc
    if not split or any(g < 0 for g in split):
        raise InvalidOption(f"gpu_split needs one or more sizes >= 0, got {value!r}")
    return split


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def plan_layer_split(estimate: MemoryEstimate, budgets: list[int]) -> list[int]:
    """Layers per device: each device in turn takes whole layers (weights and cache)
    while they fit its budget; the first also holds embeddings, head and workspace."""
    n = len(estimate.layers)
    counts, i = [], 0
    for d, budget in enumerate(budgets):
        used = estimate.workspace + (estimate.other if d == 0 else 0)
        start = i
        while i < n and used + estimate.layers[i] + estimate.cache_per_layer <= budget:
            used += estimate.layers[i] + estimate.cache_per_layer
            i += 1
        counts.append(i - start)
    if i < n:
        raise ModelLoadError(
            f"layer split: the model needs {_gib(estimate.total)} (its layers, cache for "
            f"the context, embeddings, head, workspace), the devices hold "
            f"{_gib(sum(budgets))}; {n - i} of {n} layers do not fit: add a device, "
            "lower num_ctx, or raise gpu_split")
    return counts


class OffsetCache:
    """A stage's mirrored step: layer i of the model is layer i - offset of its pool."""

    def __init__(self, inner: Any, offset: int):
        self.inner, self.offset = inner, offset

    def prepare(self) -> tuple[torch.Tensor, int]:
        return self.inner.prepare()

    def check_input(self, input_ids: torch.Tensor) -> None:
        self.inner.check_input(input_ids)

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               window: int | None, *, softcap: float | None = None,
               scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.attend(layer - self.offset, query, key, value, window,
                                 softcap=softcap, scale=scale, sinks=sinks)

    def select_last(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.select_last(hidden)

    def advance(self) -> None:
        """Nothing: the first stage's step commits."""


class LayerStages:
    """Which layers run where, and each stage's page pool (module docstring)."""

    def __init__(self, bounds: list[tuple[int, int, torch.device]], config: ModelConfig,
                 dtype: torch.dtype, main: torch.device):
        self.bounds = bounds  # (first layer, end, device) per stage, in order
        self.config, self.dtype, self.main = config, dtype, main
        self._mirrors: weakref.WeakKeyDictionary[PagePool, list[PagePool | None]] = \
            weakref.WeakKeyDictionary()

    def _primary(self, index: int) -> bool:
        start, _, device = self.bounds[index]
        return index == 0 and start == 0 and device == self.main

    def page_pool(self, num_pages: int, cache_type: KVCacheType) -> PagePool:
        """The generator's pool (the first stage's layers on the main device) and, kept
        with it, a pool with the same pages on every later stage's device."""
        config = self.config

        def pool(layers: int, device: torch.device) -> PagePool:
            return PagePool(num_pages, layers, config.num_kv_heads, config.head_dim,
                            self.dtype, device, cache_type)

        first = self.bounds[0]
        primary = pool(first[1] - first[0] if self._primary(0) else 0, self.main)
        self._mirrors[primary] = [None if self._primary(s) else pool(end - start, device)
                                  for s, (start, end, device) in enumerate(self.bounds)]
        return primary

    def run(self, layers: Any, hidden: torch.Tensor, step: AttentionStep) -> torch.Tensor:
        """The layers of every stage in turn; the result on the main device."""
        pools = None
        if step.cache is not None:
            pools = self._mirrors.get(getattr(step.cache, "pool", None))
            if pools is None or not hasattr(step.cache, "mirror"):
                raise InvalidOption("layer split: this step (image prompts, or a cache the "
                                    "model did not make) runs on one device only")
        for s, (start, end, device) in enumerate(self.bounds):
            here = step
            if not self._primary(s):
                hidden = hidden.to(device)
                here = self._moved(step, device, None if pools is None else pools[s], start)
            for layer in layers[start:end]:
                hidden = layer(hidden, here)
        return hidden.to(self.main)

    @staticmethod
    def _moved(step: AttentionStep, device: torch.device, pool: PagePool | None,
               offset: int) -> AttentionStep:
        cache = None
        if pool is not None:
            mirror = step.cache.mirror(pool)  # type: ignore[union-attr]
            mirror.prepare()  # a fixed-shape step derives its slots here
            cache = OffsetCache(mirror, offset)

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return replace(step, positions=move(step.positions), cos=move(step.cos),
                       sin=move(step.sin), local_cos=move(step.local_cos),
                       local_sin=move(step.local_sin), blocks=move(step.blocks), cache=cache,
                       _masks={})


def _budgets(devices: list[torch.device], split: list[float] | None) -> list[int]:
    if split is not None:
        if len(split) != len(devices):
            raise InvalidOption(f"gpu_split gives {len(split)} sizes for {len(devices)} devices")
        return [int(g * 2**30) for g in split]
    budgets = []
    for device in devices:
        if device.type != "cuda":
            raise InvalidOption("gpu_split auto sizes CUDA devices from their free memory; "
                                "give GiB per device for others")
        free, _total = torch.cuda.mem_get_info(device)
        budgets.append(max(0, free - GPU_RESERVE_BYTES))
    return budgets


def load_layer_split(folder: str | Path, devices: list[Any] | None = None,
                     split: Any = None, *, counts: list[int] | None = None,
                     dtype: torch.dtype | None = None, num_ctx: int | None = None,
                     linear_mode: str | None = None,
                     cpu_weights: str | None = None) -> CausalLM:
    """`folder` with its layers over `devices` (default: every CUDA device): `counts`
    layers each, else sized from `split` (GiB per device, or "auto"/None: free memory).
    The model's `layer_split` lists the layers per device."""
    config = load_family_config(folder)
    spec = get_architecture(config.architecture)
    if devices is None:
        devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    places = [torch.device(d) for d in devices]
    if len(places) < 1:
        raise InvalidOption("layer split needs at least one device")
    dtype = dtype or default_dtype(config, places[0])
    if counts is None:
        estimate = estimate_memory(folder, config, dtype, num_ctx or DEFAULT_NUM_CTX)
        counts = plan_layer_split(estimate, _budgets(places, parse_gpu_split(split)))
    if len(counts) != len(places) or sum(counts) != config.num_layers or min(counts) < 0:
        raise InvalidOption(f"layer split {counts} does not place {config.num_layers} layers "
                            f"on {len(places)} devices")
    layer_devices = [d for d, c in zip(places, counts, strict=True) for _ in range(c)]
    reader = split_fused_experts(WeightReader(folder), config, spec)
    model = build_causal_lm(config, spec, reader, places[0], dtype, linear_mode=linear_mode,
                            cpu_weights=cpu_weights, layer_devices=layer_devices)
    bounds, start = [], 0
    for device, count in zip(places, counts, strict=True):
        if count:
            bounds.append((start, start + count, device))
            start += count
    stages = LayerStages(bounds, config, dtype, places[0])
    model.stages = stages
    model.page_pool = stages.page_pool
    model.supports_graphs = False
    model.layer_split = list(counts)
    return model
