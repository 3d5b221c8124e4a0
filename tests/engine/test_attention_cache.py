"""Every cache a forward step can be given is an `AttentionCache`
(exl3cli/engine/kvcache/attention_cache.py): each method the model and the layers call
exists with the protocol's parameters (same names, kinds and defaults; anything extra
optional), and instances pass the runtime-checkable isinstance."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

import exl3cli.engine
from exl3cli.engine.generation.decode_step import FixedDecodeStep
from exl3cli.engine.generation.speculative import VerifyingBatch
from exl3cli.engine.kvcache.attention_cache import AttentionCache
from exl3cli.engine.kvcache.paged_attention import PagedBatch
from exl3cli.engine.kvcache.paged_cache import PagePool, PageTable
from exl3cli.engine.models.layer_split import OffsetCache
from exl3cli.engine.models.vision.image_tokens import BlockAttentionBatch

IMPLEMENTATIONS = (PagedBatch, VerifyingBatch, FixedDecodeStep, BlockAttentionBatch, OffsetCache)
METHODS = ("prepare", "check_input", "attend", "advance", "select_last")


def signature_mismatches(implementation: type, protocol: type = AttentionCache) -> list[str]:
    """What keeps `implementation` from answering every call the protocol allows."""
    problems = []
    for name in METHODS:
        method = getattr(implementation, name, None)
        if method is None:
            problems.append(f"{name}: missing")
            continue
        wanted = inspect.signature(getattr(protocol, name)).parameters
        given = inspect.signature(method).parameters
        for parameter in wanted.values():
            own = given.get(parameter.name)
            if own is None:
                problems.append(f"{name}: no parameter {parameter.name}")
            elif own.kind != parameter.kind:
                problems.append(f"{name}: {parameter.name} is {own.kind.description}, "
                                f"not {parameter.kind.description}")
            elif own.default != parameter.default:
                problems.append(f"{name}: {parameter.name} defaults to {own.default!r}, "
                                f"not {parameter.default!r}")
        for parameter in given.values():
            optional = (parameter.default is not inspect.Parameter.empty
                        or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD))
            if parameter.name not in wanted and not optional:
                problems.append(f"{name}: extra required parameter {parameter.name}")
    return problems


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_each_cache_step_has_the_protocols_methods_and_parameters(implementation):
    assert signature_mismatches(implementation) == []


def test_the_signature_check_finds_a_missing_keyword():
    class NoSinks:
        def prepare(self): ...
        def check_input(self, input_ids): ...
        def advance(self): ...
        def select_last(self, hidden): ...
        def attend(self, layer, query, key, value, window, *, softcap=None, scale=None): ...

    assert signature_mismatches(NoSinks) == ["attend: no parameter sinks"]


def _classes_with_a_layer_attend() -> set[str]:
    """Classes in the engine that define `attend(self, layer, ...)`: cache steps."""
    root = Path(exl3cli.engine.__file__).parent
    found = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if (isinstance(item, ast.FunctionDef) and item.name == "attend"
                        and [a.arg for a in item.args.args[:2]] == ["self", "layer"]):
                    found.add(node.name)
    return found


def test_every_cache_step_in_the_engine_is_checked_here():
    assert _classes_with_a_layer_attend() - {"AttentionCache"} <= {
        c.__name__ for c in IMPLEMENTATIONS}


def test_instances_are_attention_caches():
    pool = PagePool(4, 2, 1, 8, torch.float32, "cpu", page_size=4)
    tables = []
    for _ in range(2):
        table = PageTable(pool)
        assert table.admit([], 8)
        tables.append(table)
    batch = PagedBatch(pool, tables, [[1, 2, 3], [4]])
    steps = [batch, VerifyingBatch(pool, tables, [[1, 2], [3]], [True, False]),
             FixedDecodeStep(pool, 2, 2), BlockAttentionBatch(batch, {0: [(0, 2)]})]
    for step in steps:
        assert isinstance(step, AttentionCache), type(step).__name__
    assert not isinstance(object(), AttentionCache)
