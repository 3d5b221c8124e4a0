"""How a generate/chat job's generator events become Ollama response objects: streamed
chunks (or, unstreamed, one object), thinking split from content, tool calls parsed
out of it, log-probabilities attached, then the final object with Ollama's counters.
`InferenceRunner` (residency.py) holds the model around it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from exl3cli.runtime.logprobs import logprob_entries


def stream_responses(job: Any, handle: Any, cancel: threading.Event, tokenizer: Any,
                     ignored: list[str], started: int, load_ns: int) -> Iterator[dict]:
    """Turn the job's generator events into response objects (chunks, or one object
    if not streaming), then the final object with Ollama's counters."""
    final_event = None
    pieces: list[tuple[str, str]] = []
    generated: list[int] = []
    splitter = job.thinking_splitter()
    tool_parser = job.tool_parser()
    events = handle.iter_events(cancel)

    def routed(items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """Thinking passes through; content goes through the tool-call parser."""
        out: list[tuple[str, Any]] = []
        for kind, part in items:
            out.extend(tool_parser.push(part) if kind == "content" else [(kind, part)])
        return out

    logprobs: list[dict] = []  # entries not attached to a response object yet

    def chunk(part: Any, kind: str) -> dict:
        body = job.chunk(part, kind)
        if job.recorder is not None:
            body["logprobs"] = logprobs[:]
            logprobs.clear()
        return body

    try:
        for event in events:
            if event.done:
                final_event = event
                break
            generated.extend(event.token_ids)
            if job.recorder is not None:
                logprobs.extend(logprob_entries(
                    tokenizer, job.recorder.take(len(event.token_ids))))
            for kind, part in routed(splitter.push(event.text)):
                if job.streaming:
                    yield chunk(part, kind)
                else:
                    pieces.append((kind, part))
        if final_event is None or final_event.cancelled:
            return  # cancelled (client gone): nobody reads a final object
        for kind, part in routed(splitter.flush()) + tool_parser.flush():
            if job.streaming:
                yield chunk(part, kind)
            else:
                pieces.append((kind, part))
        done = final_event
        final = job.final(
            pieces=None if job.streaming else pieces,
            done_reason=done.done_reason or "stop",
            metrics={
                "total_duration": time.perf_counter_ns() - started,
                "load_duration": load_ns,
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
            warnings=[f"invalid option provided: {name}" for name in ignored],
            context=list(handle.prompt) + generated,
        )
        if job.recorder is not None:
            final["logprobs"] = logprobs[:]  # what no chunk carried (all, unstreamed)
        yield final
    finally:
        events.close()  # an abandoned stream (Ctrl-C, client gone) cancels the job
