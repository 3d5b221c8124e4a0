"""Encoded images as token ids past the vocabulary.

Each distinct image (by content digest) gets its own run of ids starting at or above
the model's vocab_size, one id per embedding row, kept for the life of the model. The
prompt carries those ids where the image's soft tokens go, so everything that works on
ids works on images unchanged: the paged cache's prefix hashes tell two images apart
and find the same image again (a follow-up turn reuses its pages), and `ImageTokens`
keeps the embeddings (LRU) so an image is encoded once, not once per turn.

The model's embedding step reads image rows from here (`embed`); within each image
(a maximal run of such ids) attention is bidirectional, as Gemma 3 trains it
(`block_ids` for whole sequences, `BlockAttentionBatch` over the paged cache). An
image's token grid (rows, columns), when its family gives one, is kept for good with its
ids: M-RoPE positions (mrope.py) follow it. `rope_positions` / `paged_rope_positions`
give a step's own rotary positions; None here: the cache positions.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from exl3cli.engine.kvcache.attention_cache import AttentionCache
from exl3cli.engine.kvcache.attention_math import softcapped_attention
from exl3cli.engine.kvcache.paged_attention import PagedBatch
from exl3cli.engine.text.token_ids import check_token_ids
from exl3cli.errors import InvalidOption

DEFAULT_CAPACITY = 64  # images whose embeddings stay in memory (least recently used go)


def image_runs(ids: Sequence[int], vocab_size: int) -> list[tuple[int, int]]:
    """[begin, end) of each maximal run of image ids (>= vocab_size) in `ids`."""
    runs: list[tuple[int, int]] = []
    begin = None
    for index, value in enumerate(ids):
        if value >= vocab_size:
            if begin is None:
                begin = index
        elif begin is not None:
            runs.append((begin, index))
            begin = None
    if begin is not None:
        runs.append((begin, len(ids)))
    return runs


def block_ids(input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """[B, T]: the index of the image run each position is in, -1 for text; None when
    there is no image token (transformers' get_block_sequence_ids_for_mask)."""
    image = input_ids >= vocab_size
    if not bool(image.any()):
        return None
    previous = F.pad(image, (1, 0), value=False)[:, :-1]
    groups = torch.cumsum((image & ~previous).long(), dim=1) - 1
    return torch.where(image, groups, torch.full_like(groups, -1))


def allowed_keys(start: int, count: int, runs: Iterable[tuple[int, int]],
                 window: int | None, device: torch.device) -> torch.Tensor:
    """[count, start + count] boolean: queries at positions start.. see keys causally,
    plus every key of their own image run (`runs` in positions of these queries,
    relative to `start`), within the sliding window when there is one."""
    keys = torch.arange(start + count, device=device)
    queries = torch.arange(start, start + count, device=device)[:, None]
    allowed = keys <= queries
    for begin, end in runs:
        allowed[begin:end, start + begin : start + end] = True
    if window is not None:
        allowed &= keys > queries - window
    return allowed


class ImageTokens:
    """Image embeddings by token id, for one model (thread-safe)."""

    # The rotary position of every token is its cache position; False where images
    # move positions (M-RoPE): the fixed-shape decode steps of decode_step.py then add
    # `decode_offset` to each row's cache length.
    cache_positions = True

    def __init__(self, vocab_size: int, capacity: int = DEFAULT_CAPACITY):
        self.vocab_size = vocab_size
        self.capacity = max(1, capacity)
        self.encoded = 0  # images encoded so far (a repeated image is not counted again)
        self._next = vocab_size
        self._firsts: dict[str, int] = {}  # digest -> its first id, for good
        self._counts: dict[int, int] = {}  # first id -> how many ids
        self._rows: OrderedDict[int, torch.Tensor] = OrderedDict()  # first id -> [n, hidden]
        self._sorted: list[int] = []  # first ids with rows, ascending
        self._known: list[int] = []  # every first id handed out, ascending
        self._grids: dict[int, tuple[int, int]] = {}  # first id -> (rows, columns)
        self._lock = threading.Lock()

    def ids_for(self, digest: str, encode: Callable[[], torch.Tensor],
                grid: tuple[int, int] | None = None) -> list[int]:
        """The token ids of the image `digest`, calling `encode()` -> [n, hidden] only
        when its embeddings are not held (first sight, or evicted since); `grid` is
        its tokens' (rows, columns), row-major, when the family lays them out so."""
        with self._lock:
            first = self._firsts.get(digest)
            if first is not None and first in self._rows:
                self._rows.move_to_end(first)
                return list(range(first, first + self._counts[first]))
        rows = encode()
        if grid is not None and grid[0] * grid[1] != rows.shape[0]:
            raise ValueError(f"an image of {rows.shape[0]} tokens has no {grid} grid")
        with self._lock:
            self.encoded += 1
            first = self._firsts.get(digest)
            if first is None or self._counts.get(first) != rows.shape[0]:
                first = self._next
                self._next += rows.shape[0]
                self._firsts[digest] = first
                self._counts[first] = rows.shape[0]
                self._known.append(first)
            if grid is not None:
                self._grids[first] = grid
            if first not in self._rows:
                bisect.insort(self._sorted, first)
            self._rows[first] = rows
            self._rows.move_to_end(first)
            while len(self._rows) > self.capacity:
                gone, _ = self._rows.popitem(last=False)
                self._sorted.remove(gone)
            return list(range(first, first + rows.shape[0]))

    def check(self, ids: Iterable[object], what: str = "prompt token") -> list[int]:
        """`ids` as ints, each in the vocabulary or an image id whose embeddings are
        held; InvalidOption otherwise (checked before a job joins a shared batch)."""
        ids = list(ids)
        limit = max(self._next, self.vocab_size)
        checked = check_token_ids(ids, limit, what)
        with self._lock:
            for index, value in enumerate(checked):
                if value >= self.vocab_size and self._locate(value) is None:
                    raise InvalidOption(f"{what} {index} is {value}: an image that is no "
                                        "longer held (send the image again)")
        return checked

    def _locate(self, value: int) -> tuple[int, int] | None:
        """(first id, row) of an image id whose rows are held; call with the lock."""
        at = bisect.bisect_right(self._sorted, value) - 1
        if at < 0:
            return None
        first = self._sorted[at]
        row = value - first
        return (first, row) if row < self._counts[first] else None

    def embed(self, input_ids: torch.Tensor,
              text_embed: Callable[[torch.Tensor], torch.Tensor],
              scale: float | None = None) -> torch.Tensor:
        """Embeddings [B, T, H] of input_ids: text ids through `text_embed`, image ids
        from the held rows (not scaled by Gemma's sqrt(hidden), which is for text only;
        times `scale` when the model carries a scaled residual stream)."""
        image = input_ids >= self.vocab_size
        if not bool(image.any()):
            return text_embed(input_ids)
        hidden = text_embed(input_ids.masked_fill(image, 0))
        wanted = input_ids[image].tolist()
        with self._lock:
            located = [self._locate(value) for value in wanted]
            if any(place is None for place in located):
                raise InvalidOption("an image token's embeddings are no longer held")
            rows = torch.cat(self._slices(located))  # type: ignore[arg-type]
        rows = rows.to(hidden.device, hidden.dtype)
        hidden[image] = rows if scale is None else rows * scale
        return hidden

    def _slices(self, located: list[tuple[int, int]]) -> list[torch.Tensor]:
        """The held rows at (first id, row) places, one slice per run of consecutive
        rows of one image (an image's 1,000+ tokens: one slice, not a row each)."""
        out = []
        begin = 0
        for end in range(1, len(located) + 1):
            if end < len(located) and located[end] == (located[end - 1][0],
                                                       located[end - 1][1] + 1):
                continue
            first, row = located[begin]
            out.append(self._rows[first][row : row + end - begin])
            begin = end
        return out

    def image_at(self, value: int) -> tuple[int, int, int, tuple[int, int] | None] | None:
        """(first id, row, token count, grid) of any image id handed out (held or
        not), None for an id that never was one."""
        with self._lock:
            at = bisect.bisect_right(self._known, value) - 1
            if at < 0:
                return None
            first = self._known[at]
            count = self._counts[first]
            return (first, value - first, count, self._grids.get(first)) \
                if value - first < count else None

    def rope_positions(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Rotary positions [3, B, T] of whole sequences, None: 0..T-1 (M-RoPE: mrope.py)."""
        return None

    def paged_rope_positions(self, batch: AttentionCache) -> torch.Tensor | None:
        """Rotary positions [3, 1, N] of a paged step's tokens, None: the cache's."""
        return None

    def decode_offset(self, history: Sequence[int]) -> int:
        """Rotary position minus cache position of a text token after `history`: 0."""
        return 0

    def block_ids(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Image runs of whole sequences (module function `block_ids`)."""
        return block_ids(input_ids, self.vocab_size)

    def runs(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        """[begin, end) of each image in a prompt: fed to the model in one step."""
        return image_runs(ids, self.vocab_size)

    def wrap_step(self, batch: AttentionCache, input_ids: torch.Tensor) -> AttentionCache:
        """A paged step whose prompt chunks hold image runs gets their bidirectional
        attention (BlockAttentionBatch); any other step is returned as it is."""
        if type(batch) is not PagedBatch:  # decode steps, draft verification
            return batch
        rows: dict[int, list[tuple[int, int]]] = {}
        for i, tokens in enumerate(batch.new_tokens):
            if len(tokens) > 1:
                runs = image_runs(tokens, self.vocab_size)
                if runs:
                    rows[i] = runs
        return BlockAttentionBatch(batch, rows) if rows else batch


class BlockAttentionBatch:
    """A PagedBatch whose rows in `rows` (index -> image runs in that row's new tokens)
    attend bidirectionally within each image run; everything else is the batch's own
    (an `AttentionCache`, kvcache/attention_cache.py)."""

    def __init__(self, batch: PagedBatch, rows: dict[int, list[tuple[int, int]]]):
        self.batch = batch
        self.image_rows = rows

    def prepare(self) -> tuple[torch.Tensor, int]:
        return self.batch.prepare()

    def check_input(self, input_ids: torch.Tensor) -> None:
        self.batch.check_input(input_ids)

    def advance(self) -> None:
        self.batch.advance()

    def select_last(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.batch.select_last(hidden)

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               window: int | None, *, softcap: float | None = None,
               scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        batch = self.batch
        out = batch.attend(layer, query, key, value, window, softcap=softcap, scale=scale,
                           sinks=sinks)
        for i, runs in self.image_rows.items():
            begin, end = batch.offsets[i], batch.offsets[i + 1]
            start = batch.starts[i]
            keys, values = batch.pool.read(layer, batch.row_slots(i))  # [S, KV, D]
            keys = keys.to(query.dtype).transpose(0, 1).unsqueeze(0)
            values = values.to(query.dtype).transpose(0, 1).unsqueeze(0)
            allowed = allowed_keys(start, end - begin, runs, window, query.device)
            rows = query[:, :, begin:end]
            if softcap is not None or sinks is not None:
                attended = softcapped_attention(
                    rows, keys, values, allowed,
                    scale if scale is not None else query.shape[-1]**-0.5, softcap,
                    sinks=sinks)
            else:  # the query already carries the layer's scale (Attention.attend)
                attended = F.scaled_dot_product_attention(
                    rows, keys, values, attn_mask=allowed,
                    enable_gqa=query.shape[1] != keys.shape[1])
            out[:, :, begin:end] = attended
        return out
