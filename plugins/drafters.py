"""Built-in speculative drafters (registered through the exl3cli entry-point group).

`ngram` (prompt lookup): the job's last n tokens are looked up earlier in its own text
(prompt and answer so far) and what followed them there is proposed. Answers that
quote, summarise or edit their input repeat long stretches of it, and those are
drafted for free: no second model, no extra memory.

`model`: any other DRAFT value names a small model with the same vocabulary (a store
name or a model folder), which drafts greedily. It is loaded once per process and
shared, with one paged cache in which each job keeps its own text (only the tokens
after the last verified one are fed again); the jobs of a step are drafted together.
Its one-token forwards run as fixed-shape decode steps of its own (decode_step.py: CUDA
graphs on a GPU, as the target's steps; EXL3_DECODE_MODE applies; EXL3_DRAFT_STEPS=0
turns them off): the 2.0 bpw SmolLM2's forward took 58 ms on the H200's general path
(run 53), 3.7 ms as a graphed step (run 56). Longer feeds (a job's catch-up) take the
general path.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import torch

from exl3cli.engine.generation.decode_step import DecodeRunner
from exl3cli.engine.generation.draft_gate import SHORT_FEED, DraftForwardCost
from exl3cli.engine.generation.speculative import Drafter
from exl3cli.engine.kvcache.paged_attention import PagedBatch
from exl3cli.engine.kvcache.paged_cache import PAGE_SIZE, PagePool, PageTable, pages_for
from exl3cli.envvars import switch
from exl3cli.errors import InvalidOption, InvalidSetting
from exl3cli.hookspecs import hookimpl


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the text's last n tokens
    (n from `max_ngram` down to `min_ngram`) and propose what followed it. One-token
    matches are off by default: on SmolLM2 they were mostly rejected and made free
    answers 12% slower on CPU (bench/NOTES-speculative.md).

    One per job, so it keeps an index of its job's text (for each n, every n-gram that
    has a token after it -> its latest start), extended by the tokens added since the
    last call: a lookup is a few dict reads, not a scan of the text (which cost ~0.1-0.2
    ms a job at a few hundred tokens: 16 jobs' scans were as long as the GPU's step).
    The same lookup is the generator's `peek` (ahead_step.py: whether a step may run
    ahead without this job's draft)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise InvalidOption(f"ngram drafter: need 1 <= min <= max, got {min_ngram}, "
                                f"{max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._index: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_ngram, max_ngram + 1)}
        self._items = list(self._index.items())
        self._sizes = range(max_ngram, min_ngram - 1, -1)  # longest match first
        self._seen = 0  # tokens of the text indexed so far
        self._first: int | None = None  # its first and last token (the cheap check below)
        self._last: int | None = None

    def _extend(self, history: list[int]) -> None:
        """Index `history` from where the indexed text left off. A job's text only grows,
        so a text that is not longer, or whose first or last indexed token changed, is
        another text: indexed anew. (A text changed only in between would keep a stale
        index: worse drafts, never other output, as every draft is verified.)"""
        seen, size = self._seen, len(history)
        if seen and (size < seen or history[0] != self._first
                     or history[seen - 1] != self._last):
            for table in self._index.values():
                table.clear()
            seen = 0
        if seen == size:
            return
        items = self._items
        for end in range(max(seen, 1), size):
            # the n-grams ending just before `end` now have a token after them
            for n, table in items:
                start = end - n
                if start >= 0:
                    table[tuple(history[start:end])] = start
        self._seen, self._first, self._last = size, history[0], history[-1]

    def propose(self, history: list[int], count: int) -> list[int]:
        if count <= 0:
            return []
        self._extend(history)
        size = len(history)
        index = self._index
        for n in self._sizes:
            if n < size:
                start = index[n].get(tuple(history[size - n:]))
                if start is not None:  # the latest earlier match: recent text predicts best
                    return history[start + n:start + n + count]
        return []

    # The generator's guess ahead (ahead_step._peeks_dry) is the lookup itself, on the
    # text known at launch: it changes nothing but the index. On 3-token matches only it
    # broke the run-ahead chain less on free text but started drafting later on copied
    # text (run 59: grounded 1.93x / 0.92x at 1 / 16 jobs against run 58's 2.07x / 1.03x).
    peek = propose


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
    from exl3cli.engine.models.loader import load_causal_lm

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


log = logging.getLogger(__name__)
DRAFT_STEP_ROWS = 64  # jobs one fixed-shape draft step takes (more: the general path)
DRAFT_STEP_CONTEXT = 8192  # positions it covers (a longer text drafts on the general path)


class _SharedDraftCache:
    """The paged KV cache of one draft model, shared by all the jobs it drafts for, so
    that their drafts run as one batch. It grows by doubling: a job that no longer fits
    moves the cache to a pool twice the size (jobs re-feed their text into it)."""

    def __init__(self, model: Any):
        self.model = model
        self.pool: PagePool | None = None
        self.lock = threading.Lock()  # generators of several targets may share a draft
        # Its forwards' time, which the generator's gate weighs against a plain step.
        self.forward_cost = DraftForwardCost()
        self.runner: DecodeRunner | None = None  # fixed-shape steps over `pool`
        self.steps = switch("EXL3_DRAFT_STEPS", True)
        self.captures = 0  # CUDA graphs its steps captured, all runners (benchmarks)

    def _new_pool(self, pages: int) -> None:
        config = self.model.config
        self.pool = PagePool(pages, len(self.model.layers), config.num_kv_heads,
                             config.head_dim, self.model.dtype, self.model.device)
        self.runner = None  # its steps (and graphs) were the old pool's

    def step_runner(self, rows: list[tuple[PageTable, int]]) -> DecodeRunner | None:
        """The fixed-shape step that can take these one-token rows, or None (the general
        path: off on the CPU by default, a model that cannot run them, too many rows)."""
        if not self.steps or self.pool is None or not rows:
            return None
        if self.runner is None:
            context = min(int(self.model.config.max_position_embeddings), DRAFT_STEP_CONTEXT)
            try:
                self.runner = DecodeRunner(self.model, self.pool, DRAFT_STEP_ROWS, context)
            except InvalidSetting:
                raise  # a bad EXL3_DECODE_MODE is the user's to hear of, not a fallback
            except (ValueError, AttributeError, TypeError) as error:
                log.debug("draft model: no fixed-shape steps (%s)", error)
                self.steps = False
                return None
        return self.runner if self.runner.fits(rows) else None

    def forward(self, tables: list[PageTable], feeds: list[list[int]], jobs: int,
                scratch: bool = False) -> list[int]:
        """One draft forward, timed: each table's feed at its next positions; the greedy
        pick after each. Feeds of one token run as a fixed-shape step where one fits;
        what is fed is committed to the tables either way."""
        short = max(len(feed) for feed in feeds) <= SHORT_FEED
        rows = [(table, feed[0]) for table, feed in zip(tables, feeds, strict=True)]
        runner = self.step_runner(rows) if all(len(f) == 1 for f in feeds) else None
        with self.forward_cost.timing(jobs, short, scratch=scratch) as timed:
            if runner is not None:
                captures = runner.captures
                logits = runner.run(rows)
            else:
                ids = torch.tensor([[t for feed in feeds for t in feed]], dtype=torch.long,
                                   device=self.model.device)
                batch = PagedBatch(self.pool, tables, feeds)
                logits = self.model.forward(ids, batch, last_logits_only=True)[0]
            picks = torch.argmax(logits, dim=-1).tolist()  # the sync
            if runner is not None and runner.captures != captures:
                timed.discard()  # a graph captured: not a draft forward's cost
                self.captures += runner.captures - captures
        if runner is not None:
            for table, feed in zip(tables, feeds, strict=True):
                table.commit(feed)  # the general path's PagedBatch commits by itself
            if timed.discarded and scratch:  # time the replay, not the capture
                for table in tables:
                    table.truncate(table.length - 1)
                return self.forward(tables, feeds, jobs, scratch)
        return [int(token) for token in picks]

    def table_for(self, drafter: ModelDrafter, need: int) -> PageTable:
        """`drafter`'s table with room for `need` positions (possibly a new, empty one)."""
        table = drafter.table
        if table is not None and table.pool is self.pool and drafter.capacity >= need:
            return table
        if table is not None:
            table.free()
        size = max(PAGE_SIZE, 1 << (need - 1).bit_length())
        limit = int(self.model.config.max_position_embeddings)
        size = min(limit, size)
        if self.pool is None:
            self._new_pool(4 * pages_for(size))
        table = PageTable(self.pool)
        if not table.admit([], size):
            # Full: a pool twice as large (jobs still in the old one move when they
            # next draft; the old pool goes when its last table does).
            self._new_pool(max(2 * self.pool.num_pages, 4 * pages_for(size)))
            table = PageTable(self.pool)
            table.admit([], size)
        drafter.table, drafter.capacity = table, size
        return table


_CACHES: dict[int, _SharedDraftCache] = {}


def _shared_cache(model: Any) -> _SharedDraftCache:
    with _LOAD_LOCK:
        return _CACHES.setdefault(id(model), _SharedDraftCache(model))


class ModelDrafter:
    """Greedy drafts from a small model. All jobs drafting with one model share its
    paged cache (each its own page table) and are drafted together: one draft forward
    per drafted position for all of them (`propose_batch`), not one per job. A job
    re-uses what its table holds of its text: only the tokens after the last verified
    one are fed again."""

    def __init__(self, model: Any):
        self.model = model
        self.vocab_size = int(model.config.vocab_size)
        self.cache = _shared_cache(model)
        self.batch_key = id(self.cache)  # jobs with one key draft together
        self.forward_cost = self.cache.forward_cost  # timed here, judged by the generator
        self.table: PageTable | None = None
        self.capacity = 0

    def propose(self, history: list[int], count: int) -> list[int]:
        return self.propose_batch([self], [history], [count])[0]

    @torch.inference_mode()
    def propose_batch(self, drafters: list[ModelDrafter], histories: list[list[int]],
                      counts: list[int]) -> list[list[int]]:
        """Greedy drafts for several jobs of this draft model: up to counts[i] tokens
        after histories[i], drafted position by position for all jobs at once."""
        limit = int(self.model.config.max_position_embeddings)
        proposals: list[list[int]] = [[] for _ in drafters]
        with self.cache.lock:
            while True:  # again if the cache grew midway: every table in the same pool
                rows, feeds = [], []
                for i, (drafter, history, count) in enumerate(
                        zip(drafters, histories, counts, strict=True)):
                    need = len(history) + count
                    if count <= 0 or not history or need > limit:
                        continue
                    table = self.cache.table_for(drafter, need)
                    keep = min(_common_prefix(table.tokens, history), len(history) - 1)
                    table.truncate(keep)
                    rows.append(i)
                    feeds.append(history[keep:])
                if all(drafters[i].table.pool is self.cache.pool for i in rows):
                    break
            while rows:
                tables = [drafters[i].table for i in rows]
                picks = self.cache.forward(tables, feeds, len(rows))
                for i, token in zip(rows, picks, strict=True):
                    proposals[i].append(int(token))
                rows = [i for i in rows if len(proposals[i]) < counts[i]]
                feeds = [proposals[i][-1:] for i in rows]
        return proposals

    @torch.inference_mode()
    def time_forward(self, jobs: int) -> None:
        """Time one draft forward over `jobs` one-token rows of scratch tables (freed
        after): what a drafted position costs, without catching up any job's text
        first (the generator's gate asks before it drafts: draft_gate.py)."""
        with self.cache.lock:
            if self.cache.pool is None:
                self.cache._new_pool(max(4, 2 * jobs))
            tables = []
            for _ in range(jobs):
                table = PageTable(self.cache.pool)
                if not table.admit([], 1):
                    break
                tables.append(table)
            if len(tables) == jobs:
                self.cache.forward(tables, [[0] for _ in tables], jobs, scratch=True)
            for table in tables:
                table.free()

    def release(self) -> None:
        """The job ended: give its pages back to the shared cache."""
        if self.table is not None:
            with self.cache.lock:
                self.table.free()
        self.table, self.capacity = None, 0


def _model_factory(spec: str) -> Drafter:
    return ModelDrafter(_draft_model(spec))


@hookimpl
def exl3_drafters() -> dict:
    return {"ngram": _ngram_factory, "model": _model_factory}
