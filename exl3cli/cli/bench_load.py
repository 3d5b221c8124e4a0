"""Load benchmark: replay streaming chat requests against a running server.

Works with any Ollama-compatible (`/api/chat`, NDJSON) or OpenAI-compatible
(`/v1/chat/completions`, SSE) server, ours or not, so two servers can be compared with
the same command. `concurrency` workers share `requests` requests; each records time to
first token (the first non-empty content), total latency and the number of generated
tokens (the server's own count when it reports one, else the content chunks).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class LoadConfig:
    """What to send, where, and how hard."""

    server: str
    model: str
    requests: int = 32
    concurrency: int = 4
    prompt: str = "Write a short story about a robot who learns to paint."
    api: str = "ollama"  # or "openai"
    num_predict: int = 64
    temperature: float = 0.0
    timeout: float = 600.0
    api_key: str | None = None


@dataclass
class RequestResult:
    """One request's outcome; times in seconds from its own start."""

    ok: bool
    latency: float
    ttft: float | None = None
    tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None


@dataclass
class LoadReport:
    """The figures of a run (times in milliseconds)."""

    server: str
    api: str
    model: str
    concurrency: int
    requests: int
    completed: int
    errors: int
    duration_s: float
    requests_per_s: float
    output_tokens: int
    prompt_tokens: int
    tokens_per_s: float
    ttft_ms: dict[str, float | None]
    latency_ms: dict[str, float | None]
    error_messages: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def percentile(values: list[float], pct: float) -> float | None:
    """The `pct` percentile by linear interpolation between closest ranks."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _summary(seconds: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name, pct in (("p50", 50), ("p95", 95), ("p99", 99)):
        value = percentile(seconds, pct)
        out[name] = None if value is None else round(value * 1000.0, 3)
    out["mean"] = round(sum(seconds) / len(seconds) * 1000.0, 3) if seconds else None
    return out


def _request(config: LoadConfig) -> tuple[str, dict[str, Any]]:
    base = config.server.rstrip("/")
    messages = [{"role": "user", "content": config.prompt}]
    if config.api == "openai":
        return base + "/v1/chat/completions", {
            "model": config.model, "messages": messages, "stream": True,
            "max_tokens": config.num_predict, "temperature": config.temperature,
            "stream_options": {"include_usage": True}}
    return base + "/api/chat", {
        "model": config.model, "messages": messages, "stream": True,
        "options": {"num_predict": config.num_predict, "temperature": config.temperature}}


async def _lines(response: aiohttp.ClientResponse):
    """Decoded objects of an NDJSON or SSE body."""
    async for raw in response.content:
        line = raw.decode("utf-8", "replace").strip()
        if not line:
            continue
        if line.startswith("data:"):
            line = line[5:].strip()
            if line == "[DONE]":
                return
        elif line.startswith((":", "event:")):
            continue
        yield json.loads(line)


def _content_of(obj: dict[str, Any], api: str) -> str:
    if api == "openai":
        choices = obj.get("choices") or []
        delta = (choices[0].get("delta") or {}) if choices else {}
        return (delta.get("content") or "") + (delta.get("reasoning") or "")
    message = obj.get("message") or {}
    return (message.get("content") or "") + (message.get("thinking") or "")


async def _one(session: aiohttp.ClientSession, config: LoadConfig) -> RequestResult:
    url, body = _request(config)
    start = time.perf_counter()
    ttft = None
    chunks = tokens = prompt_tokens = 0
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                text = (await response.text())[:200]
                return RequestResult(False, time.perf_counter() - start,
                                     error=f"HTTP {response.status}: {text}")
            async for obj in _lines(response):
                if not isinstance(obj, dict):
                    continue
                if obj.get("error"):
                    error = obj["error"]
                    message = error.get("message") if isinstance(error, dict) else error
                    return RequestResult(False, time.perf_counter() - start,
                                         error=str(message))
                if _content_of(obj, config.api):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - start
                usage = obj.get("usage") if config.api == "openai" else obj
                if isinstance(usage, dict):
                    tokens = usage.get("completion_tokens", usage.get("eval_count")) or tokens
                    prompt_tokens = usage.get("prompt_tokens",
                                              usage.get("prompt_eval_count")) or prompt_tokens
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
        return RequestResult(False, time.perf_counter() - start,
                             error=f"{type(error).__name__}: {error}")
    return RequestResult(True, time.perf_counter() - start, ttft, tokens or chunks,
                         prompt_tokens)


async def run_load_async(config: LoadConfig) -> LoadReport:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    timeout = aiohttp.ClientTimeout(total=config.timeout)
    connector = aiohttp.TCPConnector(limit=max(1, config.concurrency))
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(config.requests):
        queue.put_nowait(index)
    results: list[RequestResult] = []
    async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                     connector=connector) as session:

        async def worker() -> None:
            while True:
                try:
                    queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results.append(await _one(session, config))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(max(1, config.concurrency))))
        duration = time.perf_counter() - started
    return summarize(config, results, duration)


def summarize(config: LoadConfig, results: list[RequestResult],
              duration: float) -> LoadReport:
    """The report of a finished run."""
    good = [r for r in results if r.ok]
    output_tokens = sum(r.tokens for r in good)
    errors = [r.error or "unknown error" for r in results if not r.ok]
    return LoadReport(
        server=config.server, api=config.api, model=config.model,
        concurrency=config.concurrency, requests=len(results), completed=len(good),
        errors=len(errors), duration_s=round(duration, 4),
        requests_per_s=round(len(good) / duration, 4) if duration > 0 else 0.0,
        output_tokens=output_tokens, prompt_tokens=sum(r.prompt_tokens for r in good),
        tokens_per_s=round(output_tokens / duration, 3) if duration > 0 else 0.0,
        ttft_ms=_summary([r.ttft for r in good if r.ttft is not None]),
        latency_ms=_summary([r.latency for r in good]),
        error_messages=sorted(set(errors))[:5],
    )


def run_load(config: LoadConfig) -> LoadReport:
    """Run the benchmark to the end (blocking)."""
    return asyncio.run(run_load_async(config))


def format_report(report: LoadReport) -> str:
    """A human-readable table of the report."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} ms"

    lines = [
        f"server       {report.server} ({report.api})",
        f"model        {report.model}",
        f"requests     {report.completed}/{report.requests} ok, {report.errors} errors, "
        f"concurrency {report.concurrency}",
        f"duration     {report.duration_s:.2f} s",
        f"throughput   {report.requests_per_s:.2f} requests/s, "
        f"{report.tokens_per_s:.1f} tokens/s ({report.output_tokens} tokens)",
        "",
        f"{'':14}{'p50':>12}{'p95':>12}{'p99':>12}{'mean':>12}",
    ]
    for name, figures in (("first token", report.ttft_ms), ("latency", report.latency_ms)):
        lines.append(f"{name:14}" + "".join(f"{ms(figures[k]):>12}"
                                            for k in ("p50", "p95", "p99", "mean")))
    for message in report.error_messages:
        lines.append(f"error: {message}")
    return "\n".join(lines)
