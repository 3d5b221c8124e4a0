"""Embeddings in-process: /api/embed, the legacy /api/embeddings, and /v1/embeddings.

An input's embedding is the mean over its tokens of the model's final-norm hidden states
(`CausalLM.hidden_states`), L2-normalised (the legacy endpoint returns it unnormalised,
as Ollama's does). Inputs longer than the context are cut to fit (`truncate`, default
on) or refused with ContextOverflow.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from exl3cli.errors import ContextOverflow, InvalidOption


def embedding_inputs(value: Any) -> list[str]:
    """A request's `input`: one string or a list of strings."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return list(value)
    raise InvalidOption("input must be a string or a list of strings")


def pooled_embedding(text_model: Any, ids: list[int], normalize: bool = True) -> list[float]:
    """Mean-pooled final hidden state of `ids`, optionally L2-normalised."""
    model = text_model.model
    hidden = model.hidden_states(torch.tensor([ids], dtype=torch.long))[0]
    vector = hidden.mean(dim=0)
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return [float(x) for x in vector.cpu()]


def _fit(ids: list[int], limit: int, truncate: bool) -> list[int]:
    if len(ids) <= limit:
        return ids
    if not truncate:
        raise ContextOverflow(f"an input is {len(ids)} tokens, which does not fit the "
                              f"context window of {limit} tokens (set truncate or num_ctx)")
    return ids[:limit]


def _dimensions(vector: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """The first `dimensions` values (renormalised), as Ollama's `dimensions` field."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    if dimensions < 1:
        raise InvalidOption("dimensions must be at least 1")
    cut = torch.tensor(vector[:dimensions])
    if normalize:
        cut = torch.nn.functional.normalize(cut, dim=0)
    return [float(x) for x in cut]


def run_embed(runner: Any, req: dict[str, Any], normalize: bool = True) -> dict[str, Any]:
    """The /api/embed answer for `req` ({model, input, truncate, options, keep_alive,
    dimensions}), using `runner` (an InferenceRunner) to load and keep the model."""
    from exl3cli.runtime.options import merge_options, parse_keep_alive

    if not isinstance(req, dict):
        raise InvalidOption("request must be a JSON object")
    name = req.get("model") or req.get("name")
    if not name or not isinstance(name, str):
        raise InvalidOption("model is required")
    inputs = embedding_inputs(req.get("input"))
    truncate = req.get("truncate", True) is not False
    dimensions = req.get("dimensions")
    if dimensions is not None and (isinstance(dimensions, bool)
                                   or not isinstance(dimensions, int)):
        raise InvalidOption("dimensions must be an integer")
    started = time.perf_counter_ns()
    manifest = runner.store.read_manifest(name)
    keep_alive = parse_keep_alive(req.get("keep_alive"))
    options, _ignored = merge_options(manifest.get("parameters"), req.get("options"))
    with runner.holding(name, manifest, keep_alive) as loaded:
        load_ns = time.perf_counter_ns() - started
        text_model = loaded.text_model
        limit = text_model.context_length(options)
        loaded.context_length = limit
        embeddings, count = [], 0
        for text in inputs:
            ids = _fit(text_model.tokenizer.encode(text), limit, truncate) or \
                [text_model.tokenizer.bos_token_id or 0]
            count += len(ids)
            vector = pooled_embedding(text_model, ids, normalize)
            embeddings.append(_dimensions(vector, dimensions, normalize))
    return {"model": name, "embeddings": embeddings,
            "total_duration": time.perf_counter_ns() - started, "load_duration": load_ns,
            "prompt_eval_count": count}
