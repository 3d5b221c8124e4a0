"""The kernel build says once, with an estimate, that it compiles (first use only), and
a fallback to the PyTorch path says it is slower and where to look."""

from __future__ import annotations

import types
from pathlib import Path

from torch.utils import cpp_extension

from exl3cli.ops import build as extension_loader
from exl3cli.ops.build import LazyExtension, build_extension


def fake_load(calls: list):
    def load(name: str, sources, extra_cflags, build_directory: str, verbose: bool, **_):
        calls.append(name)
        # what a real build leaves behind
        (Path(build_directory) / f"{name}.so").write_bytes(b"")
        return types.ModuleType(name)
    return load


def test_the_first_build_is_announced_with_an_estimate_later_loads_are_quiet(
        tmp_path, monkeypatch, capsys):
    source = tmp_path / "k.cpp"
    source.write_text("// a kernel\n")
    monkeypatch.setenv("EXL3_KERNEL_CACHE", str(tmp_path / "cache"))
    calls: list = []
    monkeypatch.setattr(cpp_extension, "load", fake_load(calls))
    build_extension("exl3_test", [source], key="k")
    err = capsys.readouterr().err
    assert "compiling kernels" in err and "first use only" in err and "minutes" in err
    assert "kernels ready" in err
    build_extension("exl3_test", [source], key="k")  # cached: loads at once
    assert capsys.readouterr().err == "" and len(calls) == 2


def test_checkouts_with_the_same_sources_build_in_folders_of_their_own(tmp_path, monkeypatch):
    """torch's build.ninja names the sources by absolute path: a shared folder would make
    each checkout rebuild the other's kernels."""
    monkeypatch.setenv("EXL3_KERNEL_CACHE", str(tmp_path / "cache"))
    calls: list = []
    monkeypatch.setattr(cpp_extension, "load", fake_load(calls))
    for checkout in ("a", "b", "a"):
        source = tmp_path / checkout / "k.cpp"
        source.parent.mkdir(exist_ok=True)
        source.write_text("// the same kernel\n")
        build_extension("exl3_test", [source], key="k")
    folders = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(folders) == 2, folders


def test_a_fallback_says_it_is_slower_and_points_at_exl3_kernels(capsys):
    extension = LazyExtension("Test kernels", lambda: "no C++ compiler found",
                              lambda: types.ModuleType("never"), announce=lambda _: True)
    extension_loader._REGISTRY.remove(extension)  # not one of the package's extensions
    assert extension.get() is None and extension.get() is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "slower" in err and "exl3 kernels" in err
