"""Structured output: the JSON/schema automaton, the token masks, and constrained
generation with a tiny random model (its garbage must still parse and match)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from exl3cli.engine.generation.textmodel import TextModel
from exl3cli.engine.grammar.constraints import build_constraint, compile_format, token_bytes
from exl3cli.engine.text.tokenizer import Tokenizer
from exl3cli.errors import InvalidOption
from tests.fixtures.tiny_store import write_tiny_chat_model
from tests.fixtures.tiny_tokenizer import (
    write_tiny_sentencepiece_tokenizer,
    write_tiny_tokenizer,
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "height": {"type": "number"},
        "alive": {"type": "boolean"},
        "nick": {"type": ["string", "null"]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green"]}},
        "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", 3]}},
                "required": ["kind"]},
    },
    "required": ["name", "age", "tags"],
}
LIMITS = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "minLength": 2, "maxLength": 4},
        "xs": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
    },
    "required": ["code", "xs"],
}
# A recursive schema through $defs, the way pydantic writes nested models.
TREE = {
    "$defs": {"Node": {"type": "object", "title": "Node",
                       "properties": {"v": {"type": "integer"},
                                      "kids": {"type": "array",
                                               "items": {"$ref": "#/$defs/Node"}}},
                       "required": ["v"]}},
    "$ref": "#/$defs/Node",
}
SCHEMAS = [PERSON, LIMITS, TREE, {"type": "array", "items": {"type": "number"}},
           {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]}]


def conforms(value, schema, root=None) -> bool:
    """A small JSON-schema check for the keywords the constraint supports."""
    root = root or schema
    if "$ref" in schema:
        target = root
        for part in schema["$ref"][2:].split("/"):
            target = target[part]
        return conforms(value, target, root)
    if "const" in schema:
        return value == schema["const"]
    if "enum" in schema:
        return any(value == v and type(value) is type(v) for v in schema["enum"])
    if "anyOf" in schema:
        return any(conforms(value, alt, root) for alt in schema["anyOf"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return any(conforms(value, {**schema, "type": k}, root) for k in kind)
    checks = {"string": lambda v: isinstance(v, str), "null": lambda v: v is None,
              "boolean": lambda v: isinstance(v, bool),
              "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list)}
    if kind is not None and not checks[kind](value):
        return False
    if isinstance(value, str):
        return schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 10**9)
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 10**9):
            return False
        return all(conforms(v, schema.get("items", {}), root) for v in value)
    if isinstance(value, dict) and "properties" in schema:
        props = schema["properties"]
        return (set(schema.get("required", [])) <= set(value) and set(value) <= set(props)
                and all(conforms(v, props[k], root) for k, v in value.items()))
    return True


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_folder(write_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def feed(constraint, text: str) -> bool:
    """Accept `text` byte by byte through the automaton; False at the first bad byte."""
    data = text.encode()
    if not constraint.text_is_valid(data):
        return False
    constraint.stacks = constraint._advance_bytes(constraint.stacks, data)
    return True


@pytest.mark.parametrize("text", [
    '{}', '{"a": 1}', ' { "a" : [1, -2.5e+3, 0.25, true, false, null] } ',
    '{"nested": {"x": {"y": []}}, "s": "q\\"uote\\\\ \\u00e9 caf\u00e9"}', '{"a":-0}',
])
def test_json_mode_accepts_complete_objects(tok, text):
    constraint = build_constraint("json", tok)
    assert feed(constraint, text.rstrip())
    assert constraint.complete


@pytest.mark.parametrize("text", [
    '[1]', '"x"', '{"a" 1}', '{"a": 01}', '{"a": tru }', '{a: 1}', '{"a": 1,}',
    '{"a": "line\nbreak"}', '{"a": 1}}', '{"a": "\\x"}', '{"a": 1.}', '{"a": NaN}',
])
def test_json_mode_rejects_invalid_text(tok, text):
    constraint = build_constraint("json", tok)
    assert not (feed(constraint, text) and constraint.complete)


def test_schema_mode_follows_the_schema(tok):
    good = '{"tags": ["red"], "age": 3, "name": "x", "pet": {"kind": 3}, "nick": null}'
    constraint = build_constraint(PERSON, tok)
    assert feed(constraint, good) and constraint.finished
    for bad in ['{"name": "x", "age": 3}',                # '}' before required "tags"
                '{"age": 1.5', '{"age": "3"', '{"name": 1', '{"other": 1',
                '{"tags": ["blue"]', '{"pet": {"kind": "cow"}', '{"alive": yes',
                '{"name": "a", "name"']:                  # a key only once
        constraint = build_constraint(PERSON, tok)
        assert not (feed(constraint, bad) and feed(constraint, "}")), bad


def test_length_and_count_limits(tok):
    constraint = build_constraint(LIMITS, tok)
    assert feed(constraint, '{"code": "ab", "xs": [1, 2]}')
    for bad in ['{"code": "a"', '{"code": "abcde"', '{"xs": []', '{"xs": [1, 2, 3]']:
        constraint = build_constraint(LIMITS, tok)
        assert not (feed(constraint, bad) and feed(constraint, ",")), bad
    # the character count is in characters, not bytes
    assert feed(build_constraint(LIMITS, tok), '{"code": "éééé"')


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "string", "pattern": "^a"}, "pattern"),
    ({"type": "object", "properties": {"n": {"type": "number", "minimum": 0}}}, "minimum"),
    ({"type": "string", "format": "date-time"}, "format"),
    ({"allOf": [{"type": "string"}]}, "allOf"),
])
def test_unsupported_keywords_are_named(schema, keyword):
    with pytest.raises(InvalidOption, match=keyword):
        compile_format(schema)


def test_bad_formats_are_rejected():
    endless = {"type": "object", "properties": {"me": {"$ref": "#"}}, "required": ["me"]}
    for bad in ["yaml", 3, ["json"], {"$ref": "#/$defs/Missing"}, {"$ref": "#"}, endless,
                {"type": "object", "properties": {}, "required": ["x"]}]:
        with pytest.raises(InvalidOption):
            compile_format(bad)
    assert compile_format(None) is None and compile_format("") is None
    assert compile_format('{"type": "integer"}').kind == "integer"  # a schema as text


@pytest.mark.parametrize("maker", [write_tiny_tokenizer, write_tiny_sentencepiece_tokenizer])
def test_token_bytes_concatenate_to_the_decoded_text(tmp_path, maker):
    tok = Tokenizer.from_folder(maker(tmp_path))
    table = token_bytes(tok)
    specials = {i for i, b in enumerate(table) if b is None}
    assert specials and len(specials) < 5  # only the special tokens lack bytes
    ids = tok.encode("The café said: {\"k\": [1, 2]} 日本 😀", add_bos=False)
    joined = b"".join(table[i] for i in ids).decode("utf-8", "replace")
    assert joined.strip() == tok.decode(ids).strip()


def sample_constrained(tok, fmt, seed: int, budget: int) -> str:
    """Drive the constraint with random logits (any model's worst case)."""
    generator = torch.Generator().manual_seed(seed)
    constraint = build_constraint(fmt, tok)
    ids: list[int] = []
    for produced in range(budget):
        if constraint.finished:
            break
        logits = constraint.mask(torch.randn(tok.vocab_size, generator=generator) * 4,
                                 budget - produced)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        token = constraint.accept(token, logits)
        if token in tok.eos_token_ids:
            break
        ids.append(token)
    return tok.decode(ids)


@pytest.mark.parametrize("fmt", ["json", *SCHEMAS])
def test_random_logits_always_give_parsable_matching_json(tok, fmt):
    rng = random.Random(0)
    for seed in range(12):
        budget = rng.choice([34, 60, 120])  # above every schema's shortest answer
        text = sample_constrained(tok, fmt, seed, budget)
        value = json.loads(text)
        if fmt == "json":
            assert isinstance(value, dict)
        else:
            assert conforms(value, fmt), text


def test_sampler_fallback_to_a_masked_token_is_replaced(tok):
    constraint = build_constraint("json", tok)
    logits = constraint.mask(torch.zeros(tok.vocab_size), 50)
    bad = tok.encode("x")[0]
    assert logits[bad] == float("-inf")
    chosen = constraint.accept(bad, logits)
    assert chosen != bad and torch.isfinite(logits[chosen])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return TextModel.load(write_tiny_chat_model(tmp_path_factory.mktemp("tiny")))


@pytest.mark.parametrize("fmt", ["json", PERSON, TREE])
def test_tiny_model_answers_parse_and_match(tiny_model, fmt):
    prompt = tiny_model.chat_prompt([{"role": "user", "content": "Describe a person."}])
    for seed in range(2):  # the random-logits test above covers many more seeds
        options = {"temperature": 1.0, "seed": seed}
        events = list(tiny_model.stream(prompt, options, num_predict=60, format=fmt))
        text = "".join(e.text for e in events[:-1])
        value = json.loads(text)
        assert isinstance(value, dict) and (fmt == "json" or conforms(value, fmt)), text
        assert events[-1].done and events[-1].eval_count <= 60


def test_greedy_object_stops_at_its_closing_brace(tiny_model):
    prompt = tiny_model.chat_prompt([{"role": "user", "content": "hi"}])
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"]}
    events = list(tiny_model.stream(prompt, {"temperature": 0}, format=schema))
    text = "".join(e.text for e in events[:-1])
    assert json.loads(text)["ok"] in (True, False)
    assert events[-1].done_reason == "stop" and text.rstrip().endswith("}")
