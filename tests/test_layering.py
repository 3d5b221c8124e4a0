"""The layering rule of docs/CONTRACTS.md, checked on the code's own imports.

Every `import` and `from ... import` in the package (module level and inside functions)
is read with `ast`; a module may import its own package and anything on a lower floor,
never a floor above it nor a neighbour on its own floor. Inside the engine the
sub-packages have floors of their own. No import circle exists between modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Top floor first. A module belongs to the longest prefix listed. Packages on one floor
# are neighbours that do not import each other, except on the floors in SHARED_FLOORS.
FLOORS: list[list[str]] = [
    ["exl3cli.__main__", "exl3cli.cli"],
    ["exl3cli.client", "exl3cli.server", "exl3cli.api"],
    ["exl3cli.runtime", "exl3cli.convert", "exl3_plugins"],
    ["exl3cli.engine", "exl3cli.store", "exl3cli.gguf"],
    ["exl3cli.ops"],
    ["exl3cli.codec"],
    ["exl3cli.errors", "exl3cli.hookspecs", "exl3cli.hostaddr", "exl3cli.torch_notices",
     "exl3cli"],
]
SHARED_FLOORS = {0, 6}
ENGINE_FLOORS: list[list[str]] = [
    ["exl3cli.engine.generation"],
    ["exl3cli.engine.adapters"],
    ["exl3cli.engine.models"],
    ["exl3cli.engine.layers"],
    ["exl3cli.engine.kvcache"],
    ["exl3cli.engine.spec", "exl3cli.engine.text", "exl3cli.engine.grammar"],
]


def _module_files() -> dict[str, Path]:
    found = {}
    for base, package in ((ROOT / "exl3cli", "exl3cli"), (ROOT / "plugins", "exl3_plugins")):
        for path in base.rglob("*.py"):
            parts = [package, *path.relative_to(base).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _module_files()


def _imports(name: str, path: Path) -> set[str]:
    """Modules of ours that `name` imports (a name imported from a package counts as
    that submodule when it is one)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _place(module: str, floors: list[list[str]]) -> tuple[int, str] | None:
    best = None
    for level, prefixes in enumerate(floors):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > len(best[1]):
                    best = (level, prefix)
    return best


def _violations(floors: list[list[str]], within: str | None = None,
                shared: frozenset[int] | set[int] = frozenset()) -> list[str]:
    bad = []
    for source, targets in GRAPH.items():
        if within and not source.startswith(within + "."):
            continue
        here = _place(source, floors)
        if here is None:
            continue
        for target in targets:
            if within and not target.startswith(within + "."):
                continue
            there = _place(target, floors)
            if there is None or there[1] == here[1]:
                continue
            if there[0] < here[0] or (there[0] == here[0] and here[0] not in shared):
                bad.append(f"{source} -> {target}")
    return sorted(bad)


def test_every_module_has_a_floor():
    assert [m for m in MODULES if _place(m, FLOORS) is None] == []
    engine = [m for m in MODULES if m.startswith("exl3cli.engine.")]
    assert [m for m in engine if _place(m, ENGINE_FLOORS) is None] == []


def test_imports_only_run_down():
    assert _violations(FLOORS, shared=SHARED_FLOORS) == []


def test_engine_sub_packages_only_import_down():
    assert _violations(ENGINE_FLOORS, within="exl3cli.engine") == []


def test_no_import_circles():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in GRAPH.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    assert circles == []


@pytest.mark.parametrize("rule", ["floors", "engine", "circles"])
def test_the_checks_can_fail(rule):
    """A planted upward import, engine back-edge and circle are each caught."""
    saved = {k: set(v) for k, v in GRAPH.items()}
    try:
        if rule == "floors":
            GRAPH["exl3cli.codec.bitstream"].add("exl3cli.engine.generation.generator")
            assert _violations(FLOORS, shared=SHARED_FLOORS) != []
        elif rule == "engine":
            GRAPH["exl3cli.engine.kvcache.paged_cache"].add("exl3cli.engine.models.loader")
            assert _violations(ENGINE_FLOORS, within="exl3cli.engine") != []
        else:
            GRAPH["exl3cli.errors"].add("exl3cli.hostaddr")
            GRAPH["exl3cli.hostaddr"].add("exl3cli.errors")
            with pytest.raises(AssertionError):
                test_no_import_circles()
    finally:
        GRAPH.clear()
        GRAPH.update(saved)
