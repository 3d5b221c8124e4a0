"""The in-process client: the `Client` protocol answered in this process, with no daemon.

Store operations (list, show, copy, delete, create, pull) are the runtime's
`ModelLibrary`; inference (generate, chat, ps) is an `InferenceRunner` started on the
first request that needs one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from exl3cli.client.base import Body
from exl3cli.runtime.library import ModelLibrary
from exl3cli.store.store import ModelStore


class LocalClient(ModelLibrary):
    """Implements `exl3cli.client.base.Client` against a local `ModelStore`."""

    def __init__(self, store: ModelStore | None = None):
        super().__init__(store)
        self._runner: Any = None

    def _inference(self) -> Any:
        if self._runner is None:
            from exl3cli.runtime.residency import InferenceRunner

            self._runner = InferenceRunner(self.store)
        return self._runner

    def ps(self) -> Body:
        return self._inference().ps()

    def generate(self, req: Body) -> Iterator[Body]:
        return self._inference().generate(req)

    def chat(self, req: Body) -> Iterator[Body]:
        return self._inference().chat(req)
