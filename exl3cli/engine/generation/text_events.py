"""What a generation streams back: text deltas cut at stop strings, then one done event
with Ollama's counters (`TextEvent`), and the matcher that cuts them
(`StopStringMatcher`). The generator's jobs (generator_jobs.py) produce these."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class TextEvent:
    """A text delta, or (done=True) the end of the answer with its counters."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    done: bool = False
    done_reason: str | None = None
    prompt_eval_count: int = 0
    prompt_eval_duration: int = 0
    eval_count: int = 0
    eval_duration: int = 0
    cancelled: bool = False


class StopStringMatcher:
    """Cuts streamed text at the first stop string, never showing part of one.

    `push(text)` returns the text that is safe to show and whether a stop string
    was found; a tail that could still grow into a stop string is held back until
    the next push proves otherwise (or `flush()` at the end releases it).
    """

    def __init__(self, stops: Iterable[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        buffer = self._held + text
        hits = [(buffer.find(s), s) for s in self.stops if s in buffer]
        if hits:
            index = min(position for position, _ in hits)
            self._held = ""
            self.stopped = True
            return buffer[:index], True
        hold = self._partial_stop_length(buffer)
        self._held = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_stop_length(self, buffer: str) -> int:
        """Length of the longest tail of `buffer` that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest
