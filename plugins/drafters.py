"""Built-in speculative drafters (registered through the exl3cli entry-point group).

`ngram` (prompt lookup): the job's last n tokens are looked up earlier in its own text
(prompt and answer so far) and what followed them there is proposed. Answers that
quote, summarise or edit their input repeat long stretches of it, and those are
drafted for free: no second model, no extra memory.

`model`: any other DRAFT value names a small model with the same vocabulary (a store
name or a model folder), which drafts greedily. It is loaded once per process and
shared; each job keeps its own KV cache of it, re-using what it already holds of the
job's text (only the tokens after the last verified one are fed again).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from exl3cli.engine.paged_attention import PagedBatch
from exl3cli.engine.paged_cache import PagePool, PageTable, pages_for
from exl3cli.engine.speculative import Drafter
from exl3cli.errors import InvalidOption
from exl3cli.plugins import hookimpl


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the text's last n tokens
    (n from `max_ngram` down to `min_ngram`) and propose what followed it. One-token
    matches are off by default: on SmolLM2 they were mostly rejected and made free
    answers 12% slower on CPU (bench/NOTES-speculative.md)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise InvalidOption(f"ngram drafter: need 1 <= min <= max, got {min_ngram}, "
                                f"{max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, history: list[int], count: int) -> list[int]:
        size = len(history)
        if count <= 0:
            return []
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            tail = history[size - n:]
            # Latest match first: recent text predicts what comes next best.
            for start in range(size - n - 1, -1, -1):
                if history[start:start + n] == tail:
                    follow = history[start + n:start + n + count]
                    if follow:
                        return follow
        return []


def _ngram_factory(spec: str) -> Drafter:
    _, _, size = spec.partition(":")
    if not size:
        return NgramDrafter()
    if not size.isdigit() or not 1 <= int(size) <= 8:
        raise InvalidOption(f"DRAFT {spec!r}: use ngram or ngram:N with N in 1..8")
    return NgramDrafter(max_ngram=int(size))



_DRAFT_MODELS: dict[Path, Any] = {}
_LOAD_LOCK = threading.Lock()


def _draft_folder(spec: str) -> Path:
    path = Path(spec).expanduser()
    if path.is_dir():
        return path.resolve()
    from exl3cli.store.store import ModelStore

    return ModelStore().model_folder(spec)  # ModelNotFound for an unknown name


def _draft_model(spec: str) -> Any:
    from exl3cli.engine.loader import load_causal_lm

    folder = _draft_folder(spec)
    with _LOAD_LOCK:
        if folder not in _DRAFT_MODELS:
            _DRAFT_MODELS[folder] = load_causal_lm(folder)
        return _DRAFT_MODELS[folder]


def _common_prefix(a: list[int], b: list[int]) -> int:
    size = min(len(a), len(b))
    for i in range(size):
        if a[i] != b[i]:
            return i
    return size


class ModelDrafter:
    """Greedy drafts from a small model, with this job's own paged cache of it (a
    private page pool of one sequence, grown by doubling)."""

    def __init__(self, model: Any):
        self.model = model
        self.vocab_size = int(model.config.vocab_size)
        self._table: PageTable | None = None
        self._capacity = 0

    def _logits_after(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens], dtype=torch.long, device=self.model.device)
        batch = PagedBatch(self._table.pool, [self._table], [tokens])
        return self.model.forward(ids, batch, last_logits_only=True)[0, -1]

    def _new_cache(self, size: int) -> None:
        model, config = self.model, self.model.config
        pool = PagePool(pages_for(size), len(model.layers), config.num_kv_heads, config.head_dim,
                        model.dtype, model.device)
        self._table = PageTable(pool)
        self._table.admit([], size)
        self._capacity = size

    @torch.inference_mode()
    def propose(self, history: list[int], count: int) -> list[int]:
        need = len(history) + count
        limit = int(self.model.config.max_position_embeddings)
        if count <= 0 or not history or need > limit:
            return []
        if self._table is None or self._capacity < need:
            # Grow by doubling (re-fed from scratch): few reallocations per job.
            self._new_cache(min(limit, max(256, 1 << (need - 1).bit_length())))
        keep = min(_common_prefix(self._table.tokens, history), len(history) - 1)
        self._table.truncate(keep)
        logits = self._logits_after(history[keep:])
        proposals: list[int] = []
        for _ in range(count):
            proposals.append(int(torch.argmax(logits)))
            if len(proposals) == count:
                break
            logits = self._logits_after(proposals[-1:])
        return proposals

    def release(self) -> None:
        """The job ended: free this job's cache of the draft model."""
        self._table, self._capacity = None, 0


def _model_factory(spec: str) -> Drafter:
    return ModelDrafter(_draft_model(spec))


@hookimpl
def exl3_drafters() -> dict:
    return {"ngram": _ngram_factory, "model": _model_factory}
