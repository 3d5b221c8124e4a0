"""Two tiny models served together vs one at a time, on the CPU (the shape of
bench/gpu_real_models.sh's serve stage: `turns` then `together`, streaming ollama or
openai clients on threads against a real daemon on 127.0.0.1).

    PYTHONPATH=. python bench/serve_together_cpu.py --clients 32 --tokens 32 --repeat 3

Per phase: wall s, aggregate tok/s (all tokens / wall), TTFT p50/p95 ms, and from the
server: loads, generator steps, mean jobs per step, per model. `--step-ms 10` holds
each step's lock 10 ms first (sleeping, the GIL free: what waiting on a GPU looks like).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent / "real_models"))

import serve_clients  # noqa: E402  (bench/real_models)

from exl3cli.server.model_manager import ModelManager  # noqa: E402
from exl3cli.store.store import ModelStore  # noqa: E402
from tests.fixtures.daemon import Daemon  # noqa: E402
from tests.fixtures.tiny_store import write_tiny_chat_model  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper."


def make_store(root: Path) -> ModelStore:
    store = ModelStore(root / "store")
    for name, arch, seed in (("alpha", "llama", 0), ("beta", "qwen2", 1)):
        folder = write_tiny_chat_model(root / f"{name}-src", arch, seed=seed,
                                       max_position_embeddings=512)
        store.import_folder(name, folder, {"type": "folder", "path": str(folder)})
    return store


def one_request(api: str, url: str, model: str, tokens: int) -> dict[str, Any]:
    """One streaming chat through the official client (bench/real_models/serve_clients.py)."""
    start = time.perf_counter()
    result = serve_clients.APIS[api](url, model, tokens, prompt=PROMPT, num_ctx=256)
    first = result["ttft"]
    return {"model": model, "ttft": first or (time.perf_counter() - start),
            "tokens": result["tokens"]}


def fire(api: str, url: str, models: list[str], tokens: int) -> tuple[list[dict], float]:
    return serve_clients.at_once([lambda m=m: one_request(api, url, m, tokens) for m in models])


class Probe:
    """Server-side counters: loads per model, steps and jobs fed per generator."""

    def __init__(self, manager: ModelManager):
        self.runner = manager.runner
        self.loads: dict[str, int] = {}
        self.steps: dict[str, list[int]] = {}
        self.captured: dict[str, set[int]] = {}  # batch buckets "captured" this phase
        load = self.runner._load

        def counted(key: str, name: str) -> Any:
            self.loads[name] = self.loads.get(name, 0) + 1
            return load(key, name)

        self.runner._load = counted

    def watch(self, name: str, step_ms: float = 0.0, capture_ms: float = 0.0) -> None:
        generator = self.runner.generator_for(name)
        if step_ms > 0 or capture_ms > 0:  # GPU-like: the step lock held while waiting
            step = generator.step
            buckets = self.captured.setdefault(name, set())

            def slow_step() -> Any:
                with generator.lock:
                    size = 1 << max(0, len(generator._active) - 1).bit_length()
                    if capture_ms > 0 and size not in buckets:  # a new bucket's graph
                        buckets.add(size)
                        time.sleep(capture_ms / 1000)
                    time.sleep(step_ms / 1000)
                    return step()

            generator.step = slow_step
        jobs = self.steps.setdefault(name, [])
        if not any(getattr(o, "_probe", False) for o in generator.step_observers):
            def seen(report: Any) -> None:
                if report.jobs:
                    jobs.append(report.jobs)
            seen._probe = True  # type: ignore[attr-defined]
            generator.step_observers.append(seen)


def phase(api: str, url: str, models: list[str], tokens: int, probe: Probe) -> dict:
    for steps in probe.steps.values():
        steps.clear()
    for seen in probe.captured.values():
        seen.clear()  # a fresh server per phase on the GPU: its graphs captured anew
    results, wall = fire(api, url, models, tokens)
    ttfts = sorted(r["ttft"] for r in results)
    total = sum(r["tokens"] for r in results)
    return {"wall_s": wall, "tok_s": total / wall, "tokens": total,
            "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2],
            "ttft_p95_ms": 1000 * ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))],
            "steps": {m: len(s) for m, s in probe.steps.items()},
            "jobs_per_step": {m: round(statistics.mean(s), 1) if s else 0
                              for m, s in probe.steps.items()},
            "loads": dict(probe.loads)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32, help="total, as on the GPU")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--api", default="ollama", choices=("ollama", "openai"))
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="hold each step's lock this long first (a GPU-like step)")
    parser.add_argument("--capture-ms", type=float, default=0.0,
                        help="hold the lock this long the first time a phase reaches a "
                             "batch bucket (a CUDA graph capture)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    os.environ.setdefault("EXL3_MAX_LOADED_MODELS", "2")
    with tempfile.TemporaryDirectory() as tmp:
        store = make_store(Path(tmp))
        manager = ModelManager(store, num_parallel=args.clients, max_loaded=2)
        probe = Probe(manager)
        with Daemon(store, manager=manager) as daemon:
            for name in ("alpha", "beta"):
                one_request(args.api, daemon.url, name, 4)  # load, build the generator
                probe.watch(name, args.step_ms, args.capture_ms)
            runs: dict[str, list[dict]] = {"alpha": [], "beta": [], "together": []}
            for _ in range(args.repeat):
                for name in ("alpha", "beta"):
                    runs[name].append(phase(args.api, daemon.url, [name] * args.clients,
                                            args.tokens, probe))
                half = args.clients // 2
                runs["together"].append(phase(args.api, daemon.url,
                                              ["alpha"] * half + ["beta"] * half,
                                              args.tokens, probe))
    report = {"clients": args.clients, "tokens": args.tokens, "api": args.api, "runs": runs}
    for name, items in runs.items():
        tok_s = statistics.median(r["tok_s"] for r in items)
        p50 = statistics.median(r["ttft_p50_ms"] for r in items)
        p95 = statistics.median(r["ttft_p95_ms"] for r in items)
        last = items[-1]
        print(f"{name:<9} {args.api:<7} {args.clients} clients: {tok_s:8.1f} tok/s "
              f"(runs {[round(r['tok_s']) for r in items]}), TTFT p50 {p50:7.1f} ms "
              f"p95 {p95:7.1f} ms; steps {last['steps']} jobs/step {last['jobs_per_step']} "
              f"loads {last['loads']}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
