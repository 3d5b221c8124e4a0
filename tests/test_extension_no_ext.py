"""EXL3_NO_EXT is honoured the same way by every compiled extension (exl3cli/ops/build.py):
each reports itself unavailable with one reason, says nothing on stderr, and the switch
is read on every call (set after a build, or unset after a refusal, it takes effect)."""

from __future__ import annotations

import types

import pytest

from exl3cli.ops import build, cpu_kernels, cuda_kernels, cuda_viterbi
from exl3cli.ops.build import NO_EXT_REASON, LazyExtension, all_extensions, extensions_disabled


@pytest.fixture
def private_extension():
    """A LazyExtension that builds at once, counting its checks and builds; not left in
    the package's registry."""
    calls = {"why_not": 0, "build": 0}

    def why_not():
        calls["why_not"] += 1
        return None

    def build_it():
        calls["build"] += 1
        return types.ModuleType("built")

    extension = LazyExtension("Test kernels", why_not, build_it, announce=lambda _: True)
    build._REGISTRY.remove(extension)
    return extension, calls


def test_every_extension_reports_the_same_reason_and_stays_quiet(monkeypatch, capfd):
    monkeypatch.setenv("EXL3_NO_EXT", "1")
    assert extensions_disabled()
    extensions = all_extensions()
    assert [e.label for e in extensions] == ["CPU kernels", "CUDA kernels",
                                             "CUDA Viterbi kernel"]
    for extension in extensions:
        assert extension.get() is None, extension.label
        assert not extension.available()
        assert extension.reason == extension.unavailable_reason() == NO_EXT_REASON
    for module in (cpu_kernels, cuda_kernels, cuda_viterbi):
        assert module.available() is False, module.__name__
        assert module.unavailable_reason() == NO_EXT_REASON, module.__name__
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("value, disabled", [("1", True), ("yes", True), ("0", False),
                                             ("", False)])
def test_the_switch_is_anything_but_empty_or_zero(monkeypatch, value, disabled):
    monkeypatch.setenv("EXL3_NO_EXT", value)
    assert extensions_disabled() is disabled


def test_set_after_a_build_it_turns_the_extension_off_and_back_on(private_extension,
                                                                   monkeypatch):
    extension, calls = private_extension
    monkeypatch.delenv("EXL3_NO_EXT", raising=False)
    module = extension.get()
    assert module is not None and extension.reason is None
    monkeypatch.setenv("EXL3_NO_EXT", "1")
    assert extension.get() is None and extension.unavailable_reason() == NO_EXT_REASON
    monkeypatch.delenv("EXL3_NO_EXT")
    assert extension.get() is module and calls["build"] == 1


def test_a_refusal_by_the_switch_is_not_remembered(private_extension, monkeypatch, capfd):
    extension, calls = private_extension
    monkeypatch.setenv("EXL3_NO_EXT", "1")
    assert extension.get() is None
    assert calls == {"why_not": 0, "build": 0}  # no check, no build, nothing said
    assert capfd.readouterr().err == ""
    monkeypatch.delenv("EXL3_NO_EXT")
    assert extension.get() is not None and calls == {"why_not": 1, "build": 1}
