"""Structured output: mask logits so the answer is JSON (and matches a schema).

`build_constraint(format, tokenizer)` turns a request's `format` ("json" or a JSON
schema) into a `JsonConstraint`. The generation loop asks it, before each sample, for
the logits with every token masked whose bytes would break the JSON (`mask`), tells it
the token it picked (`accept`), and stops when it is `finished`.

Per tokenizer, once: every token's bytes, a byte trie over them, and which tokens are
"plain" string content (no quote, backslash or control byte). At each step the trie is
walked with the automaton's set of stacks, pruning at the first impossible byte; inside
a free string the plain tokens are allowed wholesale and only the rest are walked. The
result of a walk depends only on the stacks, so it is cached per stack set. Each allowed
token also carries the cost (bytes, hence tokens, since every byte is one token in
byte-level vocabularies) of finishing the value after it; with the tokens left in the
budget that keeps every answer completable: near the end only closing tokens remain.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from typing import Any

import torch

from exl3cli.engine.grammar import automaton
from exl3cli.engine.grammar.schema import Node, compile_schema, json_mode_root
from exl3cli.errors import InvalidOption

_CACHE_LIMIT = 4096
_STEP_MEMO_LIMIT = 400_000
_FALLBACK_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _gpt2_byte_decoder() -> dict[str, int]:
    """Byte-level BPE writes each byte as a printable character; this maps them back.
    Printable Latin-1 bytes stand for themselves, the rest are shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    shift = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + shift)
            shift += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _decoder_types(spec: Any) -> set[str]:
    if not isinstance(spec, dict):
        return set()
    found = {str(spec.get("type"))}
    for inner in spec.get("decoders") or []:
        found |= _decoder_types(inner)
    return found


def token_bytes(tokenizer: Any) -> list[bytes | None]:
    """The bytes each token id adds to the text; None for special tokens."""
    backend = tokenizer.backend
    size = tokenizer.vocab_size
    table: list[bytes | None] = [None] * size
    decoders = _decoder_types(json.loads(backend.to_str()).get("decoder"))
    byte_level = "ByteLevel" in decoders
    byte_map = _gpt2_byte_decoder()
    for text, token_id in backend.get_vocab(with_added_tokens=False).items():
        if token_id >= size:
            continue
        if byte_level and all(ch in byte_map for ch in text):
            table[token_id] = bytes(byte_map[ch] for ch in text)
        elif byte_level:
            table[token_id] = tokenizer.decode([token_id]).encode("utf-8")
        elif (match := _FALLBACK_TOKEN.match(text)) and "ByteFallback" in decoders:
            table[token_id] = bytes([int(match.group(1), 16)])
        else:
            table[token_id] = text.replace("\u2581", " ").encode("utf-8")
    for token_id, added in backend.get_added_tokens_decoder().items():
        if token_id < size:
            table[token_id] = None if added.special else added.content.encode("utf-8")
    return [b if b else None for b in table]


def _plain_string_content(data: bytes | None) -> bool:
    """Whole characters that may sit anywhere inside a JSON string."""
    if not data or b'"' in data or b"\\" in data or min(data) < 0x20:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class _TrieNode:
    __slots__ = ("children", "ids")

    def __init__(self) -> None:
        self.children: dict[int, _TrieNode] = {}
        self.ids: list[int] = []


def _trie(entries: list[tuple[int, bytes]]) -> _TrieNode:
    root = _TrieNode()
    for token_id, data in entries:
        node = root
        for byte in data:
            child = node.children.get(byte)
            if child is None:
                child = node.children[byte] = _TrieNode()
            node = child
        node.ids.append(token_id)
    return root


class TokenTable:
    """Per-tokenizer data for masking: token bytes, tries, plain-string tokens, caches."""

    def __init__(self, tokenizer: Any):
        self.bytes = token_bytes(tokenizer)
        self.size = len(self.bytes)
        self.eos_ids = sorted(i for i in tokenizer.eos_token_ids if 0 <= i < self.size)
        plain = [_plain_string_content(b) for b in self.bytes]
        self.plain = torch.tensor(plain, dtype=torch.bool)
        # characters per plain token (UTF-8 lead bytes), for minLength/maxLength strings
        self.plain_chars = torch.tensor(
            [sum(1 for x in b if (x & 0xC0) != 0x80) if p and b else 0
             for b, p in zip(self.bytes, plain, strict=True)], dtype=torch.long)
        entries = [(i, b) for i, b in enumerate(self.bytes) if b is not None]
        self.full_trie = _trie(entries)
        self.other_trie = _trie([(i, b) for i, b in entries if not plain[i]])
        self.lock = threading.Lock()
        self.masks: OrderedDict[frozenset, Any] = OrderedDict()
        self.steps: dict[tuple[frozenset, int], frozenset] = {}


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TABLES_LOCK = threading.Lock()
_SCHEMAS: OrderedDict[str, Node] = OrderedDict()


def token_table(tokenizer: Any) -> TokenTable:
    """The (cached) TokenTable of a tokenizer."""
    with _TABLES_LOCK:
        table = _TABLES.get(tokenizer)
        if table is None:
            table = _TABLES[tokenizer] = TokenTable(tokenizer)
        return table


def compile_format(fmt: Any) -> Node | None:
    """The root node for a request's `format`; None when there is no constraint.
    Schemas are compiled once per distinct text, so their mask caches are reused."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return json_mode_root()
    if isinstance(fmt, str):
        try:
            fmt = json.loads(fmt)
        except ValueError:
            raise InvalidOption(f"invalid format: {fmt!r} (use \"json\" or a JSON schema)") \
                from None
    if not isinstance(fmt, dict):
        raise InvalidOption("invalid format: use \"json\" or a JSON schema object")
    try:
        key = json.dumps(fmt, sort_keys=True)
    except (RecursionError, TypeError, ValueError):
        raise InvalidOption("invalid format: the JSON schema is nested too deeply") from None
    with _TABLES_LOCK:
        node = _SCHEMAS.get(key)
        if node is not None:
            _SCHEMAS.move_to_end(key)
            return node
    node = compile_schema(fmt)
    with _TABLES_LOCK:
        _SCHEMAS[key] = node
        while len(_SCHEMAS) > 64:
            _SCHEMAS.popitem(last=False)
    return node


def build_constraint(fmt: Any, tokenizer: Any) -> JsonConstraint | None:
    """A JsonConstraint for `format` ("json" or a schema), or None when unset."""
    root = compile_format(fmt)
    return None if root is None else JsonConstraint(root, token_table(tokenizer))


class _Allowed:
    """Allowed tokens of one stack set and the cost of finishing after each."""

    __slots__ = ("ids", "costs", "plain_costs", "eos")

    def __init__(self, ids: list[int], costs: list[int], plain_costs: Any, eos: bool):
        self.ids = torch.tensor(ids, dtype=torch.long)
        self.costs = torch.tensor(costs, dtype=torch.long)
        # plain string tokens: None (not allowed), one cost for all, or a LongTensor[size]
        self.plain_costs = plain_costs
        self.eos = eos


_NEVER = 1 << 40


class JsonConstraint:
    """The logit mask of one answer; feed it each chosen token through `accept`."""

    def __init__(self, root: Node, table: TokenTable):
        self.table = table
        self.stacks: frozenset = frozenset({automaton.initial_stack(root)})
        self._last_mask: torch.Tensor | None = None

    @property
    def finished(self) -> bool:
        """The value is complete and nothing may follow: stop generating."""
        return all(automaton.finished(s) for s in self.stacks)

    @property
    def complete(self) -> bool:
        return any(automaton.can_end(s) for s in self.stacks)

    def text_is_valid(self, data: bytes) -> bool:
        """Whether `data` may follow what was accepted so far (for tests and callers)."""
        return bool(self._advance_bytes(self.stacks, data))

    def allowed_mask(self, vocab_size: int, remaining: int) -> torch.Tensor:
        """BoolTensor[vocab_size]: tokens that keep the JSON valid and finishable within
        `remaining` more tokens (this one included)."""
        allowed = self._allowed()
        limit = max(remaining - 1, 0)
        size = self.table.size
        costs = allowed.plain_costs
        if isinstance(costs, int):  # free string content: all plain tokens or none
            mask = self.table.plain.clone() if costs <= limit else torch.zeros(size,
                                                                                 dtype=torch.bool)
        elif costs is not None:
            mask = costs <= limit
        else:
            mask = torch.zeros(size, dtype=torch.bool)
        if len(allowed.ids):
            mask[allowed.ids[allowed.costs <= limit]] = True
        if allowed.eos:
            mask[self.table.eos_ids] = True
        if not mask.any():  # the budget is too short to finish: take the cheapest steps
            plain = self._plain_vector(allowed)
            best = int(allowed.costs.min()) if len(allowed.ids) else _NEVER
            if plain is not None:
                best = min(best, int(plain.min()))
                mask |= plain == best
            if len(allowed.ids):
                mask[allowed.ids[allowed.costs == best]] = True
        if vocab_size > size:
            mask = torch.cat([mask, torch.zeros(vocab_size - size, dtype=torch.bool)])
        return mask[:vocab_size]

    def _plain_vector(self, allowed: _Allowed) -> torch.Tensor | None:
        costs = allowed.plain_costs
        if costs is None or isinstance(costs, torch.Tensor):
            return costs
        return torch.full((self.table.size,), costs, dtype=torch.long).masked_fill(
            ~self.table.plain, _NEVER)

    def mask(self, logits: torch.Tensor, remaining: int) -> torch.Tensor:
        """`logits` [V] with the disallowed tokens set to -inf."""
        allowed = self.allowed_mask(logits.shape[-1], remaining).to(logits.device)
        self._last_mask = allowed
        return logits.masked_fill(~allowed, float("-inf"))

    def accept(self, token: int, logits: torch.Tensor | None = None) -> int:
        """Advance past `token`; if it was not allowed (a sampler fell back to a masked
        token), the best allowed token of `logits` is taken instead. Returns the token."""
        token = int(token)
        if token in self.table.eos_ids:
            return token
        data = self.table.bytes[token] if 0 <= token < self.table.size else None
        after = self._advance_bytes(self.stacks, data) if data else frozenset()
        if not after and logits is not None and self._last_mask is not None:
            choice = torch.where(self._last_mask, logits, torch.full_like(logits, -1e30))
            token = int(torch.argmax(choice))
            if token in self.table.eos_ids:
                return token
            data = self.table.bytes[token] if token < self.table.size else None
            after = self._advance_bytes(self.stacks, data) if data else frozenset()
        if after:
            self.stacks = after
        return token

    # ---- internals --------------------------------------------------------------------

    def _advance(self, stacks: frozenset, byte: int) -> frozenset:
        memo = self.table.steps
        key = (stacks, byte)
        found = memo.get(key)
        if found is not None:
            return found
        result: set = set()
        for stack in stacks:
            result.update(automaton.step(stack, byte))
        frozen = frozenset(result)
        if len(memo) > _STEP_MEMO_LIMIT:
            memo.clear()
        memo[key] = frozen
        return frozen

    def _advance_bytes(self, stacks: frozenset, data: bytes | None) -> frozenset:
        for byte in data or b"":
            stacks = self._advance(stacks, byte)
            if not stacks:
                break
        return stacks

    @staticmethod
    def _cost(stacks: frozenset) -> int:
        return min(automaton.distance(s) + (0 if automaton.finished(s) else 1)
                   for s in stacks)

    def _allowed(self) -> _Allowed:
        stacks = self.stacks
        string_top = self._single_string_top(stacks)
        cacheable = string_top is None or not string_top[1].tracks_length
        table = self.table
        if cacheable:
            with table.lock:
                found = table.masks.get(stacks)
                if found is not None:
                    table.masks.move_to_end(stacks)
                    return found
        ids: list[int] = []
        costs: list[int] = []
        plain_costs = None
        if string_top is not None:
            plain_costs = self._plain_costs(next(iter(stacks)), string_top)
            self._walk(table.other_trie, stacks, ids, costs)
        else:
            self._walk(table.full_trie, stacks, ids, costs)
        allowed = _Allowed(ids, costs, plain_costs, self.complete)
        if cacheable:
            with table.lock:
                table.masks[stacks] = allowed
                while len(table.masks) > _CACHE_LIMIT:
                    table.masks.popitem(last=False)
        return allowed

    @staticmethod
    def _single_string_top(stacks: frozenset) -> tuple | None:
        """The string frame on top, when there is exactly one stack and it is in plain
        string content (not part-way through an escape)."""
        if len(stacks) != 1:
            return None
        top = next(iter(stacks))[-1]
        return top if top[0] == "S" and top[2] == 0 else None

    def _plain_costs(self, stack: tuple, top: tuple) -> int | torch.Tensor:
        """Finishing cost after each plain token (_NEVER where not allowed); one number
        when it is the same for all of them."""
        table = self.table
        node, length = top[1], top[3]
        below = automaton.distance(stack[:-1]) + 1 + 1  # closing quote, then EOS
        if not node.tracks_length:
            return below
        after = length + table.plain_chars
        cost = below + (node.min_length - after).clamp(min=0)
        bad = ~table.plain
        if node.max_length is not None:
            bad |= after > node.max_length
        return cost.masked_fill(bad, _NEVER)

    def _walk(self, node: _TrieNode, stacks: frozenset, ids: list[int],
              costs: list[int]) -> None:
        for byte, child in node.children.items():
            after = self._advance(stacks, byte)
            if not after:
                continue
            if child.ids:
                cost = self._cost(after)
                ids.extend(child.ids)
                costs.extend([cost] * len(child.ids))
            if child.children:
                self._walk(child, after, ids, costs)
