"""Paged key/value cache: a pool of fixed 256-token pages shared by many sequences.

Storage is one flat array of "slots" per layer (slot = page * PAGE_SIZE + offset); a
sequence owns a page table (list of page indices) and reaches token position p at
slot `pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE`. Keys and values are kept in
the model's dtype, or quantized per EXL3-FORMAT.md section 6 (see kv_quant.py).

Prefix reuse: once a page is full, it is published under a hash chained over its
tokens and every token before it (so equal hashes mean equal prefixes). A new
sequence walks its prompt page by page and takes a reference on each published page
that matches. Pages are reference-counted; an unreferenced published page stays
reusable in an LRU list until its slot is needed by an allocation.

Admission reserves every page a sequence may ever need, so a running sequence never
fails to grow (no preemption needed).

One page of storage beyond `num_pages`, the scratch page, is never handed out: the
padding rows of a fixed-shape decode step (engine/generation/decode_step.py) write there.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import torch

from exl3cli.engine.kvcache.kv_quant import (
    KVCacheType,
    dequantize_rows,
    pack_codes,
    packed_width,
    quantize_rows,
    unpack_codes,
)
from exl3cli.ops import cuda_kernels as kernels

PAGE_SIZE = 256
ROOT_HASH = b"exl3-page-root"


def chain_hash(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The hash of a full page: its tokens and the hash of the page before it."""
    digest = hashlib.blake2b(previous, digest_size=16)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def pages_for(tokens: int, page_size: int = PAGE_SIZE) -> int:
    return -(-tokens // page_size)


class PagePool:
    """Key/value storage for `num_pages` pages of every layer, plus page bookkeeping."""

    def __init__(
        self,
        num_pages: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        cache_type: KVCacheType | None = None,
        page_size: int = PAGE_SIZE,
    ):
        if num_pages < 1:
            raise ValueError("a page pool needs at least one page")
        self.num_pages = num_pages
        self.scratch_page = num_pages  # storage only; never allocated to a sequence
        self.storage_pages = num_pages + 1
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.cache_type = cache_type or KVCacheType()
        slots = self.storage_pages * page_size
        channels = num_kv_heads * head_dim
        if self.cache_type.quantized:
            groups = channels // 32
            if channels % 32:  # let kv_quant raise its clear error
                quantize_rows(torch.zeros(1, channels), 8)

            def codes(bits: int) -> torch.Tensor:  # bit-packed, see kv_quant.pack_codes
                return torch.zeros(slots, packed_width(channels, bits), dtype=torch.uint8,
                                   device=device)

            def scales() -> torch.Tensor:
                return torch.zeros(slots, groups, dtype=torch.float16, device=device)

            key_bits, value_bits = self.cache_type.key_bits, self.cache_type.value_bits
            self.keys = [(codes(key_bits), scales()) for _ in range(num_layers)]
            self.values = [(codes(value_bits), scales()) for _ in range(num_layers)]
        else:
            shape = (slots, num_kv_heads, head_dim)
            self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.values = [torch.zeros(shape, dtype=dtype, device=device)
                           for _ in range(num_layers)]
        self.refcounts = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self._hash_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced, published
        self.reserved = 0

    # ---- bookkeeping ------------------------------------------------------------------

    @property
    def pages_in_use(self) -> int:
        """Pages referenced by at least one sequence."""
        return self.num_pages - len(self._free) - len(self._evictable)

    @property
    def cached_pages(self) -> int:
        """Unreferenced pages kept for prefix reuse (evicted when space is needed)."""
        return len(self._evictable)

    @property
    def available(self) -> int:
        """Pages that can still be reserved."""
        return len(self._free) + len(self._evictable) - self.reserved

    def reserve(self, count: int) -> bool:
        """Set aside `count` pages for later `allocate` calls; False if they don't exist."""
        if count > self.available:
            return False
        self.reserved += count
        return True

    def unreserve(self, count: int) -> None:
        self.reserved -= count

    def allocate(self) -> int:
        """A page from an earlier reservation, with one reference: a free page, else the
        least recently used unreferenced cached page (which loses its hash)."""
        if self.reserved < 1:
            raise RuntimeError("allocate() without a reservation")
        self.reserved -= 1
        if self._free:
            page = self._free.pop()
        else:
            page, _ = self._evictable.popitem(last=False)
            del self._page_of[self._hash_of.pop(page)]
        self.refcounts[page] = 1
        return page

    def lookup(self, page_hash: bytes) -> int | None:
        return self._page_of.get(page_hash)

    def is_evictable(self, page: int) -> bool:
        return page in self._evictable

    def retain(self, page: int) -> None:
        """One more reference on a published page (taking it off the LRU list)."""
        self._evictable.pop(page, None)
        self.refcounts[page] += 1

    def release(self, page: int) -> None:
        self.refcounts[page] -= 1
        if self.refcounts[page] > 0:
            return
        if page in self._hash_of:
            self._evictable[page] = None  # most recently used at the end
        else:
            self._free.append(page)

    def unpublish(self, page: int) -> None:
        """Make a page unfindable by its hash (its contents are about to change)."""
        page_hash = self._hash_of.pop(page, None)
        if page_hash is None:
            return
        del self._page_of[page_hash]
        if page in self._evictable:
            del self._evictable[page]
            self._free.append(page)

    def publish(self, page: int, page_hash: bytes) -> None:
        """Make a full page findable by its chain hash (first page with a hash wins)."""
        if page_hash not in self._page_of and page not in self._hash_of:
            self._page_of[page_hash] = page
            self._hash_of[page] = page_hash

    # ---- storage ----------------------------------------------------------------------

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor) -> None:
        """Store keys/values [N, kv_heads, head_dim] at flat `slots` [N]."""
        kind = self.cache_type
        if not kind.quantized:
            self.keys[layer].index_copy_(0, slots, keys.to(self.dtype))
            self.values[layer].index_copy_(0, slots, values.to(self.dtype))
            return
        for store, rows, bits in ((self.keys[layer], keys, kind.key_bits),
                                  (self.values[layer], values, kind.value_bits)):
            flat = rows.reshape(rows.shape[0], -1)
            if kernels.kv_quant_write(flat, slots, bits, store[0], store[1]):
                continue  # the CUDA kernel: quantize and pack in one pass
            codes, scales = quantize_rows(flat, bits)
            store[0].index_copy_(0, slots, pack_codes(codes, bits))
            store[1].index_copy_(0, slots, scales)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at `slots` (any shape S) as [*S, kv_heads, head_dim]."""
        kind = self.cache_type
        shape = (*slots.shape, self.num_kv_heads, self.head_dim)
        flat = slots.reshape(-1)
        if not kind.quantized:
            return (self.keys[layer].index_select(0, flat).view(shape),
                    self.values[layer].index_select(0, flat).view(shape))
        out = []
        for (codes, scales), bits in ((self.keys[layer], kind.key_bits),
                                      (self.values[layer], kind.value_bits)):
            rows = dequantize_rows(unpack_codes(codes.index_select(0, flat), bits),
                                   scales.index_select(0, flat), bits, self.dtype)
            out.append(rows.view(shape))
        return out[0], out[1]

    def bytes_per_token(self) -> float:
        """KV storage per token over all layers."""
        element = torch.empty(0, dtype=self.dtype).element_size()
        channels = self.num_kv_heads * self.head_dim
        return len(self.keys) * self.cache_type.bytes_per_token(channels, element)


class PageTable:
    """The pages of one sequence, the token ids they hold, and its page reservation."""

    def __init__(self, pool: PagePool, root_hash: bytes = ROOT_HASH):
        self.pool = pool
        # Where the chain of page hashes starts: sequences whose keys and values differ
        # for the same tokens (another LoRA adapter, engine/adapters/lora.py) start elsewhere.
        self.root_hash = root_hash
        self.pages: list[int] = []
        self.tokens: list[int] = []  # token ids whose keys/values are in the cache
        self.hashes: list[bytes] = []  # chain hash of each full page
        self.reserved = 0
        self.reused_tokens = 0

    @property
    def length(self) -> int:
        return len(self.tokens)

    def admit(self, prompt: Sequence[int], max_tokens: int) -> bool:
        """Reuse published pages matching the prompt's full pages (always leaving at
        least one prompt token to evaluate) and reserve the pages for up to `max_tokens`
        positions. False (and nothing held) when the pool cannot take the sequence."""
        pool, size = self.pool, self.pool.page_size
        matched: list[tuple[int, bytes]] = []
        previous = self.root_hash
        for start in range(0, len(prompt) - 1 - size + 1, size):
            page_hash = chain_hash(previous, prompt[start : start + size])
            page = pool.lookup(page_hash)
            if page is None:
                break
            matched.append((page, page_hash))
            previous = page_hash
        needed = pages_for(max_tokens, size) - len(matched)
        taken_from_lru = sum(pool.is_evictable(page) for page, _ in matched)
        if pool.available < needed + taken_from_lru:
            return False
        for page, page_hash in matched:
            pool.retain(page)
            self.pages.append(page)
            self.hashes.append(page_hash)
        pool.reserve(needed)
        self.reserved = needed
        self.tokens = list(prompt[: len(matched) * size])
        self.reused_tokens = len(self.tokens)
        return True

    def slots(self, count: int) -> list[int]:
        """Slots for the next `count` positions, allocating pages as needed."""
        size = self.pool.page_size
        start = self.length
        while len(self.pages) < pages_for(start + count, size):
            if self.reserved < 1:
                raise RuntimeError("sequence grew past its reserved pages")
            self.reserved -= 1
            self.pages.append(self.pool.allocate())
        return [self.pages[p // size] * size + p % size for p in range(start, start + count)]

    def all_slots(self, length: int) -> list[int]:
        size = self.pool.page_size
        return [self.pages[p // size] * size + p % size for p in range(length)]

    def commit(self, tokens: Sequence[int]) -> None:
        """`tokens` were written at the next positions; publish pages that became full."""
        self.tokens.extend(int(t) for t in tokens)
        size = self.pool.page_size
        while len(self.hashes) < self.length // size:
            index = len(self.hashes)
            previous = self.hashes[-1] if self.hashes else self.root_hash
            page_hash = chain_hash(previous, self.tokens[index * size : (index + 1) * size])
            self.hashes.append(page_hash)
            self.pool.publish(self.pages[index], page_hash)

    def truncate(self, length: int) -> None:
        """Forget the positions from `length` on: pages past it go back to this table's
        reservation, and a page that is no longer full stops being findable."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a sequence of {self.length} tokens to {length}")
        size = self.pool.page_size
        keep = pages_for(length, size)
        for page in self.pages[length // size :]:
            self.pool.unpublish(page)
        for page in self.pages[keep:]:
            self.pool.release(page)
        dropped = len(self.pages) - keep
        if dropped and self.pool.reserve(dropped):
            self.reserved += dropped
        self.pages = self.pages[:keep]
        self.hashes = self.hashes[: length // size]
        self.tokens = self.tokens[:length]
        self.reused_tokens = min(self.reused_tokens, length)

    def free(self) -> None:
        """Drop every page reference and the unused reservation (idempotent)."""
        for page in self.pages:
            self.pool.release(page)
        self.pool.unreserve(self.reserved)
        self.pages, self.hashes, self.tokens = [], [], []
        self.reserved = 0
