import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from exl3cli.engine.text.tokenizer import Tokenizer
from exl3cli.errors import ModelLoadError
from tests.fixtures.tiny_tokenizer import (
    write_tiny_sentencepiece_tokenizer,
    write_tiny_tokenizer,
)

MIXED_TEXTS = [
    "Hello world 😀 东京 café!",
    "日本語のテキスト。",
    "🎉🎉 naïve über 😀",
    "plain ascii text",
]


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("bl"))


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory):
    return write_tiny_sentencepiece_tokenizer(tmp_path_factory.mktemp("sp"))


def _stream(decoder, ids):
    return [decoder.push(i) for i in ids] + [decoder.flush()]


def test_roundtrip_byte_level(byte_level):
    tok = Tokenizer.from_folder(byte_level)
    for text in MIXED_TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text


def test_special_tokens_in_text_are_single_ids(byte_level):
    tok = Tokenizer.from_folder(byte_level)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert ids[-1] == tok.token_to_id("<|im_end|>")
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_eos_ids_are_merged_from_three_files(tmp_path):
    folder = write_tiny_tokenizer(
        tmp_path, eos_token="<|im_end|>", config_eos_ids=0, generation_eos_ids=[0, 1]
    )
    tok = Tokenizer.from_folder(folder)
    im_end = tok.token_to_id("<|im_end|>")
    assert im_end not in (0, 1)
    assert tok.eos_token_ids == {0, 1, im_end}
    assert tok.eos_token == "<|im_end|>"


def test_eos_from_generation_config_int(tmp_path):
    folder = write_tiny_tokenizer(tmp_path, generation_eos_ids=1)
    (folder / "tokenizer_config.json").write_text(json.dumps({}))
    tok = Tokenizer.from_folder(folder)
    assert tok.eos_token_ids == {1}


def test_bos_from_add_bos_token(tmp_path):
    on = Tokenizer.from_folder(write_tiny_sentencepiece_tokenizer(tmp_path / "on"))
    off = Tokenizer.from_folder(
        write_tiny_sentencepiece_tokenizer(tmp_path / "off", add_bos_token=False)
    )
    bos = on.token_to_id("<s>")
    assert on.bos_token_id == bos and on.add_bos_default
    assert on.encode("Hello")[0] == bos
    assert off.encode("Hello")[0] != bos
    assert off.encode("Hello", add_bos=True)[0] == bos
    # A BOS the text (e.g. a chat template) already wrote is not doubled.
    assert on.encode("<s>Hello").count(bos) == 1


def test_bos_detected_from_post_processor(tmp_path):
    folder = write_tiny_tokenizer(tmp_path, bos_token="<|endoftext|>")
    backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    bos = backend.token_to_id("<|endoftext|>")
    eos = backend.token_to_id("<|im_end|>")
    # Llama-3 style: the post-processor prepends BOS (and here also appends an EOS).
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A <|im_end|>",
        special_tokens=[("<|endoftext|>", bos), ("<|im_end|>", eos)],
    )
    backend.save(str(folder / "tokenizer.json"))
    tok = Tokenizer.from_folder(folder)
    assert tok.add_bos_default
    ids = tok.encode("Hello")
    assert ids[0] == bos
    assert ids[-1] != eos  # only the BOS we decided on; never a trailing EOS


def test_no_bos_without_bos_token(byte_level):
    tok = Tokenizer.from_folder(byte_level)
    assert tok.bos_token_id is None and not tok.add_bos_default
    assert tok.encode("Hello", add_bos=True) == tok.encode("Hello")


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(ModelLoadError):
        Tokenizer.from_folder(tmp_path)


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_incremental_decoder_never_emits_broken_utf8(kind, request):
    tok = Tokenizer.from_folder(request.getfixturevalue(kind))
    saw_partial_token = False
    for text in MIXED_TEXTS:
        ids = tok.encode(text, add_bos=False)
        # The test only means something if some token carries part of a character.
        saw_partial_token |= any("\ufffd" in tok.decode([i]) for i in ids)
        deltas = _stream(tok.incremental_decoder(), ids)
        assert all("\ufffd" not in d for d in deltas), deltas
        assert "".join(deltas) == text
    assert saw_partial_token


def test_sentencepiece_spaces_survive_streaming(sentencepiece):
    tok = Tokenizer.from_folder(sentencepiece)
    pieces = ["▁", "c", "a", "f"]
    ids = [tok.token_to_id(p) for p in pieces]
    assert None not in ids
    # Decoded alone, a leading "▁" loses its space (the decoder strips it) ...
    assert "".join(_stream(tok.incremental_decoder(), ids)) == "caf"
    # ... but after some context, as in a running answer, the space is kept.
    context = tok.encode("Hello")
    assert "".join(_stream(tok.incremental_decoder(context_ids=context), ids)) == " caf"


def test_byte_fallback_tokens_join_into_characters(sentencepiece):
    tok = Tokenizer.from_folder(sentencepiece)
    ids = [tok.token_to_id(f"<0x{b:02X}>") for b in "😀".encode()]
    deltas = _stream(tok.incremental_decoder(context_ids=tok.encode("Hi")), ids)
    assert deltas == ["", "", "", "😀", ""]


def test_decoder_releases_a_lone_partial_byte_at_flush(byte_level):
    tok = Tokenizer.from_folder(byte_level)
    first_byte_only = tok.token_to_id("ð")  # byte-level symbol for 0xF0
    decoder = tok.incremental_decoder()
    assert decoder.push(first_byte_only) == ""
    assert decoder.flush() == "\ufffd"
