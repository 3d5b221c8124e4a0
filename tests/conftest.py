"""Fixtures shared by the test modules: a tiny model store and a daemon serving it.

Both are module-scoped (each module gets its own store under its own temporary folder);
a module that needs a different store defines its own `store` fixture and the `daemon`
here serves that one.
"""

from __future__ import annotations

import pytest

from tests.fixtures.daemon import Daemon
from tests.fixtures.tiny_store import make_tiny_store


@pytest.fixture(scope="module")
def store(tmp_path_factory, request):
    """A store holding the tiny chat model as `tiny`."""
    return make_tiny_store(tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2]))


@pytest.fixture(scope="module")
def daemon(store):
    """A real daemon on 127.0.0.1 serving `store`."""
    with Daemon(store) as running:
        yield running
