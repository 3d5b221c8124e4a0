"""Handing a generator's events to another thread in batches: one wake-up per step.

A job submitted with a `WakeBatcher` as its `sink` (GenerationJob.sink) gets no events
on its handle's queue; the generator appends them to the batcher, keyed by handle, and
at the end of each step (and after a cancel) calls `flush()`, which wakes the consumer
once for everything that step produced, however many jobs it served. The consumer
(the daemon's event loop: server/model_manager.py) calls `take()` when woken.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any


class WakeBatcher:
    """Per-job event buffers filled by the stepping thread, drained by one consumer.

    `wake` is called (from the stepping thread) at most once until the consumer has
    taken what is pending, so a burst of steps while the consumer is busy costs one
    wake-up, not one per step or per job.
    """

    def __init__(self, wake: Callable[[], None]):
        self._wake = wake
        self._lock = threading.Lock()
        self._pending: dict[Any, list[Any]] = {}
        self._woken = False
        self.wakes = 0  # how many times `wake` was called (tests, benchmarks)

    def add(self, key: Any, events: Iterable[Any]) -> None:
        """Buffer `key`'s new events; nothing is woken until `flush()`."""
        with self._lock:
            self._pending.setdefault(key, []).extend(events)

    def flush(self) -> None:
        """Wake the consumer if anything is pending and it has not been woken yet."""
        with self._lock:
            if not self._pending or self._woken:
                return
            self._woken = True
            self.wakes += 1
        try:
            self._wake()
        except Exception:  # the consumer is gone (its loop closed): nothing to wake
            with self._lock:
                self._woken = False

    def take(self) -> dict[Any, list[Any]]:
        """Everything pending, by key in arrival order; the next flush wakes again."""
        with self._lock:
            pending, self._pending = self._pending, {}
            self._woken = False
            return pending


def flush_all(sinks: set[Any]) -> None:
    """Flush each sink touched since the last call (the generator's end of step)."""
    while sinks:
        sinks.pop().flush()
