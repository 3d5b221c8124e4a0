"""A Generator's steps on a daemon thread (the daemon's and the Python API's way to run
one): ``GeneratorThread(generator)``, a context manager or ``start()`` / ``stop()``."""

from __future__ import annotations

import threading
import time

from exl3cli.engine.generation.generator import Generator


class GeneratorThread:
    """Runs a Generator's steps on a daemon thread while it has work.

    Use as a context manager, or start()/stop(). While it runs, handles block on their
    event queues instead of stepping the generator themselves.
    """

    def __init__(self, generator: Generator):
        self.generator = generator
        self._stop = False
        self._thread: threading.Thread | None = None
        # Cheap counters for GET /api/stats (runtime/diagnostics.py): steps taken, jobs
        # fed over them, time inside step() and the slowest step.
        self.steps = 0
        self.jobs_fed = 0
        self.busy_ns = 0
        self.slowest_ns = 0

    def start(self) -> GeneratorThread:
        self.generator.background = True
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="exl3-generator", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self.generator._work:
            self._stop = True
            self.generator._work.notify_all()
        if self._thread is not None:
            self._thread.join()
        self.generator.background = False

    def _run(self) -> None:
        generator = self.generator
        while True:
            with generator._work:
                while not self._stop and not generator.has_work:
                    generator._work.wait()
                if self._stop:
                    return
            began = time.perf_counter_ns()
            try:
                report = generator.step()
            except Exception as error:  # a failed step must not leave consumers waiting
                generator.fail_all(error)
                continue
            took = time.perf_counter_ns() - began
            self.steps += 1
            self.jobs_fed += report.jobs
            self.busy_ns += took
            self.slowest_ns = max(self.slowest_ns, took)

    def __enter__(self) -> GeneratorThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
