"""Engine work off the event loop: bounded per-model queues, streaming from threads,
cancellation when a client goes away, and keep_alive expiry.

`InferenceRunner` (runtime/residency.py) owns loading, caching and keep_alive
bookkeeping; this module decides *when* its blocking calls run. A generate/chat job
starts on a worker thread, then its events come to the loop in batches, one wake-up
per generator step for every job (server/batched_stream.py). Other streams (pull,
create; and every job with EXL3_SERVE_RELAY=thread, the old path kept for comparison)
run in a worker thread that hands its objects over one by one (`StreamJob`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from exl3cli.errors import ServerBusy
from exl3cli.runtime.diagnostics import runner_diagnostics
from exl3cli.runtime.library import ModelLibrary
from exl3cli.runtime.loaded_model import weights_key
from exl3cli.runtime.options import default_num_parallel
from exl3cli.runtime.residency import InferenceRunner
from exl3cli.server.batched_stream import BatchedJob, EventRelay
from exl3cli.server.limits import env_int
from exl3cli.store.names import ModelName

log = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 512
SWEEP_SECONDS = 1.0


@dataclass
class ModelStats:
    """Counters for one model's jobs (GET /api/stats)."""

    active: int = 0
    queued: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0


@dataclass
class _Slot:
    """The bounded queue of one model's weights (every name and alias of the same files
    shares it): `num_parallel` run, `max_queue` wait. `name` is the name last used."""

    semaphore: asyncio.Semaphore
    name: str = ""
    stats: ModelStats = field(default_factory=ModelStats)


class StreamJob:
    """One blocking iterator run in a worker thread, read from the event loop.

    `first()` waits for the first object (or raises the job's error, so a handler can
    still answer with a proper status); iterate for the rest; `close()` cancels the
    job if it still runs and waits until the worker has let go of the engine.
    """

    _END = object()

    def __init__(self, loop: asyncio.AbstractEventLoop, executor: ThreadPoolExecutor,
                 factory: Callable[[threading.Event], Iterator[dict]],
                 on_finish: Callable[[str], None] | None = None):
        self.cancel = threading.Event()
        self._on_finish = on_finish
        self.count = 0
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._factory = factory
        self._future = loop.run_in_executor(executor, self._work)
        self._pending: list[dict] = []
        self.finished_normally = False
        self.stopped_by_shutdown = False  # cancelled because the server shut down
        self.outcome = "running"  # then "completed", "cancelled" or "failed"

    def _put(self, item: Any) -> None:
        self._call_on_loop(self._queue.put_nowait, item)

    def _call_on_loop(self, function: Callable[[Any], None], argument: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(function, argument)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel.set()

    def _work(self) -> None:
        iterator: Any = None
        outcome = "completed"
        try:
            iterator = self._factory(self.cancel)
            ended = False  # whether the job's final object came
            for item in iterator:
                self._put(item)
                ended = isinstance(item, dict) and bool(item.get("done"))
                if self.cancel.is_set():
                    break
            if self.cancel.is_set() and not ended:
                outcome = "cancelled"  # stopped before the job's natural end
        except BaseException as error:  # delivered to the loop, raised there
            outcome = "cancelled" if self.cancel.is_set() else "failed"
            self._put(_Failure(error))
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                try:
                    close()  # runs the runner's finally: sets its cancel, frees the model
                except Exception:
                    log.exception("closing a job failed")
            self.outcome = outcome
            if self._on_finish is not None:
                # Queued on the loop ahead of the end marker, so a reader that has seen
                # the end of the stream also sees the job counted (GET /api/stats).
                self._call_on_loop(self._on_finish, outcome)
            self._put(self._END)

    async def _next(self) -> Any:
        item = await self._queue.get()
        if isinstance(item, _Failure):
            raise item.error
        return item

    async def first(self) -> dict | None:
        """The first object, or None when the job produced nothing; raises its error."""
        item = await self._next()
        if item is self._END:
            self.finished_normally = True
            return None
        self._pending.append(item)
        return item

    def __aiter__(self) -> AsyncIterator[dict]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[dict]:
        while self._pending:
            self.count += 1
            yield self._pending.pop(0)
        while True:
            item = await self._next()
            if item is self._END:
                self.finished_normally = True
                return
            self.count += 1
            yield item

    async def batches(self) -> AsyncIterator[list[dict]]:
        """The objects one at a time, as one-item lists (BatchedJob's interface)."""
        async for item in self:
            yield [item]

    async def close(self) -> None:
        if not self.finished_normally:
            self.cancel.set()
        try:
            await asyncio.shield(self._future)
        except Exception:
            pass


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class ModelManager:
    """Runs generate/chat jobs through per-model bounded queues on worker threads."""

    def __init__(self, store: Any, num_parallel: int | None = None,
                 max_queue: int | None = None, runner: InferenceRunner | None = None,
                 max_loaded: int | None = None, max_client_jobs: int = 0):
        self.store = store
        self.num_parallel = num_parallel or default_num_parallel()
        self.max_queue = max_queue if max_queue is not None else env_int(
            "EXL3_MAX_QUEUE", DEFAULT_MAX_QUEUE, 0)
        loaded = max_loaded or env_int("EXL3_MAX_LOADED_MODELS", 1, 1)
        # One generator per loaded model batches up to num_parallel jobs (the slots),
        # stepped on its own thread; each job's worker thread only relays its events.
        self.runner = runner or InferenceRunner(store, max_loaded=loaded,
                                                num_parallel=self.num_parallel,
                                                background=True)
        self.local = ModelLibrary(store)  # store operations: list, show, pull, create, ...
        self.executor = ThreadPoolExecutor(max_workers=self.num_parallel * 2 + 8,
                                           thread_name_prefix="exl3-job")
        self._slots: dict[str, _Slot] = {}  # by weights key (runtime/loaded_model.py)
        self._per_client: dict[str, int] = {}
        self.max_client_jobs = max_client_jobs
        self._jobs: dict[int, StreamJob | BatchedJob] = {}
        # EXL3_SERVE_RELAY=thread: the old relay (a thread and a loop call per object).
        self.batched_relay = os.environ.get("EXL3_SERVE_RELAY", "").strip() != "thread"
        self._relay: EventRelay | None = None
        self._ids = itertools.count()
        self._closing = False
        self._sweeper: asyncio.Task | None = None

    # ---- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def shutdown(self, grace: float = 0.0) -> None:
        """Refuse new jobs; give running ones up to `grace` seconds to finish, then
        cancel them (their streams end with a final error line, see the routes)."""
        self._closing = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self._jobs and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for job in list(self._jobs.values()):
            job.stopped_by_shutdown = True
            job.cancel.set()
        if self._sweeper is not None:
            self._sweeper.cancel()

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.runner.close()  # stops the generator threads

    async def _sweep(self) -> None:
        """Unload models whose keep_alive ran out, even when no request comes."""
        while True:
            await asyncio.sleep(SWEEP_SECONDS)
            try:
                await self.blocking(self.runner.ps)
            except Exception:
                log.exception("keep_alive sweep failed")

    # ---- jobs -----------------------------------------------------------------------

    async def blocking(self, func: Callable[..., Any], *args: Any) -> Any:
        """Run a blocking call (store work) on a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, func, *args)

    def stream(self, factory: Callable[[threading.Event], Iterator[dict]],
               on_finish: Callable[[str], None] | None = None) -> StreamJob:
        """A job with no queue (pull, create): runs at once on a worker thread;
        `on_finish(outcome)` runs on the loop before its stream ends."""
        return StreamJob(asyncio.get_running_loop(), self.executor, factory, on_finish)

    async def inference(self, kind: str, req: dict[str, Any],
                        client_gone: Callable[[], bool] = lambda: False,
                        client: str = "") -> StreamJob:
        """Queue a generate/chat request for its model; returns the started job once it
        has produced its first object. Raises ServerBusy when the queue is full (per
        model weights, or per `client` address past EXL3_MAX_CLIENT_JOBS), or the
        request's own error (unknown model, prompt too long) before anything is sent."""
        if self._closing:
            raise ServerBusy("server is shutting down")
        slot = await self._slot(str(req.get("model") or req.get("name") or ""))
        stats = slot.stats
        if stats.active + stats.queued >= self.num_parallel + self.max_queue:
            raise ServerBusy("server busy, please try again (maximum pending requests "
                             "exceeded)")
        if self.max_client_jobs and self._per_client.get(client, 0) >= self.max_client_jobs:
            raise ServerBusy(f"too many requests from this client at once (at most "
                             f"{self.max_client_jobs}: EXL3_MAX_CLIENT_JOBS)")
        self._per_client[client] = self._per_client.get(client, 0) + 1
        stats.queued += 1
        try:
            await slot.semaphore.acquire()
        except BaseException:
            self._client_done(client)
            raise
        finally:
            stats.queued -= 1
        if self._closing or client_gone():
            slot.semaphore.release()
            self._client_done(client)
            raise ServerBusy("server is shutting down") if self._closing else \
                ConnectionResetError("client went away while queued")
        stats.active += 1
        job_id = next(self._ids)

        def finished(outcome: str) -> None:
            self._jobs.pop(job_id, None)
            stats.active -= 1
            key = outcome if outcome in ("completed", "cancelled") else "failed"
            setattr(stats, key, getattr(stats, key) + 1)
            slot.semaphore.release()
            self._client_done(client)

        if self.batched_relay:
            job = await self._open_batched(kind, req, finished)
        else:
            method = getattr(self.runner, kind)
            job = self.stream(lambda cancel: method(req, cancel=cancel), on_finish=finished)
        self._jobs[job_id] = job
        try:
            await job.first()
        except BaseException:
            await job.close()
            raise
        return job

    async def _open_batched(self, kind: str, req: dict[str, Any],
                            finished: Callable[[str], None]) -> StreamJob | BatchedJob:
        """Start the job on a worker thread with its events going to the loop's relay;
        a load-only request (no prompt) answers through a plain StreamJob."""
        loop = asyncio.get_running_loop()
        if self._relay is None:
            self._relay = EventRelay(loop)
        relay = self._relay
        opening = loop.run_in_executor(self.executor, self.runner.open, kind, req,
                                       relay.batcher)
        try:
            opened = await asyncio.shield(opening)
        except asyncio.CancelledError:  # the request went away while the job started
            opening.add_done_callback(lambda _: self._abandon(opening, relay, finished))
            raise
        except BaseException:
            finished("failed")
            raise
        if not hasattr(opened, "push"):  # load-only: its one object, already made
            return self.stream(lambda cancel: opened, on_finish=finished)
        job = BatchedJob(loop, self.executor, opened, on_finish=finished)
        relay.register(job)
        return job

    def _abandon(self, opening: asyncio.Future, relay: EventRelay,
                 finished: Callable[[str], None]) -> None:
        """A job whose request went away while it started: stop it (on the loop)."""
        if opening.cancelled() or opening.exception() is not None:
            finished("failed")
            return
        opened = opening.result()
        if not hasattr(opened, "push"):
            finished("cancelled")
            return
        job = BatchedJob(opening.get_loop(), self.executor, opened, on_finish=finished)
        relay.register(job)
        asyncio.ensure_future(job.close())

    def _client_done(self, client: str) -> None:
        left = self._per_client.get(client, 0) - 1
        if left > 0:
            self._per_client[client] = left
        else:
            self._per_client.pop(client, None)

    async def _slot(self, model: str) -> _Slot:
        """The queue of the weights `model` names. An unknown or malformed name raises
        here (404/400) and leaves no entry behind."""
        name = ModelName.parse(model)
        manifest = await self.blocking(self.store.read_manifest, name)
        key = weights_key(manifest)
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _Slot(asyncio.Semaphore(self.num_parallel))
        slot.name = str(name)
        return slot

    def stats(self) -> dict[str, Any]:
        """Per-model job counters and totals, for GET /api/stats (one entry per set of
        weights, under the name last used for it)."""
        models = {slot.name: vars(slot.stats).copy() for slot in self._slots.values()}
        totals = {key: sum(m[key] for m in models.values())
                  for key in ("active", "queued", "completed", "cancelled", "failed")}
        return {"models": models, **totals, "num_parallel": self.num_parallel,
                "max_queue": self.max_queue, "runner": runner_diagnostics(self.runner)}
