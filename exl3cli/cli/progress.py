"""One progress renderer for every command (pull, the pull inside `run`, convert).

Events are Ollama's /api/pull lines: `{"status"}` and, for byte counts,
`{"status", "digest", "total", "completed"}`. On a terminal each counted step gets a
live tqdm bar (rate, ETA); anywhere else (a pipe, a log file, CI) each status is
written once as a plain line and a counted step once when it completes, with no escape
codes and no rates computed from cached files ("55.0TB/s").
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, TextIO

import click
from tqdm import tqdm

from exl3cli.errors import PullError


def human_size(count: float) -> str:
    """1234567 -> '1.2 MB' (decimal units, as Ollama prints sizes)."""
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


def is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class ProgressPrinter:
    """Renders progress events on `stream` (stderr by default, as it is when created:
    tests swap it). `tty` overrides the terminal check."""

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None):
        self._stream = stream or sys.stderr
        self.tty = is_terminal(self._stream) if tty is None else tty
        self._bars: dict[str, tqdm] = {}
        self._finished: set[str] = set()
        self._last_status: str | None = None

    def __call__(self, event: dict[str, Any]) -> None:
        if "error" in event:
            self.close()
            raise PullError(str(event["error"]))
        status = str(event.get("status", ""))
        if event.get("total"):
            self._counted(status, event)
            return
        if status and status != self._last_status:
            self._close_bars()
            click.echo(status, file=self._stream)
            self._last_status = status

    def _counted(self, status: str, event: dict[str, Any]) -> None:
        key = str(event.get("digest") or status)
        total, done = int(event["total"]), int(event.get("completed") or 0)
        if not self.tty:
            if done >= total and key not in self._finished:
                self._finished.add(key)
                click.echo(f"{status} {human_size(total)}", file=self._stream)
                self._last_status = status
            return
        bar = self._bars.get(key)
        if bar is None:
            bar = tqdm(total=total, desc=status, unit="B", unit_scale=True,
                       unit_divisor=1024, file=self._stream, leave=True,
                       dynamic_ncols=True, mininterval=0.25)
            self._bars[key] = bar
        bar.total = total
        bar.update(done - bar.n)
        if bar.n >= bar.total:
            bar.refresh()

    def _close_bars(self) -> None:
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()

    def close(self) -> None:
        self._close_bars()


def show_progress(events: Iterable[dict[str, Any]], stream: TextIO | None = None) -> None:
    """Render every event of `events` (raises PullError on an error line)."""
    printer = ProgressPrinter(stream)
    try:
        for event in events:
            printer(event)
    finally:
        printer.close()
