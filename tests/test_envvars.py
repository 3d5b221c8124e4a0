"""EXL3_* on/off switches: one reading for all of them, and a refusal for the rest."""

from __future__ import annotations

import pytest

from exl3cli.envvars import switch
from exl3cli.errors import Exl3Error, InvalidSetting


@pytest.mark.parametrize("text, want", [("1", True), (" On ", True), ("YES", True),
                                        ("true", True), ("0", False), ("off", False),
                                        ("No", False), ("FALSE", False)])
def test_switch_values(monkeypatch, text, want):
    monkeypatch.setenv("EXL3_TEST_SWITCH", text)
    assert switch("EXL3_TEST_SWITCH", not want) is want


def test_unset_or_empty_is_the_default_and_anything_else_is_refused(monkeypatch):
    monkeypatch.delenv("EXL3_TEST_SWITCH", raising=False)
    assert switch("EXL3_TEST_SWITCH", True) is True
    monkeypatch.setenv("EXL3_TEST_SWITCH", "  ")
    assert switch("EXL3_TEST_SWITCH", False) is False
    monkeypatch.setenv("EXL3_TEST_SWITCH", "2")
    with pytest.raises(InvalidSetting, match="EXL3_TEST_SWITCH must be 1 or 0, got '2'") as caught:
        switch("EXL3_TEST_SWITCH", True)
    assert isinstance(caught.value, Exl3Error) and isinstance(caught.value, ValueError)
