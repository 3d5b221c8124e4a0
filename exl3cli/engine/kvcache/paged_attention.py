"""Reference (PyTorch) attention over the paged cache, and the batch object that lets
`CausalLM.forward` run one step over many sequences of different lengths.

A step flattens every sequence's new tokens into one row: input_ids [1, N], where
sequence i contributes `counts[i]` tokens (1 for a decoding job, a chunk for a prompt
being ingested). Linear layers see N tokens without padding; attention is per
sequence: each layer writes the new keys/values into the sequence's pages, then reads
the sequence's whole history back from the pages (dequantized when the cache is
quantized, so a token attends to exactly what later tokens will see).
Decoding sequences (one new token) are attended to together in one padded batch;
prompt chunks one sequence at a time with a causal mask offset by the cached length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from exl3cli.engine.kvcache.attention_math import softcapped_attention, softmax_with_sinks
from exl3cli.engine.kvcache.paged_cache import PagePool, PageTable
from exl3cli.ops import cpu_kernels


def attend_chunk(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 start: int, window: int | None) -> torch.Tensor:
    """query [H, T, D] at positions start..start+T-1 over keys/values [S, KV, D]
    (positions 0..S-1, S = start + T); returns [H, T, D]."""
    heads, steps, _ = query.shape
    span, kv_heads = keys.shape[0], keys.shape[1]
    if start == 0 and (window is None or steps <= window):
        # A plain causal square: SDPA's causal kernel skips the masked half.
        return F.scaled_dot_product_attention(
            query.unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0), is_causal=True,
            enable_gqa=heads != kv_heads,
        )[0]
    key_pos = torch.arange(span, device=query.device)
    query_pos = torch.arange(start, start + steps, device=query.device)[:, None]
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    return F.scaled_dot_product_attention(
        query.unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0), attn_mask=allowed,
        enable_gqa=heads != kv_heads,
    )[0]


def attend_decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  lengths: torch.Tensor, window: int | None, *, softcap: float | None = None,
                  scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence: query [B, H, D]; keys/values [B, S, KV, D] right-padded;
    `lengths` [B] valid keys per row (the query sits at position lengths - 1).
    Scores are q.k * `scale` (default D**-0.5), then soft-capped when `softcap` is set
    (cap * tanh(score / cap), Gemma 2); `sinks` [H] join each softmax (gpt-oss)."""
    batch, heads, dim = query.shape
    kv_heads = keys.shape[2]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(grouped, keys.permute(0, 2, 3, 1))  # [B, KV, G, S]
    scores = scores * (dim**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    key_pos = torch.arange(keys.shape[1], device=query.device)
    allowed = key_pos < lengths[:, None]
    if window is not None:
        allowed &= key_pos >= (lengths[:, None] - window)
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    group = heads // kv_heads
    probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(kv_heads, group))
    probs = probs.to(values.dtype)
    out = torch.matmul(probs, values.transpose(1, 2))  # [B, KV, G, D]
    return out.reshape(batch, heads, dim)


class PagedBatch:
    """The `cache` argument of CausalLM.forward for one step over paged sequences (an
    `AttentionCache`, kvcache/attention_cache.py).

    `tables[i]` receives `new_tokens[i]` (token ids, in the order they appear in
    input_ids [1, N]). After the forward pass the tables hold the new tokens
    (`advance`, called by the model, commits them and publishes full pages).
    """

    def __init__(self, pool: PagePool, tables: Sequence[PageTable],
                 new_tokens: Sequence[Sequence[int]]):
        if len(tables) != len(new_tokens) or not tables:
            raise ValueError("a paged batch needs one token list per sequence")
        if any(len(tokens) == 0 for tokens in new_tokens):
            raise ValueError("every sequence in a paged batch needs at least one new token")
        self.pool = pool
        self.tables = list(tables)
        self.new_tokens = [list(tokens) for tokens in new_tokens]
        device = pool.device
        self.starts = [table.length for table in self.tables]
        self.counts = [len(tokens) for tokens in self.new_tokens]
        self.total = sum(self.counts)
        positions: list[int] = []
        slots: list[int] = []
        for table, start, count in zip(self.tables, self.starts, self.counts, strict=True):
            positions.extend(range(start, start + count))
            slots.extend(table.slots(count))
        self.positions = torch.tensor([positions], dtype=torch.long, device=device)
        self.write_slots = torch.tensor(slots, dtype=torch.long, device=device)
        self.span = max(s + c for s, c in zip(self.starts, self.counts, strict=True))
        offsets = [0]
        for count in self.counts:
            offsets.append(offsets[-1] + count)
        self.offsets = offsets
        self.last_index = torch.tensor([o - 1 for o in offsets[1:]], device=device)
        self._decode_rows = [i for i, c in enumerate(self.counts) if c == 1]
        self._chunk_rows = [i for i, c in enumerate(self.counts) if c > 1]
        self._decode_slots, self._decode_lengths = self._plan_decode()
        self._decode_index = torch.tensor([offsets[i] for i in self._decode_rows],
                                          dtype=torch.long, device=device)
        self._fused = self._fused_decode_possible()
        self._history_slots: dict[int, torch.Tensor] = {}
        for i in self._chunk_rows:
            self.row_slots(i)

    def _plan_decode(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self._decode_rows:
            return None, None
        lengths = [self.starts[i] + 1 for i in self._decode_rows]
        width = max(lengths)
        rows = []
        for i, length in zip(self._decode_rows, lengths, strict=True):
            slots = self.tables[i].all_slots(length)
            rows.append(slots + [slots[0]] * (width - length))  # padding is masked out
        device = self.pool.device
        return (torch.tensor(rows, dtype=torch.long, device=device),
                torch.tensor(lengths, dtype=torch.long, device=device))

    def _fused_decode_possible(self) -> bool:
        """Whether decode rows can use the fused CPU op on the pool's own storage: an
        unquantized float32 pool on CPU whose per-layer keys are [slots, kv, dim]."""
        pool = self.pool
        if pool.device.type != "cpu" or pool.dtype != torch.float32:
            return False
        if pool.cache_type.quantized or not self._decode_rows:
            return False
        keys = pool.keys[0] if pool.keys else None
        layout = (pool.storage_pages * pool.page_size, pool.num_kv_heads, pool.head_dim)
        if not isinstance(keys, torch.Tensor) or tuple(keys.shape) != layout:
            return False
        return keys.is_contiguous() and cpu_kernels.available()

    def prepare(self) -> tuple[torch.Tensor, int]:
        """(positions [1, N], span) of this step's tokens, for the rotary tables."""
        return self.positions, self.span

    def check_input(self, input_ids: torch.Tensor) -> None:
        if tuple(input_ids.shape) != (1, self.total):
            raise ValueError(f"a paged step takes input_ids [1, {self.total}], "
                             f"got {list(input_ids.shape)}")

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               window: int | None, *, softcap: float | None = None,
               scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """query [1, H, N, D], new key/value [1, KV, N, D] -> attention output [1, H, N, D].
        `softcap` (Gemma 2; with the score `scale`) or `sinks` (gpt-oss) run every
        sequence through the eager `attention_math.softcapped_attention`: the fused and SDPA
        paths do not cap scores or add sinks."""
        self.pool.write(layer, self.write_slots, key[0].transpose(0, 1),
                        value[0].transpose(0, 1))
        if softcap is not None or sinks is not None:
            return self._attend_softcapped(layer, query, window, softcap,
                                           scale if scale is not None else query.shape[-1]**-0.5,
                                           sinks)
        fused = self._fused and query.dtype == torch.float32
        if fused and not self._chunk_rows:
            # Decode only (the usual chat step): one op per layer reads the pages in
            # place, no gathered copy of the history.
            return self._attend_decode_fused(layer, query[0].transpose(0, 1),
                                             window).transpose(0, 1).unsqueeze(0)
        if not self._decode_rows and len(self._chunk_rows) == 1:
            # One prompt chunk (a cold prefill): SDPA's own output, no copy into a
            # batch-wide buffer (flash writes [T, H, D] rows: the caller's transpose back
            # to [N, H * D] is then free).
            keys, values = self.pool.read(layer, self.row_slots(self._chunk_rows[0]))
            return attend_chunk(query[0], keys.to(query.dtype), values.to(query.dtype),
                                self.starts[self._chunk_rows[0]], window).unsqueeze(0)
        out = torch.empty_like(query[0])  # [H, N, D]
        if self._decode_rows:
            index = self._decode_index
            rows = query[0, :, index].transpose(0, 1)
            if fused:
                decoded = self._attend_decode_fused(layer, rows, window)
            else:
                keys, values = self.pool.read(layer, self._decode_slots)
                decoded = attend_decode(rows, keys.to(query.dtype), values.to(query.dtype),
                                        self._decode_lengths, window)
            out[:, index] = decoded.transpose(0, 1)
        for i in self._chunk_rows:
            begin, end = self.offsets[i], self.offsets[i + 1]
            keys, values = self.pool.read(layer, self.row_slots(i))
            out[:, begin:end] = attend_chunk(query[0, :, begin:end], keys.to(query.dtype),
                                             values.to(query.dtype), self.starts[i], window)
        return out.unsqueeze(0)

    def _attend_softcapped(self, layer: int, query: torch.Tensor, window: int | None,
                           softcap: float | None, scale: float,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(query)
        for i in range(len(self.tables)):
            begin, end = self.offsets[i], self.offsets[i + 1]
            start, length = self.starts[i], self.starts[i] + self.counts[i]
            keys, values = self.pool.read(layer, self.row_slots(i))  # [S, KV, D]
            key_pos = torch.arange(length, device=query.device)
            query_pos = torch.arange(start, length, device=query.device)[:, None]
            allowed = key_pos <= query_pos
            if window is not None:
                allowed &= key_pos > query_pos - window
            out[:, :, begin:end] = softcapped_attention(
                query[:, :, begin:end], keys.to(query.dtype).transpose(0, 1).unsqueeze(0),
                values.to(query.dtype).transpose(0, 1).unsqueeze(0), allowed, scale, softcap,
                sinks=sinks,
            )
        return out

    def row_slots(self, i: int) -> torch.Tensor:
        """Slots of sequence i's whole history including this step, made once per step
        (every layer reads the same): up front for prompt chunks, on demand otherwise."""
        if i not in self._history_slots:
            self._history_slots[i] = torch.tensor(
                self.tables[i].all_slots(self.starts[i] + self.counts[i]),
                dtype=torch.long, device=self.write_slots.device)
        return self._history_slots[i]

    def fused_decode_slots(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(write_slots [N], decode_slots [N, S], lengths [N]) when this step is decode rows
        only (one new token per sequence) on a float32 CPU pool the fused op reads in
        place: what a whole-stack decode op (models/exl3_stack.py) needs; else None."""
        if not self._fused or self._chunk_rows or self._decode_slots is None:
            return None
        return self.write_slots, self._decode_slots, self._decode_lengths

    def _attend_decode_fused(self, layer: int, query: torch.Tensor,
                             window: int | None) -> torch.Tensor:
        """attend_decode on the CPU op, over the pool's storage in place: [B, H, D]."""
        return cpu_kernels.attend_decode_cpu(query, self.pool.keys[layer],
                                             self.pool.values[layer], self._decode_slots,
                                             self._decode_lengths, window)

    def select_last(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [1, N, E] -> each sequence's last new token, [1, num_seqs, E]."""
        return hidden[:, self.last_index]

    # ---- the same step over another pool (tensor parallel ranks, layer-split stages) ---

    def describe(self) -> dict:
        """What another pool with the same page layout needs to run this step: each
        sequence's pages, cached length and new-token count, and the rows
        `select_last` keeps (plain data: it crosses processes)."""
        size = self.pool.page_size
        rows = [(list(table.pages[: -(-(start + count) // size)]), start, count)
                for table, start, count in zip(self.tables, self.starts, self.counts,
                                               strict=True)]
        index = torch.arange(self.total, device=self.pool.device).view(1, self.total, 1)
        return {"kind": "paged", "rows": rows,
                "select": self.select_last(index).reshape(-1).tolist()}

    def mirror(self, pool: PagePool) -> PagedBatch:
        """This step over `pool` (same pages, other storage: another rank's KV heads
        or another device's layers)."""
        return mirrored_batch(pool, self.describe())

    def advance(self, counts: Sequence[int] | None = None) -> None:
        """Commit the new tokens into the page tables (the model calls this)."""
        for table, tokens in zip(self.tables, self.new_tokens, strict=True):
            table.commit(tokens)


class MirrorTable:
    """A page table seen from another pool: the pages and length the owning table has;
    nothing is allocated, committed or published here."""

    def __init__(self, pool: PagePool, pages: Sequence[int], length: int):
        self.pool, self.pages, self.length = pool, list(pages), length

    def slots(self, count: int) -> list[int]:
        size = self.pool.page_size
        return [self.pages[p // size] * size + p % size
                for p in range(self.length, self.length + count)]

    def all_slots(self, length: int) -> list[int]:
        size = self.pool.page_size
        return [self.pages[p // size] * size + p % size for p in range(length)]

    def commit(self, tokens: Sequence[int]) -> None:
        """Nothing: the owning table commits."""


def mirrored_batch(pool: PagePool, description: dict) -> PagedBatch:
    """`PagedBatch.describe()`'s step rebuilt over `pool` (module docstring of
    engine/generation/tp_worker.py)."""
    rows = description["rows"]
    tables = [MirrorTable(pool, pages, start) for pages, start, _ in rows]
    batch = PagedBatch(pool, tables, [[0] * count for _, _, count in rows])  # type: ignore[arg-type]
    batch.last_index = torch.tensor(description["select"], dtype=torch.long, device=pool.device)
    return batch


def reference_paged_attention(query: torch.Tensor, pool: PagePool, layer: int,
                              read_slots: torch.Tensor, kv_lengths: torch.Tensor,
                              window: int | None, softcap: float | None = None,
                              scale: float | None = None,
                              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query [B, H, D] over the first kv_lengths[b] positions of `read_slots` [B, S]
    (pages read and, for a quantized pool, dequantized): [B, H, D]."""
    keys, values = pool.read(layer, read_slots)
    return attend_decode(query, keys.to(query.dtype), values.to(query.dtype), kv_lengths,
                         window, softcap=softcap, scale=scale, sinks=sinks)
