"""The token loop: prefill, then sample and feed back one token at a time.

`generate_tokens` yields token ids and fills a `GenerationStats`; `stream_text` turns
them into text deltas, cut at stop strings, and ends with a `done` event carrying
Ollama's counters. Works with any model that has `forward(input_ids, cache)` and
`new_cache(batch_size, max_seq_len)` (see docs/CONTRACTS.md, Engine).
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from exl3cli.engine import cuda_graphs
from exl3cli.engine.sampling import Sampler
from exl3cli.engine.tokenizer import Tokenizer
from exl3cli.errors import ContextOverflow

# Prefill in chunks so activations (and, for models without `last_logits_only`,
# the [1, T, V] float32 logits) of a long prompt stay small.
PREFILL_CHUNK = 512


@dataclass
class GenerationStats:
    """Ollama's counters; durations in nanoseconds."""

    prompt_eval_count: int = 0
    prompt_eval_duration: int = 0
    eval_count: int = 0
    eval_duration: int = 0
    done_reason: str = "stop"  # "stop" (EOS, stop string, cancel) or "length"
    cancelled: bool = False


@dataclass
class TextEvent:
    """A text delta, or (done=True) the end of the answer with its counters."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    done: bool = False
    done_reason: str | None = None
    prompt_eval_count: int = 0
    prompt_eval_duration: int = 0
    eval_count: int = 0
    eval_duration: int = 0
    cancelled: bool = False


class StopStringMatcher:
    """Cuts streamed text at the first stop string, never showing part of one.

    `push(text)` returns the text that is safe to show and whether a stop string
    was found; a tail that could still grow into a stop string is held back until
    the next push proves otherwise (or `flush()` at the end releases it).
    """

    def __init__(self, stops: Iterable[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        buffer = self._held + text
        hits = [(buffer.find(s), s) for s in self.stops if s in buffer]
        if hits:
            index = min(position for position, _ in hits)
            self._held = ""
            self.stopped = True
            return buffer[:index], True
        hold = self._partial_stop_length(buffer)
        self._held = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_stop_length(self, buffer: str) -> int:
        """Length of the longest tail of `buffer` that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest


def _cache_capacity(cache: Any) -> int | None:
    for name in ("max_seq_len", "max_length", "max_len"):
        value = getattr(cache, name, None)
        if isinstance(value, int):
            return value
    return None


def _model_device(model: Any) -> torch.device:
    device = getattr(model, "device", None)
    if device is not None:
        return torch.device(device)
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


def _last_logits_fn(model: Any) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    """forward() for the last position's logits [V], skipping the vocabulary projection
    of the other positions when the model supports `last_logits_only`."""
    try:
        takes_flag = "last_logits_only" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes_flag = False

    def last_logits(input_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        with torch.inference_mode():
            if takes_flag:
                return model.forward(input_ids, cache, last_logits_only=True)[0, -1]
            return model.forward(input_ids, cache)[0, -1]

    return last_logits


def generate_tokens(
    model: Any,
    prompt_ids: list[int],
    sampler: Sampler,
    *,
    max_seq_len: int,
    num_predict: int = -1,
    eos_ids: Iterable[int] = (),
    cancel: threading.Event | None = None,
    stats: GenerationStats | None = None,
    cache: Any = None,
    constraint: Any = None,
) -> Iterator[int]:
    """Yield sampled token ids until EOS (not yielded), num_predict, context end or cancel.

    `num_predict` < 0 means up to the context limit (`max_seq_len`, or the given
    cache's capacity). The reason and counters land in `stats`. A `constraint`
    (engine/structured.py: `mask`, `accept`, `finished`) masks the logits before each
    sample, e.g. to keep the answer valid JSON; it ends the answer when it is finished.
    """
    stats = stats if stats is not None else GenerationStats()
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("generate_tokens needs at least one prompt token")
    # On CUDA the decode steps replay CUDA graphs over a cache the graph runner owns.
    session = cuda_graphs.open_session(model, 1, max_seq_len) if cache is None else None
    try:
        yield from _token_loop(model, prompt, sampler, max_seq_len, num_predict, eos_ids,
                               cancel, stats, session.cache if session else cache,
                               constraint, session)
    finally:
        if session is not None:
            session.close()


def _token_loop(model: Any, prompt: list[int], sampler: Sampler, max_seq_len: int,
                num_predict: int, eos_ids: Iterable[int], cancel: threading.Event | None,
                stats: GenerationStats, cache: Any, constraint: Any,
                session: cuda_graphs.DecodeSession | None) -> Iterator[int]:
    if cache is None:
        cache = model.new_cache(1, max_seq_len)
    capacity = _cache_capacity(cache) or max_seq_len
    if len(prompt) >= capacity:
        raise ContextOverflow(
            f"prompt is {len(prompt)} tokens but the context holds {capacity}"
        )
    room = capacity - len(prompt)
    budget = room if num_predict < 0 else min(num_predict, room)
    eos = set(eos_ids)
    device = _model_device(model)
    history = list(prompt)
    last_logits = _last_logits_fn(model)

    start = time.perf_counter_ns()
    logits = None
    for begin in range(0, len(prompt), PREFILL_CHUNK):
        if cancel is not None and cancel.is_set():
            break
        chunk = torch.tensor([prompt[begin : begin + PREFILL_CHUNK]], device=device)
        logits = last_logits(chunk, cache)
    stats.prompt_eval_count = len(prompt)
    stats.prompt_eval_duration = time.perf_counter_ns() - start

    produced = 0
    while True:
        if cancel is not None and cancel.is_set():
            stats.cancelled = True
            stats.done_reason = "stop"
            return
        if produced >= budget:
            stats.done_reason = "length"
            return
        # Time only our own work, not what the consumer does between tokens.
        start = time.perf_counter_ns()
        if constraint is not None:
            if constraint.finished:
                stats.done_reason = "stop"
                return
            logits = constraint.mask(logits, budget - produced)
        token = sampler.sample(logits, history)
        if constraint is not None:
            token = constraint.accept(token, logits)
        produced += 1
        stats.eval_count += 1
        if token in eos:
            stats.eval_duration += time.perf_counter_ns() - start
            stats.done_reason = "stop"
            return
        history.append(token)
        if produced < budget and not (cancel is not None and cancel.is_set()):
            if session is not None:
                logits = session.step([token])[0]
            else:
                logits = last_logits(torch.tensor([[token]], device=device), cache)
        stats.eval_duration += time.perf_counter_ns() - start
        yield token


def _special_stop_ids(tokenizer: Tokenizer, stops: Iterable[str]) -> set[int]:
    """Stop strings that name a special token (e.g. "<|im_end|>") stop on its id,
    because special tokens are not part of the decoded text."""
    specials = {
        added.content: token_id
        for token_id, added in tokenizer.backend.get_added_tokens_decoder().items()
        if added.special
    }
    return {specials[s] for s in stops if s in specials}


def stream_text(
    model: Any,
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    sampler: Sampler,
    *,
    max_seq_len: int,
    stop: Iterable[str] = (),
    num_predict: int = -1,
    cancel: threading.Event | None = None,
    cache: Any = None,
    constraint: Any = None,
) -> Iterator[TextEvent]:
    """Text deltas of the answer to `prompt_ids`, then one event with done=True.
    `constraint`: see generate_tokens (structured output)."""
    stops = [s for s in stop if s]
    stats = GenerationStats()
    eos_ids = set(tokenizer.eos_token_ids) | _special_stop_ids(tokenizer, stops)
    decoder = tokenizer.incremental_decoder(context_ids=prompt_ids)
    matcher = StopStringMatcher(stops)
    tokens = generate_tokens(
        model, prompt_ids, sampler, max_seq_len=max_seq_len, num_predict=num_predict,
        eos_ids=eos_ids, cancel=cancel, stats=stats, cache=cache, constraint=constraint,
    )
    stopped = False
    pending: list[int] = []  # tokens whose text is still held back
    try:
        for token in tokens:
            pending.append(token)
            text, stopped = matcher.push(decoder.push(token))
            if text:
                yield TextEvent(text=text, token_ids=pending)
                pending = []
            if stopped:
                stats.done_reason = "stop"
                break
    finally:
        tokens.close()
    if not stopped:
        text, stopped = matcher.push(decoder.flush())
        text += matcher.flush()
        if text:
            yield TextEvent(text=text, token_ids=pending)
        if stopped:
            stats.done_reason = "stop"
    yield TextEvent(
        done=True,
        done_reason=stats.done_reason,
        prompt_eval_count=stats.prompt_eval_count,
        prompt_eval_duration=stats.prompt_eval_duration,
        eval_count=stats.eval_count,
        eval_duration=stats.eval_duration,
        cancelled=stats.cancelled,
    )
