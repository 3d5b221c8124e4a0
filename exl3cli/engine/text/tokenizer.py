"""Text <-> token ids over a Hugging Face `tokenizer.json`, plus streaming decode.

BOS and EOS are read the way transformers reads them: `add_bos_token` in
tokenizer_config.json (or, when absent, whatever the post-processor adds), and EOS ids
merged from config.json, generation_config.json and tokenizer_config.json, because
chat models often end a turn with a token that only one of those files names.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from exl3cli.errors import ModelLoadError

# A UTF-8 character is at most 4 bytes, so at most 4 byte tokens can be pending on it;
# past that a U+FFFD in the text is real output, not an unfinished character.
_MAX_PENDING_TOKENS = 4
_REPLACEMENT = "\ufffd"


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path.name}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _ids(value: Any) -> list[int]:
    """An `eos_token_id` entry: an int, a list of ints, or null."""
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class Tokenizer:
    """Encode and decode text for one model."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        add_bos_default: bool | None = None,
    ):
        self.backend = backend
        if bos_token_id is None and bos_token is not None:
            bos_token_id = backend.token_to_id(bos_token)
        if bos_token is None and bos_token_id is not None:
            bos_token = backend.id_to_token(bos_token_id)
        self.bos_token = bos_token
        self.bos_token_id = bos_token_id
        eos_ids = set(eos_token_ids)
        if eos_token is not None and backend.token_to_id(eos_token) is not None:
            eos_ids.add(backend.token_to_id(eos_token))
        if eos_token is None and eos_ids:
            eos_token = backend.id_to_token(min(eos_ids))
        self.eos_token = eos_token
        self.eos_token_ids: set[int] = eos_ids
        if add_bos_default is None:
            add_bos_default = self._post_processor_adds_bos()
        self.add_bos_default = bool(add_bos_default) and self.bos_token_id is not None

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """Load tokenizer.json and the BOS/EOS facts from the files beside it."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{folder} has no tokenizer.json")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise ModelLoadError(f"cannot load tokenizer.json: {exc}") from exc
        tok_config = _read_json(folder / "tokenizer_config.json")
        model_config = _read_json(folder / "config.json")
        gen_config = _read_json(folder / "generation_config.json")

        eos_ids = _ids(model_config.get("eos_token_id")) + _ids(gen_config.get("eos_token_id"))
        bos_id = next(iter(_ids(model_config.get("bos_token_id"))), None)
        bos_token = _token_text(tok_config.get("bos_token"))
        if bos_token is not None and backend.token_to_id(bos_token) is not None:
            bos_id = backend.token_to_id(bos_token)  # the tokenizer's own word wins
        add_bos = tok_config.get("add_bos_token")
        return cls(
            backend,
            bos_token=bos_token,
            eos_token=_token_text(tok_config.get("eos_token")),
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            add_bos_default=add_bos if isinstance(add_bos, bool) else None,
        )

    def _post_processor_adds_bos(self) -> bool:
        if self.bos_token_id is None:
            return False
        with_special = self.backend.encode("a", add_special_tokens=True).ids
        return bool(with_special) and with_special[0] == self.bos_token_id

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised.

        The post-processor is bypassed so only the BOS we decide on is added (never a
        trailing EOS some post-processors append). `add_bos=None` uses the model default;
        a BOS already at the start of the text is not doubled.
        """
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos is None:
            add_bos = self.add_bos_default
        if add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def incremental_decoder(
        self, context_ids: Iterable[int] = (), skip_special_tokens: bool = True
    ) -> IncrementalDecoder:
        return IncrementalDecoder(self, context_ids, skip_special_tokens)


class IncrementalDecoder:
    """Turns a token stream into text deltas without ever splitting a character.

    Decoding tokens one at a time is wrong twice over: a byte-level or byte-fallback
    token may carry half a UTF-8 character, and SentencePiece decoders drop the space
    of a leading "▁". So each delta is the difference between decoding a short window
    with and without the new tokens, and it is held back while it ends in U+FFFD.
    `context_ids` (e.g. the prompt's last tokens) give the first token its left context.
    """

    def __init__(
        self, tokenizer: Tokenizer, context_ids: Iterable[int] = (), skip_special_tokens: bool = True
    ):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(context_ids)[-_MAX_PENDING_TOKENS:]
        self._prefix_start = 0  # window start: tokens already emitted, kept as context
        self._read_end = len(self._ids)  # tokens before this index have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly "")."""
        self._ids.append(int(token_id))
        pending = len(self._ids) - self._read_end
        return self._emit(force=pending > _MAX_PENDING_TOKENS)

    def flush(self) -> str:
        """Text still held back at the end of the stream (may contain U+FFFD)."""
        return self._emit(force=True)

    def _emit(self, force: bool) -> str:
        if self._read_end == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix_start : self._read_end])
        after = self._decode(self._ids[self._prefix_start :])
        if not force and (after.endswith(_REPLACEMENT) or len(after) <= len(before)):
            return ""
        if after.startswith(before):
            delta = after[len(before) :]
        else:  # a decoder that rewrites earlier text (cleanup rules): emit what differs
            delta = after[len(os.path.commonprefix([before, after])) :]
        self._prefix_start = self._read_end
        self._read_end = len(self._ids)
        # Drop context nobody needs any more so the list does not grow without bound.
        if self._prefix_start > 64:
            self._ids = self._ids[self._prefix_start :]
            self._read_end -= self._prefix_start
            self._prefix_start = 0
        return delta
