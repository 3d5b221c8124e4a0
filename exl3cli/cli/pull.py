"""`exl3 pull MODEL`: fetch a model into the store, with progress bars on stderr."""

from __future__ import annotations

import sys
from typing import Any

import click
from tqdm import tqdm


class PullProgress:
    """Turns Ollama-style pull events into status lines and one byte bar per layer."""

    def __init__(self, stream: Any = None):
        # sys.stderr as it is now: one PullProgress per command run (tests swap it).
        self._stream = stream or sys.stderr
        self._bars: dict[str, tqdm] = {}
        self._last_status: str | None = None

    def __call__(self, event: dict[str, Any]) -> None:
        status = str(event.get("status", ""))
        if event.get("total"):
            key = str(event.get("digest") or status)
            bar = self._bars.get(key)
            if bar is None:
                bar = tqdm(total=int(event["total"]), desc=status, unit="B", unit_scale=True,
                           unit_divisor=1024, file=self._stream, leave=True,
                           dynamic_ncols=True, mininterval=0.25)
                self._bars[key] = bar
            bar.total = int(event["total"])
            bar.update(int(event.get("completed", 0)) - bar.n)
            if bar.n >= bar.total:
                bar.refresh()
            return
        if status and status != self._last_status:
            self._close_bars()
            click.echo(status, file=self._stream)
            self._last_status = status

    def _close_bars(self) -> None:
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()

    def close(self) -> None:
        self._close_bars()


@click.command("pull")
@click.argument("model")
def pull(model: str) -> None:
    """Pull a model from its sources (catalog name or hf.co/<user>/<repo>[:<revision>])."""
    from exl3cli.client import get_client

    progress = PullProgress()
    try:
        for event in get_client().pull({"model": model}):
            progress(event)
    finally:
        progress.close()


COMMANDS = [pull]
