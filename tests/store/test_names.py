"""Model names: parsing, display form, case-insensitive identity, rejection of bad names."""

from __future__ import annotations

import pytest

from exl3cli.errors import InvalidModelName
from exl3cli.store.names import DEFAULT_HOST, DEFAULT_NAMESPACE, ModelName


@pytest.mark.parametrize("text, parts, shown", [
    ("smollm2", (DEFAULT_HOST, DEFAULT_NAMESPACE, "smollm2", "latest"), "smollm2:latest"),
    ("smollm2:135m", (DEFAULT_HOST, DEFAULT_NAMESPACE, "smollm2", "135m"), "smollm2:135m"),
    ("me/smol0:v1", (DEFAULT_HOST, "me", "smol0", "v1"), "me/smol0:v1"),
    ("library/smol0", (DEFAULT_HOST, DEFAULT_NAMESPACE, "smol0", "latest"), "smol0:latest"),
    ("hf.co/User/Repo-1.5B:main", ("hf.co", "User", "Repo-1.5B", "main"),
     "hf.co/User/Repo-1.5B:main"),
    ("localhost:5000/ns/m_1:t.2", ("localhost:5000", "ns", "m_1", "t.2"),
     "localhost:5000/ns/m_1:t.2"),
    ("a:_x-y.z", (DEFAULT_HOST, DEFAULT_NAMESPACE, "a", "_x-y.z"), "a:_x-y.z"),
])
def test_parse_and_display(text, parts, shown):
    name = ModelName.parse(text)
    assert name.parts() == parts
    assert str(name) == shown
    assert ModelName.parse(str(name)) == name


def test_names_match_whatever_the_letter_case():
    upper = ModelName.parse("Me/SmolLM2:135M")
    lower = ModelName.parse("me/smollm2:135m")
    assert upper == lower
    assert hash(upper) == hash(lower)
    assert {upper: 1}[lower] == 1
    assert str(upper) == "Me/SmolLM2:135M"  # the spelling is kept for display
    assert ModelName.parse("smollm2:a") != ModelName.parse("smollm2:b")


def test_tag_length_limit():
    assert ModelName.parse("m:" + "t" * 128).tag == "t" * 128
    with pytest.raises(InvalidModelName, match="longer than 128"):
        ModelName.parse("m:" + "t" * 129)


@pytest.mark.parametrize("text", [
    "", "   ", " smollm2", "smollm2 ", "..", "../x", "x/..", "a/../b", "x:..", "a..b",
    "/abs/path", "a\\b", "..\\x", "a\x00b", "a/b/c/d", "-x", ".x", "ns/.hidden",
    "x:", "x:-t", "x::y", "a//b", "/", "a/", "x y", "café", "a;rm", "x:t/y", "m*",
])
def test_bad_names_are_rejected_with_a_clear_message(text):
    with pytest.raises(InvalidModelName) as caught:
        ModelName.parse(text)
    message = str(caught.value)
    assert message.startswith("invalid model name '")
    assert "\n" not in message


def test_coerce_accepts_parsed_names():
    name = ModelName.parse("a/b:c")
    assert ModelName.coerce(name) is name
    assert ModelName.coerce("a/b:c") == name
