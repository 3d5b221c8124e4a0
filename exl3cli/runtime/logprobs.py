"""Log-probabilities of the sampled tokens (`logprobs`, `top_logprobs` in a request).

`LogprobRecorder` wraps a job's Sampler: each time the generator samples a token it
notes that token's log-probability under the model's distribution (log-softmax of the
logits the sampler was given: after a JSON constraint's mask, before temperature and the
other sampler steps, as OpenAI and Ollama report them) and the `top` most likely
alternatives. The runner then attaches them to the response objects, in the shape both
Ollama and OpenAI chat use: `{"token", "logprob", "bytes", "top_logprobs": [...]}`.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import torch

from exl3cli.errors import InvalidOption

MAX_TOP_LOGPROBS = 20


def logprob_request(req: dict[str, Any]) -> int | None:
    """None when the request wants no logprobs, else how many alternatives per token."""
    wanted, top = req.get("logprobs"), req.get("top_logprobs")
    if not wanted:
        if top:
            raise InvalidOption("top_logprobs needs logprobs: true")
        return None
    if top is None:
        return 0
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidOption(f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}")
    return top


Record = tuple[int, float, list[tuple[int, float]]]


class LogprobRecorder:
    """A Sampler that also records what it sampled (see the module docstring)."""

    def __init__(self, sampler: Any, top: int):
        self._sampler = sampler
        self._top = top
        self._records: deque[Record] = deque()
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sampler, name)

    def sample(self, logits: torch.Tensor, history: list[int]) -> int:
        token = self._sampler.sample(logits, history)
        log_probs = torch.log_softmax(logits.detach().to(torch.float32).flatten(), dim=-1)
        top: list[tuple[int, float]] = []
        if self._top:
            values, ids = torch.topk(log_probs, min(self._top, log_probs.numel()))
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        with self._lock:
            self._records.append((token, float(log_probs[token]), top))
        return token

    def take(self, count: int) -> list[Record]:
        """The records of the next `count` sampled tokens (fewer if not sampled yet)."""
        with self._lock:
            return [self._records.popleft() for _ in range(min(count, len(self._records)))]


def _entry(tokenizer: Any, token: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([token], skip_special_tokens=False)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def logprob_entries(tokenizer: Any, records: list[Record]) -> list[dict[str, Any]]:
    """Records as response entries (Ollama's and OpenAI chat's shape)."""
    entries = []
    for token, logprob, top in records:
        entry = _entry(tokenizer, token, logprob)
        entry["top_logprobs"] = [_entry(tokenizer, t, lp) for t, lp in top]
        entries.append(entry)
    return entries


def completion_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The legacy /v1/completions shape: parallel lists and character offsets."""
    offsets, position = [], 0
    for entry in entries:
        offsets.append(position)
        position += len(entry["token"])
    return {"tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]}
                             for e in entries],
            "text_offset": offsets}
