"""Generate/chat streams fed by the generator in batches: one event-loop wake-up per
generator step for all the jobs it served, instead of a relay thread and a
`call_soon_threadsafe` per token per job.

The generator thread appends each job's new events to a `WakeBatcher`
(engine/generation/wake.py) and wakes the loop once per step; `EventRelay.drain` then
shapes every job's events into response objects (runtime/responses.py) on the loop and
wakes each stream's reader, which writes all its pending objects at once. Only the
blocking edges run on worker threads: starting a job (load, prompt) before, releasing
the model after, and cancelling it (the generator's lock).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import Any

from exl3cli.engine.generation.wake import WakeBatcher

log = logging.getLogger(__name__)


class _CancelFlag(threading.Event):
    """A threading.Event (as StreamJob.cancel is) whose first set() also runs
    `on_set` (from whichever thread sets it)."""

    def __init__(self, on_set: Callable[[], None]):
        super().__init__()
        self._on_set = on_set

    def set(self) -> None:
        first = not self.is_set()
        super().set()
        if first:
            self._on_set()


class BatchedJob:
    """One generate/chat job read from the event loop, as server/model_manager.StreamJob
    is (first(), iteration, close(), cancel, outcome), plus `batches()`: every object
    pending at once, for one write each."""

    def __init__(self, loop: asyncio.AbstractEventLoop, executor: Executor, pushed: Any,
                 on_finish: Callable[[str], None] | None = None):
        self._loop = loop
        self._executor = executor
        self._pushed = pushed  # runtime.responses.PushedResponses
        self._on_finish = on_finish
        self.cancel = _CancelFlag(lambda: self._off_loop(self._cancel_job))
        self._items: deque[dict] = deque()
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._done: asyncio.Future = loop.create_future()  # set once released
        self._finishing = False
        self.count = 0
        self.finished_normally = False
        self.stopped_by_shutdown = False
        self.outcome = "running"

    def _off_loop(self, work: Callable[[], None]) -> None:
        """Run `work` on the executor; inline once it is shut down (server closing)."""
        try:
            self._executor.submit(work)
        except RuntimeError:
            work()

    def _cancel_job(self) -> None:
        try:
            self._pushed.cancel()
        except Exception:
            log.exception("cancelling a job failed")

    # ---- fed on the loop by EventRelay ------------------------------------------

    def feed(self, events: list[Any]) -> None:
        if self._finishing:
            return
        try:
            self._items.extend(self._pushed.push(events))
            error = self._pushed.error
        except BaseException as failure:  # a shaping bug: this job fails, others go on
            error = failure
        if error is not None or self._pushed.ended:
            self._error = error
            if error is not None:
                outcome = "cancelled" if self.cancel.is_set() else "failed"
            else:
                outcome = "cancelled" if self._pushed.shaper.cancelled else "completed"
            self._finish(outcome)
        self._wake()

    def _finish(self, outcome: str) -> None:
        self._finishing = True
        self.outcome = outcome
        if self._error is not None and not self.cancel.is_set():
            self._off_loop(self._cancel_job)  # a shaping failure: stop the job
        try:
            release = self._loop.run_in_executor(self._executor, self._pushed.release)
        except RuntimeError:  # the executor is shut down: the server is closing
            self._pushed.release()
            self._released(outcome)
            return
        release.add_done_callback(lambda _: self._released(outcome))

    def _released(self, outcome: str) -> None:
        if self._on_finish is not None:
            # Before the stream ends, so a reader that has seen its end also sees the job
            # counted (GET /api/stats).
            self._on_finish(outcome)
        if not self._done.done():
            self._done.set_result(None)
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        await self._waiter

    # ---- read by the routes -----------------------------------------------------

    async def first(self) -> dict | None:
        """The first object, or None when the job produced nothing; raises its error."""
        while not self._items:
            if self._done.done():
                if self._error is not None:
                    raise self._error
                self.finished_normally = True
                return None
            await self._wait()
        return self._items[0]

    async def batches(self) -> AsyncIterator[list[dict]]:
        """Lists of the objects pending whenever the reader looks: written at once."""
        while True:
            if self._items:
                batch = list(self._items)
                self._items.clear()
                self.count += len(batch)
                yield batch
                continue
            if self._done.done():
                if self._error is not None:
                    raise self._error
                self.finished_normally = True
                return
            await self._wait()

    def __aiter__(self) -> AsyncIterator[dict]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[dict]:
        async for batch in self.batches():
            for item in batch:
                yield item

    async def close(self) -> None:
        if not self.finished_normally:
            self.cancel.set()
        await asyncio.shield(self._done)


class EventRelay:
    """The loop's side of one WakeBatcher shared by every generator: routes each
    handle's events to its BatchedJob. Events that come before their job is
    registered (the generator may step before `open` returns) wait for it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self.batcher = WakeBatcher(self._wake)
        self._jobs: dict[Any, BatchedJob] = {}
        self._unclaimed: dict[Any, list[Any]] = {}
        self.drains = 0

    def _wake(self) -> None:  # on the generator thread
        self._loop.call_soon_threadsafe(self.drain)

    def drain(self) -> None:
        self.drains += 1
        for handle, events in self.batcher.take().items():
            job = self._jobs.get(handle)
            if job is None:
                self._unclaimed.setdefault(handle, []).extend(events)
                continue
            try:
                job.feed(events)
            except Exception:  # one job's trouble must not cost the others their events
                log.exception("handing a job its events failed")
            if job._finishing:
                self._jobs.pop(handle, None)

    def register(self, job: BatchedJob) -> None:
        handle = job._pushed.handle
        self._jobs[handle] = job
        early = self._unclaimed.pop(handle, None)
        if early:
            job.feed(early)
        if job._finishing:
            self._jobs.pop(handle, None)
