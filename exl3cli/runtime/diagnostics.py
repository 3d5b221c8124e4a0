"""What the runner's loaded models did, for GET /api/stats (`runner` there): loads and
evictions, and per model its generator thread's steps (jobs fed, time stepping, the
slowest step) and its decode step's mode, CUDA graphs and captures. Enough to tell,
from one served run, whether models were reloaded, whether a generator stepped rarely
or slowly, and whether graphs were captured again and again or failed (each failed
capture leaves its step shape without a graph; decode mode "static" on CUDA means
captures failed MAX_CAPTURE_FAILURES times and decoding went on without graphs).

Read without the runner's lock (a snapshot of counters), so the event loop never waits.
"""

from __future__ import annotations

from typing import Any


def model_diagnostics(loaded: Any) -> dict[str, Any]:
    """One loaded model's counters (zeros before its generator is built)."""
    generator = loaded.generator
    thread = loaded.generator_thread
    decode = getattr(generator, "decode", None)
    steps = getattr(thread, "steps", 0)
    busy_ns = getattr(thread, "busy_ns", 0)
    return {
        "name": loaded.name,
        "in_use": loaded.in_use,
        "active_jobs": getattr(generator, "active_jobs", 0),
        "queued_jobs": getattr(generator, "queued_jobs", 0),
        "max_batch": getattr(generator, "max_batch", 0),
        "steps": steps,
        "jobs_fed": getattr(thread, "jobs_fed", 0),
        "jobs_per_step": round(getattr(thread, "jobs_fed", 0) / steps, 2) if steps else 0.0,
        "step_busy_s": round(busy_ns / 1e9, 3),
        "step_mean_ms": round(busy_ns / steps / 1e6, 3) if steps else 0.0,
        "step_slowest_ms": round(getattr(thread, "slowest_ns", 0) / 1e6, 3),
        "launched_ahead": getattr(generator, "launched_ahead", 0),
        "launched_late": getattr(generator, "launched_late", 0),
        "launched_before_text": getattr(generator, "launched_before_text", 0),
        "decode_mode": getattr(decode, "mode", None),
        "graphs": getattr(decode, "graph_count", 0),
        "captures": getattr(decode, "captures", 0),
        "capture_s": round(getattr(decode, "capture_ns", 0) / 1e9, 3),
        "capture_failures": getattr(decode, "capture_failures", 0),
    }


def runner_diagnostics(runner: Any) -> dict[str, Any]:
    """The runner's loads, evictions and every loaded model's counters."""
    loads = dict(getattr(runner, "loads", {}))
    models = [model_diagnostics(m) for m in list(getattr(runner, "_loaded", {}).values())]
    for entry in models:
        entry["loads"] = loads.get(entry["name"], 0)
    return {"loads": sum(loads.values()), "evictions": getattr(runner, "evictions", 0),
            "models": models}
