"""The files and modules the docs name exist, so a move is not left out of the docs.

Every backticked file path with a source or doc suffix (`engine/layers/linear.py`,
`csrc/ops/cuda/paged_attention.cu`, `bench/NOTES*.md`) must exist relative to one of the
doc's roots (the repository, the package `exl3cli/`; `tests/` for tests/README.md); a
bare file name (`siglip.py`) must be some file's name in the source folders; every
backticked `exl3cli.x.y` / `exl3_plugins.x` must be a module, or a top-level name of one.
Fenced code blocks are left out (their backticks are not inline code).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

DOCS: dict[str, tuple[str, ...]] = {
    "docs/CONTRACTS.md": ("", "exl3cli"),
    "README.md": ("", "exl3cli"),
    "tests/README.md": ("tests", "", "exl3cli"),
}
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
SPAN = re.compile(r"`([^`]+)`")
# A relative path with at least one folder and a file suffix; not ./x, ~/x or a URL's tail.
PATH = re.compile(r"(?<![\w./~:-])((?:[\w-]+/)+[\w*.-]*\.(?:py|cu|cuh|cpp|h|md|sh))(?![\w/])")
BARE = re.compile(r"(?<![\w./~:-])([\w-]+\.(?:py|cu|cuh|cpp|h|sh))(?![\w/])")
SOURCE_FOLDERS = ("exl3cli", "plugins", "csrc", "tests", "bench")
MODULE = re.compile(r"(?<![\w.])(?:exl3cli|exl3_plugins)(?:\.\w+)+")
PACKAGES = {"exl3cli": ROOT / "exl3cli", "exl3_plugins": ROOT / "plugins"}


def spans(text: str) -> list[str]:
    return SPAN.findall(FENCE.sub("", text))


def named(text: str) -> tuple[list[str], list[str], list[str]]:
    """(paths, bare file names, dotted module names) in the backticked spans of `text`."""
    paths, bare, modules = [], [], []
    for span in spans(text):
        paths += PATH.findall(span)
        bare += BARE.findall(span)
        modules += MODULE.findall(span)
    return paths, bare, modules


def _source_file_names() -> set[str]:
    return {p.name for folder in SOURCE_FOLDERS for p in (ROOT / folder).rglob("*")
            if p.is_file()}


def _path_exists(path: str, roots: tuple[str, ...]) -> bool:
    for root in roots:
        base = ROOT / root
        if ("*" in path and any(base.glob(path))) or (base / path).is_file():
            return True
    return False


def _module_file(parts: list[str]) -> Path | None:
    where = PACKAGES[parts[0]].joinpath(*parts[1:])
    for candidate in (where.with_suffix(".py"), where / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _module_exists(dotted: str) -> bool:
    """`a.b.c` is a module, or `c` is a top-level name of module `a.b`."""
    parts = dotted.split(".")
    if _module_file(parts) is not None:
        return True
    owner = _module_file(parts[:-1]) if len(parts) > 1 else None
    return owner is not None and parts[-1] in _top_level_names(owner)


def missing(text: str, roots: tuple[str, ...]) -> list[str]:
    paths, bare, modules = named(text)
    names = _source_file_names() if bare else set()
    return sorted({p for p in paths if not _path_exists(p, roots)}
                  | {b for b in bare if b not in names}
                  | {m for m in modules if not _module_exists(m)})


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_named_files_and_modules_exist(doc):
    assert missing((ROOT / doc).read_text(), DOCS[doc]) == []


def test_the_contracts_name_the_tree():
    """The pattern still finds what the contracts name (an empty match passes nothing)."""
    paths, bare, modules = named((ROOT / "docs/CONTRACTS.md").read_text())
    assert len(paths) > 50 and "engine/generation/generator.py" in paths
    assert "siglip.py" in bare and "exl3cli.runtime" in modules


def test_the_check_can_fail(tmp_path):
    """Old paths planted in a copy of the contracts are each reported."""
    copy = tmp_path / "CONTRACTS.md"
    copy.write_text((ROOT / "docs/CONTRACTS.md").read_text()
                    + "\n- `engine/quant/viterbi.py`, `client/inference.py`,"
                      " `csrc/paged_attention.cu`, `extension_loader.py`,"
                      " `exl3cli.engine.generator`, `exl3cli.ops.build.no_such_name`\n")
    assert missing(copy.read_text(), DOCS["docs/CONTRACTS.md"]) == [
        "client/inference.py", "csrc/paged_attention.cu", "engine/quant/viterbi.py",
        "exl3cli.engine.generator", "exl3cli.ops.build.no_such_name",
        "extension_loader.py"]
