"""How a generate/chat job's generator events become Ollama response objects: streamed
chunks (or, unstreamed, one object), thinking split from content, tool calls parsed
out of it, log-probabilities attached, then the final object with Ollama's counters.
`InferenceRunner` (residency.py) holds the model around it.

`ResponseShaper` does it one event at a time (push), so the daemon can shape events
on its event loop as they arrive in batches; `stream_responses` is the same over a
handle's blocking event iterator.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from exl3cli.runtime.logprobs import logprob_entries


class ResponseShaper:
    """Turns one job's generator events into response objects, pushed one at a time.

    `push(event)` returns the objects the event makes (none, chunks, or at the done
    event the last chunks and the final object); `ended` is set at the done event and
    `cancelled` when it was a cancellation (no final object then).
    """

    def __init__(self, job: Any, handle: Any, tokenizer: Any, ignored: list[str],
                 started: int, load_ns: int):
        self.job, self.handle, self.tokenizer = job, handle, tokenizer
        self.ignored, self.started, self.load_ns = ignored, started, load_ns
        self.pieces: list[tuple[str, str]] = []
        self.generated: list[int] = []
        self.splitter = job.thinking_splitter()
        self.tool_parser = job.tool_parser()
        self.logprobs: list[dict] = []  # entries not attached to a response object yet
        self.ended = False
        self.cancelled = False

    def _routed(self, items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """Thinking passes through; content goes through the tool-call parser."""
        out: list[tuple[str, Any]] = []
        for kind, part in items:
            out.extend(self.tool_parser.push(part) if kind == "content" else [(kind, part)])
        return out

    def _chunk(self, part: Any, kind: str) -> dict:
        body = self.job.chunk(part, kind)
        if self.job.recorder is not None:
            body["logprobs"] = self.logprobs[:]
            self.logprobs.clear()
        return body

    def _emit(self, items: list[tuple[str, Any]], out: list[dict]) -> None:
        for kind, part in items:
            if self.job.streaming:
                out.append(self._chunk(part, kind))
            else:
                self.pieces.append((kind, part))

    def push(self, event: Any) -> list[dict]:
        if self.ended:
            return []
        out: list[dict] = []
        if not event.done:
            self.generated.extend(event.token_ids)
            if self.job.recorder is not None:
                self.logprobs.extend(logprob_entries(
                    self.tokenizer, self.job.recorder.take(len(event.token_ids))))
            self._emit(self._routed(self.splitter.push(event.text)), out)
            return out
        self.ended = True
        if event.cancelled:
            self.cancelled = True
            return out  # cancelled (client gone): nobody reads a final object
        self._emit(self._routed(self.splitter.flush()) + self.tool_parser.flush(), out)
        out.append(self._final(event))
        return out

    def _final(self, done: Any) -> dict:
        job = self.job
        final = job.final(
            pieces=None if job.streaming else self.pieces,
            done_reason=done.done_reason or "stop",
            metrics={
                "total_duration": time.perf_counter_ns() - self.started,
                "load_duration": self.load_ns,
                "prompt_eval_count": done.prompt_eval_count,
                "prompt_eval_duration": done.prompt_eval_duration,
                "eval_count": done.eval_count,
                "eval_duration": done.eval_duration,
                # not Ollama fields: prompt tokens taken from the prefix cache, and
                # (with a DRAFT) draft tokens verified and kept
                "prompt_cache_count": done.prompt_cache_count,
                **({"draft_count": done.draft_count,
                    "draft_accepted": done.draft_accepted} if done.draft_count else {}),
            },
            warnings=[f"invalid option provided: {name}" for name in self.ignored],
            context=list(self.handle.prompt) + self.generated,
        )
        if job.recorder is not None:
            final["logprobs"] = self.logprobs[:]  # what no chunk carried (all, unstreamed)
        return final


def stream_responses(job: Any, handle: Any, cancel: threading.Event, tokenizer: Any,
                     ignored: list[str], started: int, load_ns: int) -> Iterator[dict]:
    """Turn the job's generator events into response objects (chunks, or one object
    if not streaming), then the final object with Ollama's counters."""
    shaper = ResponseShaper(job, handle, tokenizer, ignored, started, load_ns)
    events = handle.iter_events(cancel)
    try:
        for event in events:
            yield from shaper.push(event)
            if shaper.ended:
                break
    finally:
        events.close()  # an abandoned stream (Ctrl-C, client gone) cancels the job


class PushedResponses:
    """A job submitted with an event sink (engine/generation/wake.py): the consumer
    feeds it the job's events as they come (`push`, on the consumer's thread) and
    calls `release()` once the job has ended or been cancelled, off that thread (it
    takes the runner's lock). `cancel()` stops the job (it takes the generator's)."""

    def __init__(self, shaper: ResponseShaper, release: Callable[[], None]):
        self.shaper = shaper
        self.handle = shaper.handle
        self._release = release
        self._released = False
        self.error: BaseException | None = None  # the generator's own failure, if any

    @property
    def ended(self) -> bool:
        return self.shaper.ended

    def push(self, events: list[Any]) -> list[dict]:
        """The response objects of `events`; at a done event that carries the
        generator's own failure, `error` is set instead (the objects before it stay)."""
        out: list[dict] = []
        for event in events:
            if event.done and self.handle.error is not None:
                self.shaper.ended = True
                self.error = self.handle.error
                break
            out += self.shaper.push(event)
        return out

    def cancel(self) -> None:
        self.handle.cancel()

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._release()
