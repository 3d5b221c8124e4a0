"""One fixed-shape decode step's data and its `AttentionCache` calls (`FixedDecodeStep`);
decode_step.py's module docstring says how the generator uses it.

The buffer holds FIELDS contiguous rows of `batch` values (token ids, cached lengths,
rotary offsets, write slots, attention lengths, rotary positions: worked out on the
host in `load`), then the page table [batch, pages]: one copy fills it, kernels take
each field as it is, and a graph captured over it serves every step of its bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from exl3cli.engine.kvcache.paged_attention import reference_paged_attention
from exl3cli.engine.kvcache.paged_cache import PagePool, PageTable
from exl3cli.ops import cuda_kernels as kernels

FIELDS = 6  # per-row values: ids, lengths, rope offsets, write slots, kv lengths, positions


class FixedDecodeStep:
    """The `cache` argument of CausalLM.forward (an `AttentionCache`,
    kvcache/attention_cache.py) for one fixed-shape decode step of `batch` rows over at
    most `pages` pages each (see the module docstring).

    `load(rows)` writes the host data (everything the layers read but the read slots
    of the PyTorch reference attention, made at first use); `prepare()` (called by the
    model inside the step) hands over the rotary positions."""

    # Its tokens were sampled from the vocabulary: never an image id (CausalLM.forward
    # then embeds them as text without checking on the device).
    text_only = True

    def __init__(self, pool: PagePool, batch: int, pages: int):
        if pool.scratch_page is None:
            raise ValueError("a fixed-shape decode step needs a pool with a scratch page")
        self.pool = pool
        self.batch = batch
        self.pages = pages
        self.span = pages * pool.page_size
        device = pool.device
        # FIELDS rows of `batch` (each field contiguous: kernels take them as they are),
        # then the page table [batch, pages].
        size = FIELDS * batch + batch * pages
        self.buffer = torch.zeros(size, dtype=torch.long, device=device)
        # Two pinned staging buffers, used in turn: while the GPU runs behind the host
        # (a step launched ahead), the copy out of one may not have run yet when the
        # next step is loaded. Each waits for its own last copy before it is rewritten.
        cuda = device.type == "cuda"
        self._host = [torch.zeros(size, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self._copied: list[Any] = [None, None]
        self._turn = 0
        (self.ids, self.lengths,  # lengths: tokens already cached = the new token's slot
         self.rope_offsets,  # rotary position - cache position
         self.write_slots,  # the pool slot of the new token's key/value
         self.kv_lengths,  # positions each row attends to (length + 1)
         self.positions,  # rotary positions (length + offset)
         ) = self.buffer[: FIELDS * batch].view(FIELDS, batch).unbind(0)
        self.page_table = self.buffer[FIELDS * batch:].view(batch, pages)
        self._read_slots: torch.Tensor | None = None
        self.greedy: torch.Tensor | None = None  # each row's argmax (EXL3_STEP_ARGMAX)
        self.rows = 0

    def load(self, rows: Sequence[tuple[PageTable, int | None]],
             ids: torch.Tensor | None = None, offsets: Sequence[int] | None = None,
             ahead: Sequence[int] | None = None) -> None:
        """Host data of this step: each row's token, length, rotary offset (`offsets`,
        default 0) and pages (padding rows: the scratch page, length 0). Row i's token
        sits `ahead[i]` (default 0) positions past its table's length (a draft of a
        verification pass). Allocates the page a row's new token needs. With `ids` (a
        device tensor [n], e.g. the tokens the step before sampled) the tokens come
        from there and those in `rows` are ignored."""
        if not 0 < len(rows) <= self.batch:
            raise ValueError(f"{len(rows)} rows for a step of {self.batch}")
        scratch, size, batch = self.pool.scratch_page, self.pool.page_size, self.batch
        # Padding rows: token 0 at length 0 of the scratch page.
        fields = [[0] * batch, [0] * batch, [0] * batch, [scratch * size] * batch,
                  [1] * batch, [0] * batch]
        tokens, lengths, rope, write, attend, positions = fields
        pages = [scratch] * (batch * self.pages)
        for i, (table, token) in enumerate(rows):
            extra = int(ahead[i]) if ahead is not None else 0
            table.slots(1 + extra)  # the page of the new position exists from here on
            if len(table.pages) > self.pages:
                raise ValueError(f"a row holds {len(table.pages)} pages, step has {self.pages}")
            length = table.length + extra
            offset = int(offsets[i]) if offsets is not None else 0
            tokens[i], lengths[i], rope[i] = int(token or 0), length, offset
            write[i] = table.pages[length // size] * size + length % size
            attend[i], positions[i] = length + 1, length + offset
            pages[i * self.pages : i * self.pages + len(table.pages)] = table.pages
        data = [value for field in fields for value in field] + pages
        turn = self._turn
        self._turn ^= 1
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()
        staging = self._host[turn]
        staging.copy_(torch.tensor(data, dtype=torch.long))
        self.buffer.copy_(staging, non_blocking=True)
        if staging.is_pinned():
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()
        if ids is not None:
            self.ids[: len(rows)].copy_(ids)
        self.rows = len(rows)

    def load_padding(self) -> None:
        """Host data of a step whose rows are all padding (the scratch page, length 0):
        what a graph is captured from before any job needs its bucket."""
        self.buffer.fill_(0)
        self.page_table.fill_(self.pool.scratch_page)
        self.write_slots.fill_(self.pool.scratch_page * self.pool.page_size)
        self.kv_lengths.fill_(1)
        self.rows = 0

    # ---- what CausalLM.forward and the layers call --------------------------------------

    def prepare(self) -> tuple[torch.Tensor, int]:
        """(rotary positions [1, B], span) for the rotary tables: cache lengths plus the
        rows' offsets (never above the lengths), loaded with the rest."""
        self._read_slots = None  # computed where a layer reads them (`read_slots`)
        return self.positions[None, :], self.span

    @property
    def read_slots(self) -> torch.Tensor:
        """The slots each row may read [B, span], for the PyTorch reference attention only:
        made at its first use in a step (a graph without it does not launch its kernels)."""
        if self._read_slots is None:
            size, table = self.pool.page_size, self.page_table
            offsets = torch.arange(size, device=table.device)
            self._read_slots = (table[:, :, None] * size + offsets).reshape(self.batch, -1)
        return self._read_slots

    def check_input(self, input_ids: torch.Tensor) -> None:
        if tuple(input_ids.shape) != (1, self.batch):
            raise ValueError(f"a decode step takes input_ids [1, {self.batch}], "
                             f"got {list(input_ids.shape)}")

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               window: int | None, *, softcap: float | None = None,
               scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """query [1, H, B, D], new key/value [1, KV, B, D] -> [1, H, B, D]: write the new
        keys/values, then each row attends to its first `kv_lengths` positions. `sinks`
        (gpt-oss) take the PyTorch reference: the kernel has none."""
        pool = self.pool
        pool.write(layer, self.write_slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
        rows = query[0].transpose(0, 1)  # [B, H, D]
        out = None if sinks is not None else kernels.paged_attention(
            rows, pool.keys[layer], pool.values[layer], pool.cache_type.key_bits,
            pool.cache_type.value_bits, self.page_table, self.kv_lengths, pool.page_size,
            window, softcap=softcap, scale=scale)
        if out is None:  # no kernel for this device or layout: the PyTorch reference
            out = reference_paged_attention(rows, pool, layer, self.read_slots,
                                            self.kv_lengths, window, softcap, scale, sinks)
        return out.transpose(0, 1).unsqueeze(0)

    def kv_target(self, layer: int, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(keys, values, write slots) of `layer` where a kernel may store the step's new
        keys/values itself (ops/layer_fold.py): an unquantized pool in `dtype`; else None."""
        pool = self.pool
        if pool.cache_type.quantized or pool.dtype != dtype or self.write_slots is None:
            return None
        keys, values = pool.keys[layer], pool.values[layer]
        if not (keys.is_contiguous() and values.is_contiguous()):
            return None
        return keys, values, self.write_slots

    def attend_parts(self, layer: int, query: torch.Tensor, key: torch.Tensor | None,
                     value: torch.Tensor | None, window: int | None, combine: bool = False
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """`attend` for rows query [B, H, D] and new key/value [B, KV, D] (None: already
        stored, `kv_target`), leaving the chunks uncombined: (part_acc, part_ml, out) for
        ops/layer_fold.combine_hadamard (out is written when there is one chunk); with
        `combine` (None, None, out) from the kernel's own combine, and without the kernel
        (None, None, out) from the PyTorch reference."""
        pool = self.pool
        if key is not None and value is not None:
            pool.write(layer, self.write_slots, key, value)
        batch, heads, dim = query.shape
        parts = None
        if not combine:
            chunks = kernels.attention_chunks(self.pages, pool.page_size)
            acc = torch.empty(batch, heads, chunks, dim, dtype=torch.float32, device=query.device)
            parts = (acc, acc.new_empty(batch, heads, chunks, 2))
        out = kernels.paged_attention(
            query, pool.keys[layer], pool.values[layer], pool.cache_type.key_bits,
            pool.cache_type.value_bits, self.page_table, self.kv_lengths, pool.page_size,
            window, parts=parts)
        if out is None:  # no kernel: the PyTorch reference, combined
            return None, None, reference_paged_attention(query, pool, layer, self.read_slots,
                                                         self.kv_lengths, window)
        return (None, None, out) if parts is None else (*parts, out)

    def select_last(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # one token per row: every row is its own last token

    def advance(self, counts: Sequence[int] | None = None) -> None:
        """Nothing: the generator commits the tokens on the host once it knows them."""

    def describe(self) -> dict:
        """The step's shape; its data is `buffer` (tensor-parallel ranks receive it by a
        broadcast, engine/generation/tp_driver.py)."""
        return {"kind": "fixed", "batch": self.batch, "pages": self.pages}

    def mirror(self, pool: PagePool) -> FixedDecodeStep:
        """This step over `pool` (another device's layers): the same buffer, copied."""
        step = FixedDecodeStep(pool, self.batch, self.pages)
        step.buffer.copy_(self.buffer)
        step.rows = self.rows
        return step
