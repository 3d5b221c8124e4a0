"""Many concurrent streaming clients against a running `exl3 serve`, through the official
`ollama` and `openai` Python clients (threads, one client object each).

For every model: one solo request first (its greedy text is the reference), then
`--clients` concurrent streaming requests with the same prompt through each API; each
records time to first content and its token count. Reported per (phase, API, model):
how many finished, how many texts equal the solo one, aggregate tok/s (all generated
tokens over the phase's wall time), p50/p95 time to first token.
`--together` sends the clients of all models at once (with EXL3_MAX_LOADED_MODELS=2
on the server both stay loaded); otherwise the models take turns.

    python bench/real_models/serve_clients.py --host http://127.0.0.1:11435 \
        --model smol --model gemma --clients 64 --tokens 64 --out clients.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ollama_request(host: str, model: str, tokens: int, prompt: str = PROMPT,
                   num_ctx: int | None = None) -> dict[str, Any]:
    import ollama

    client = ollama.Client(host=host, timeout=600)
    start = time.perf_counter()
    first, parts, count = None, [], 0
    options: dict[str, Any] = {"temperature": 0, "num_predict": tokens}
    if num_ctx is not None:
        options["num_ctx"] = num_ctx
    for chunk in client.chat(model=model, messages=[{"role": "user", "content": prompt}],
                             stream=True, options=options):
        text = chunk["message"]["content"]
        if text and first is None:
            first = time.perf_counter() - start
        parts.append(text)
        if chunk.get("done"):
            count = int(chunk.get("eval_count") or 0)
    return {"text": "".join(parts), "ttft": first, "tokens": count,
            "latency": time.perf_counter() - start}


def openai_request(host: str, model: str, tokens: int, prompt: str = PROMPT,
                   num_ctx: int | None = None) -> dict[str, Any]:
    """`num_ctx` has no OpenAI field: the server's default context is used."""
    import openai

    client = openai.OpenAI(base_url=host.rstrip("/") + "/v1", api_key="none", timeout=600,
                           max_retries=0)
    start = time.perf_counter()
    first, parts, count = None, [], 0
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], stream=True,
        temperature=0, max_tokens=tokens, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            count = int(chunk.usage.completion_tokens)
        if not chunk.choices:
            continue
        text = chunk.choices[0].delta.content or ""
        if text and first is None:
            first = time.perf_counter() - start
        parts.append(text)
    return {"text": "".join(parts), "ttft": first, "tokens": count,
            "latency": time.perf_counter() - start}


APIS: dict[str, Callable[..., dict[str, Any]]] = {
    "ollama": ollama_request, "openai": openai_request}


def at_once(calls: list[Callable[[], dict]]) -> tuple[list[dict], float]:
    """Run each call on its own thread, all released together by one barrier;
    (their results in order, wall seconds)."""
    results: list[dict] = [{} for _ in calls]
    barrier = threading.Barrier(len(calls))

    def worker(i: int) -> None:
        barrier.wait()
        results[i] = calls[i]()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(calls))]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - start


def _fire(calls: list[tuple[str, str]], host: str, tokens: int) -> tuple[list[dict], float]:
    """Run (api, model) requests all at once on threads; (results in order, wall s)."""

    def one(api: str, model: str) -> dict:
        try:
            return {"api": api, "model": model, **APIS[api](host, model, tokens)}
        except Exception as error:  # every failure is counted, none stops the others
            return {"api": api, "model": model, "error": f"{type(error).__name__}: {error}"}

    return at_once([lambda api=api, model=model: one(api, model) for api, model in calls])


def _summary(results: list[dict], solo: dict[str, str], wall: float) -> list[dict]:
    rows = []
    for key in sorted({(r["api"], r["model"]) for r in results}):
        mine = [r for r in results if (r["api"], r["model"]) == key]
        ok = [r for r in mine if "error" not in r]
        ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
        rows.append({
            "api": key[0], "model": key[1], "clients": len(mine), "finished": len(ok),
            "same_as_solo": sum(r["text"] == solo[key[1]] for r in ok),
            "tokens": sum(r["tokens"] for r in ok),
            "tok_s": round(sum(r["tokens"] for r in ok) / wall, 1),
            "ttft_p50_ms": round(1000 * _percentile(ttfts, 0.5), 1) if ttfts else None,
            "ttft_p95_ms": round(1000 * _percentile(ttfts, 0.95), 1) if ttfts else None,
            "latency_p50_ms": round(1000 * statistics.median(r["latency"] for r in ok), 1)
            if ok else None,
            "errors": sorted({r["error"] for r in mine if "error" in r})[:3],
            "other_texts": _other_texts([r["text"] for r in ok], solo[key[1]]),
        })
    return rows


def _other_texts(texts: list[str], solo: str, keep: int = 3) -> list[dict]:
    """The texts unlike the solo one, most common first: how many clients got each, the
    character where it leaves the solo text, and the text from a little before there
    (a near tie continues sanely; a broken step does not)."""
    counts: dict[str, int] = {}
    for text in texts:
        if text != solo:
            counts[text] = counts.get(text, 0) + 1
    rows = []
    for text, count in sorted(counts.items(), key=lambda kv: -kv[1])[:keep]:
        at = next((i for i, (a, b) in enumerate(zip(text, solo, strict=False)) if a != b),
                  min(len(text), len(solo)))
        rows.append({"clients": count, "differs_at_char": at, "text": text[max(0, at - 40):]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="http://127.0.0.1:11435")
    parser.add_argument("--model", action="append", required=True)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--api", action="append", choices=sorted(APIS))
    parser.add_argument("--together", action="store_true",
                        help="all models' clients at once (split evenly between models)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    apis = args.api or sorted(APIS)
    solo = {m: ollama_request(args.host, m, args.tokens)["text"] for m in args.model}
    phases = []
    if args.together:
        each = max(1, args.clients // len(args.model))
        for api in apis:
            calls = [(api, m) for m in args.model for _ in range(each)]
            results, wall = _fire(calls, args.host, args.tokens)
            phases.append({"phase": "together", "wall_s": round(wall, 2),
                           "rows": _summary(results, solo, wall)})
    else:
        for model in args.model:
            for api in apis:
                results, wall = _fire([(api, model)] * args.clients, args.host, args.tokens)
                phases.append({"phase": "turns", "wall_s": round(wall, 2),
                               "rows": _summary(results, solo, wall)})
    report = {"clients": args.clients, "tokens": args.tokens, "solo": solo, "phases": phases}
    Path(args.out).write_text(json.dumps(report, indent=1))
    bad = 0
    for phase in phases:
        for row in phase["rows"]:
            bad += row["finished"] != row["clients"]
            print(f"{phase['phase']:<9}{row['api']:<8}{row['model']:<12}"
                  f"{row['finished']:>3}/{row['clients']:<3} finished, "
                  f"{row['same_as_solo']:>3} same as solo, {row['tok_s']:>8} tok/s, "
                  f"TTFT p50 {row['ttft_p50_ms']} ms p95 {row['ttft_p95_ms']} ms"
                  + (f"  errors: {row['errors']}" if row["errors"] else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
