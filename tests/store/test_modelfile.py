"""Modelfile grammar: instructions, quoting, typed parameters, errors, round trips."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from exl3cli.errors import ModelfileError
from exl3cli.store.modelfile import (
    MESSAGE_ROLES,
    PARAMETER_TYPES,
    Modelfile,
    parse_modelfile,
    quote_value,
)

FULL = '''# A comment, then a blank line

from ./models/tiny
Parameter temperature 0.5
PARAMETER top_k 20
PARAMETER stop "<|im_end|>"
PARAMETER stop """line one
line two"""
PARAMETER kv_cache_type q4
TEMPLATE """{{- for m in messages }}
{{ m.content }}{{ end }}
"""
SYSTEM He said \\"hi\\" # not a comment
  # an indented comment
MESSAGE user "Hello,
there"
message ASSISTANT Hi!
LICENSE MIT
license """Apache
2.0"""
ADAPTER ./lora
DRAFT smollm2:135m
'''


def test_full_grammar():
    parsed = parse_modelfile(FULL)
    assert parsed.from_ == "./models/tiny"
    assert parsed.from_line == 3
    assert parsed.parameters == {
        "temperature": 0.5, "top_k": 20, "stop": ["<|im_end|>", "line one\nline two"],
        "kv_cache_type": "q4",
    }
    assert isinstance(parsed.parameters["top_k"], int)
    assert parsed.template == "{{- for m in messages }}\n{{ m.content }}{{ end }}\n"
    # Unquoted values are taken literally to the end of the line, `#` included.
    assert parsed.system == 'He said \\"hi\\" # not a comment'
    assert parsed.messages == [{"role": "user", "content": "Hello,\nthere"},
                               {"role": "assistant", "content": "Hi!"}]
    assert parsed.license == ["MIT", "Apache\n2.0"]
    assert parsed.adapter == "./lora"
    assert parsed.draft == "smollm2:135m"
    assert parse_modelfile(parsed.to_text()) == parsed


def test_quoted_escapes_and_crlf():
    parsed = parse_modelfile('FROM m\r\nSYSTEM "a \\"b\\" c\\\\d"\r\nPARAMETER seed 7\r\n')
    assert parsed.system == 'a "b" c\\d'
    assert parsed.parameters == {"seed": 7}


def test_scalar_parameters_repeat_last_wins_lists_accumulate():
    parsed = parse_modelfile("FROM m\nPARAMETER top_k 1\nPARAMETER top_k 2\n"
                             "PARAMETER stop a\nPARAMETER stop b\n")
    assert parsed.parameters == {"top_k": 2, "stop": ["a", "b"]}


def test_empty_quoted_values_are_allowed_where_text_is_free():
    parsed = parse_modelfile('FROM m\nSYSTEM ""\nTEMPLATE """"""\n')
    assert parsed.system == ""
    assert parsed.template == ""
    assert parse_modelfile(parsed.to_text()) == parsed


SPEC_PARAMETERS = [
    "num_ctx", "num_predict", "temperature", "top_k", "top_p", "min_p", "typical_p",
    "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "seed",
    "stop", "num_keep", "dry_multiplier", "dry_base", "dry_allowed_length",
    "xtc_probability", "xtc_threshold", "kv_cache_type", "draft_num_predict", "num_gpu",
]
SAMPLE_VALUES = {int: ("-1", -1), float: ("0.25", 0.25), str: ("k8v4", "k8v4"),
                 list: ("</s>", ["</s>"])}


@pytest.mark.parametrize("name", SPEC_PARAMETERS)
def test_every_parameter_of_the_interface_is_typed(name):
    kind = PARAMETER_TYPES[name]
    raw, expected = SAMPLE_VALUES[kind]
    parsed = parse_modelfile(f"FROM m\nPARAMETER {name} {raw}\n")
    assert parsed.parameters[name] == expected
    assert type(parsed.parameters[name]) is type(expected)


@pytest.mark.parametrize("text, line, fragment", [
    ("PARAMETER top_k 1\n", 1, "missing FROM"),
    ("FROM a\nFROM b\n", 2, "only once"),
    ("FROM a\n\nBOGUS x\n", 3, "unknown instruction 'BOGUS'"),
    ("FROM a\nPARAMETER nonsense 1\n", 2, "unknown parameter 'nonsense'"),
    ("FROM a\nPARAMETER top_k 1.5\n", 2, "needs an integer"),
    ("FROM a\nPARAMETER temperature hot\n", 2, "needs a number"),
    ("FROM a\nPARAMETER temperature nan\n", 2, "finite"),
    ("FROM a\nPARAMETER top_k\n", 2, "needs a value"),
    ("FROM a\nPARAMETER\n", 2, "needs a name"),
    ("FROM a\nMESSAGE robot hi\n", 2, "role must be one of"),
    ('FROM a\n# x\nSYSTEM """never\nclosed\n', 3, 'unterminated """'),
    ('FROM a\nSYSTEM "never closed\n', 2, 'unterminated "'),
    ('FROM a\nSYSTEM "x" trailing\n', 2, "after closing quote"),
    ('FROM a\nSYSTEM """x\ny""" trailing\n', 3, "after closing quote"),
    ("FROM\n", 1, "FROM needs a value"),
    ("FROM a\nSYSTEM\n", 2, "SYSTEM needs a value"),
])
def test_errors_name_the_line(text, line, fragment):
    with pytest.raises(ModelfileError) as caught:
        parse_modelfile(text)
    assert caught.value.line == line
    assert fragment in str(caught.value)
    assert str(caught.value).startswith(f"Modelfile line {line}: ")


@pytest.mark.parametrize("text", [
    "plain", "", " leading", "trailing ", 'starts "quoted', '"', '"""', 'ends with "',
    'has """ inside', "multi\nline", "\n", "back\\slash", '\\"', 'a"""b"', "tab\there",
    "# hash", "carriage\rreturn", "\r\n", "ünïcødé ✓",
])
def test_quote_value_reads_back_exactly(text):
    parsed = parse_modelfile(f"FROM m\nSYSTEM {quote_value(text)}\n")
    assert parsed.system == text


TRICKY_PIECES = ['"', '"""', "\\", "\n", " ", "\t", "#", "x", "PARAMETER", "é", "\r", "''"]


def _random_text(rng: random.Random, allow_empty: bool = True) -> str:
    size = rng.randint(0 if allow_empty else 1, 8)
    text = "".join(rng.choice(TRICKY_PIECES) for _ in range(size))
    return text if (allow_empty or text.strip()) else "m"


def _random_modelfile(rng: random.Random) -> Modelfile:
    parameters: dict = {}
    for name in rng.sample(sorted(PARAMETER_TYPES), rng.randint(0, 6)):
        kind = PARAMETER_TYPES[name]
        if kind is int:
            parameters[name] = rng.randint(-5, 10**6)
        elif kind is float:
            parameters[name] = rng.choice([0.0, 1.5, -0.001, 1e-9, 12345.678, rng.random()])
        elif kind is list:
            parameters[name] = [_random_text(rng, allow_empty=False) for _ in range(3)]
        elif kind is bool:
            parameters[name] = rng.random() < 0.5
        else:
            parameters[name] = _random_text(rng, allow_empty=False)
    maybe = lambda: _random_text(rng) if rng.random() < 0.7 else None  # noqa: E731
    return Modelfile(
        from_=_random_text(rng, allow_empty=False), parameters=parameters,
        template=maybe(), system=maybe(),
        adapter=_random_text(rng, allow_empty=False) if rng.random() < 0.3 else None,
        license=[_random_text(rng) for _ in range(rng.randint(0, 2))],
        messages=[{"role": rng.choice(MESSAGE_ROLES), "content": _random_text(rng)}
                  for _ in range(rng.randint(0, 3))],
        draft=_random_text(rng, allow_empty=False) if rng.random() < 0.3 else None,
    )


@pytest.mark.parametrize("seed", range(10))
def test_round_trip_of_random_modelfiles(seed):
    rng = random.Random(seed)
    for _ in range(50):
        original = _random_modelfile(rng)
        text = original.to_text()
        assert parse_modelfile(text) == original, text


MODELFILES_DIR = Path(__file__).resolve().parents[2] / "modelfiles"


@pytest.mark.parametrize("path", sorted(MODELFILES_DIR.glob("*.Modelfile")), ids=lambda p: p.name)
def test_shipped_modelfiles_parse_and_name_catalog_models(path):
    from exl3cli.store.catalog import catalog_entry

    parsed = parse_modelfile(path.read_text())
    assert catalog_entry(parsed.from_) is not None, parsed.from_
    assert parse_modelfile(parsed.to_text()) == parsed
    assert path.name in (MODELFILES_DIR / "README.md").read_text()


def test_smollm2_modelfile_stops_at_chatml_markers():
    parsed = parse_modelfile((MODELFILES_DIR / "smollm2-135m.Modelfile").read_text())
    assert parsed.from_ == "smollm2:135m"
    assert parsed.parameters["stop"] == ["<|im_start|>", "<|im_end|>"]


def test_mirostat_is_refused_by_name_with_what_to_use_instead():
    with pytest.raises(ModelfileError) as error:
        parse_modelfile("FROM m\nPARAMETER mirostat 2\n")
    assert error.value.line == 2 and "not supported" in str(error.value)
    assert "dry_" in str(error.value)
