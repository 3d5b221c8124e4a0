"""Rebuild Hugging Face tokenizer files from GGUF `tokenizer.*` metadata.

Two GGUF tokenizer models are handled:
- `gpt2`: byte-level BPE (vocab + merges). The pre-tokenizer is chosen from
  `tokenizer.ggml.pre`, mirroring the regexes llama.cpp uses for each value.
- `llama`: SentencePiece BPE with byte fallback; merges are rebuilt from the
  token scores (a merge ranks by the score of the piece it produces).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from exl3cli.errors import ModelLoadError

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = range(1, 7)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` values whose llama.cpp regexes are "\p{N}" (single digits)
# followed by the GPT-2 regex: that is HF's Digits(individual) + ByteLevel.
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_LLAMA3_PRE = {"llama3", "llama-bpe", "llama-v3", "falcon3", "pixtral", "deepseek-r1-qwen"}
_QWEN2_PRE = {"qwen2", "qwen35", "megrez", "hunyuan"}


def byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The HF pre-tokenizer equivalent to llama.cpp's splitting for a `tokenizer.ggml.pre` value.

    Unknown values fall back to plain GPT-2 splitting, llama.cpp's own default.
    """
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in _LLAMA3_PRE or pre in _QWEN2_PRE:
        pattern = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def build_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to the GGUF's vocabulary."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens: list[str] | None = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError("GGUF file has no tokenizer vocabulary")
    types = metadata.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(metadata, tokens)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(metadata, tokens, types)
    else:
        raise ModelLoadError(f"GGUF tokenizer model {kind!r} is not supported (gpt2, llama are)")
    added = [
        AddedToken(tokens[i], special=types[i] == TOKEN_CONTROL, normalized=False)
        for i in range(len(tokens)) if types[i] in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
    ]
    tokenizer.add_tokens(added)  # ids already exist in the vocab: this only marks them
    bos = _special_token(metadata, tokens, "bos")
    if bos is not None and metadata.get("tokenizer.ggml.add_bos_token", False):
        bos_id = int(metadata["tokenizer.ggml.bos_token_id"])
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    return tokenizer


def write_tokenizer_files(metadata: dict[str, Any], folder: Path) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json into `folder`."""
    tokenizer = build_tokenizer(metadata)
    tokenizer.save(str(folder / "tokenizer.json"))
    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(metadata.get(
            f"{metadata.get('general.architecture', 'llama')}.context_length", 4096)),
        "added_tokens_decoder": {
            str(i): {"content": tokens[i], "special": types[i] == TOKEN_CONTROL,
                     "lstrip": False, "rstrip": False, "normalized": False, "single_word": False}
            for i in range(len(tokens)) if types[i] in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
        },
    }
    for role, key in (("bos", "bos_token"), ("eos", "eos_token"), ("unknown", "unk_token"),
                      ("padding", "pad_token")):
        text = _special_token(metadata, tokens, role)
        if text is not None:
            config[key] = text
    if metadata.get("tokenizer.chat_template"):
        config["chat_template"] = metadata["tokenizer.chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (folder / "generation_config.json").write_text(
        json.dumps(_generation_config(metadata), indent=2) + "\n")


def _generation_config(metadata: dict[str, Any]) -> dict[str, Any]:
    # End-of-turn / end-of-message tokens stop generation just like EOS does.
    eos_ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    config: dict[str, Any] = {}
    if "tokenizer.ggml.bos_token_id" in metadata:
        config["bos_token_id"] = int(metadata["tokenizer.ggml.bos_token_id"])
    if eos_ids:
        config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if "tokenizer.ggml.padding_token_id" in metadata:
        config["pad_token_id"] = int(metadata["tokenizer.ggml.padding_token_id"])
    return config


def _special_token(metadata: dict[str, Any], tokens: list[str], role: str) -> str | None:
    token_id = metadata.get(f"tokenizer.ggml.{role}_token_id")
    if token_id is None or not 0 <= int(token_id) < len(tokens):
        return None
    return tokens[int(token_id)]


def _byte_level_bpe(metadata: dict[str, Any], tokens: list[str]) -> Tokenizer:
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]
    pre = metadata.get("tokenizer.ggml.pre")
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                     ignore_merges=pre in _LLAMA3_PRE))
    tokenizer.pre_tokenizer = byte_level_pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def sentencepiece_merges(tokens: list[str], scores: list[float],
                         types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-driven merging.

    SentencePiece merges the adjacent pair whose joined piece has the highest score;
    as a BPE merge list that is every (left, right) split of a normal piece whose
    halves are both in the vocabulary, ranked by the joined piece's score.
    """
    vocab = {token: i for i, token in enumerate(tokens) if types[i] == TOKEN_NORMAL}
    ranked = []
    for piece, piece_id in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[piece_id], vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _sentencepiece_bpe(metadata: dict[str, Any], tokens: list[str], types: list[int]) -> Tokenizer:
    scores = metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {token: index for index, token in enumerate(tokens)}
    unk = _special_token(metadata, tokens, "unknown") or "<unk>"
    tokenizer = Tokenizer(models.BPE(
        vocab=vocab, merges=sentencepiece_merges(tokens, scores, types),
        unk_token=unk if unk in vocab else None, fuse_unk=True, byte_fallback=True))
    add_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("▁")] if add_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        *([decoders.Strip(" ", 1, 0)] if add_prefix else []),
    ])
    return tokenizer
