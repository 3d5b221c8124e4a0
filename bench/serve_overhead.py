"""Server CPU per streamed token and time to first token with N concurrent streaming
clients, for the batched hand-off and the old per-token relay, in the same run.

    python bench/serve_overhead.py [--clients 64] [--tokens 96] [--repeat 3] [--relays
        batched,thread] [--model-dir DIR] [--json]

A real daemon (aiohttp, create_app) serves the tests' tiny model (tests/fixtures:
random weights, 256-token context) on 127.0.0.1 in a child process, with
EXL3_NUM_PARALLEL = the client count so all clients share each generator step, and
EXL3_SERVE_RELAY choosing the hand-off (server/batched_stream.py, or `thread`: a relay
thread and a loop call per object, the path before). The clients, in this process,
are aiohttp coroutines posting streaming /api/chat requests (greedy, num_predict
--tokens); TTFT is request sent to first NDJSON line read. Server CPU is the child's
utime + stime over the timed round (/proc), divided by the tokens it reported
(eval_count). The floor is the same tokens through the engine alone (the Generator
with N jobs, no server) in a child process: CPU per token of the model itself.
Each relay is warmed up once, then run --repeat times alternating; medians reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve(store_root: str) -> None:
    """Child: a daemon on a free port; prints its URL, serves until stdin closes."""
    import threading

    from exl3cli.store.store import ModelStore
    from tests.fixtures.daemon import Daemon

    with Daemon(ModelStore(Path(store_root) / "store")) as daemon:
        print(daemon.url, flush=True)
        threading.Thread(target=sys.stdin.read, daemon=True).start()
        sys.stdin.read()


def engine_floor(store_root: str, clients: int, tokens: int) -> None:
    """Child: the same batch through the Generator alone; prints CPU us per token."""
    from exl3cli.engine.generation.generator import Generator
    from exl3cli.engine.generation.jobs import GenerationJob
    from exl3cli.runtime.residency import InferenceRunner
    from exl3cli.store.store import ModelStore

    runner = InferenceRunner(ModelStore(Path(store_root) / "store"))
    text_model = runner.loaded_model("tiny").text_model
    generator = Generator(text_model.model, text_model.tokenizer, max_batch=clients,
                          num_ctx=256)
    results = []
    for _ in range(2):  # warm-up, then timed
        handles = [generator.submit(GenerationJob(
            text_model.tokenizer.encode(f"question number {i}"), options={"temperature": 0},
            num_predict=tokens, ignore_eos=True)) for i in range(clients)]
        started = time.process_time()
        generator.run_until_done()
        spent = time.process_time() - started
        produced = sum(len(h.token_ids) for h in handles)
        results.append(spent / max(1, produced) * 1e6)
    print(json.dumps({"floor_us_per_token": results[-1]}), flush=True)


async def one_client(session, url: str, index: int, tokens: int) -> tuple[float, int]:
    body = {"model": "tiny", "stream": True,
            "messages": [{"role": "user", "content": f"question number {index}"}],
            "options": {"temperature": 0, "num_predict": tokens}}
    sent = time.perf_counter()
    ttft = None
    final: dict = {}
    async with session.post(url + "/api/chat", json=body) as response:
        async for line in response.content:
            if ttft is None:
                ttft = time.perf_counter() - sent
            if line.strip():
                item = json.loads(line)
                if item.get("done"):
                    final = item
    return ttft or 0.0, int(final.get("eval_count", 0))


async def round_trip(url: str, clients: int, tokens: int, pid: int) -> dict:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        before = cpu_seconds(pid)
        started = time.perf_counter()
        results = await asyncio.gather(*(one_client(session, url, i, tokens)
                                         for i in range(clients)))
        wall = time.perf_counter() - started
        spent = cpu_seconds(pid) - before
    ttfts = sorted(t for t, _ in results)
    produced = sum(n for _, n in results)
    return {"us_per_token": spent / max(1, produced) * 1e6, "tokens": produced,
            "tok_s": produced / wall, "ttft_p50_ms": 1e3 * ttfts[len(ttfts) // 2],
            "ttft_p95_ms": 1e3 * ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))]}


def start_server(store_root: str, relay: str, clients: int, code: str) -> subprocess.Popen:
    env = {**os.environ, "EXL3_SERVE_RELAY": relay, "EXL3_NUM_PARALLEL": str(clients),
           "EXL3_MAX_CLIENT_JOBS": "0", "PYTHONPATH": f"{code}{os.pathsep}{ROOT}"}
    return subprocess.Popen([sys.executable, __file__, "--serve", store_root], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--relays", default="batched,thread")
    parser.add_argument("--model-dir", help="where to write the tiny model (default: temp)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--code", default=str(ROOT),
                        help="the exl3cli source tree the daemon runs (another worktree, "
                        "e.g. main, for a before/after across commits)")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--floor", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve)
    if args.floor:
        return engine_floor(args.floor, args.clients, args.tokens)
    from tests.fixtures.tiny_store import make_tiny_store

    root = args.model_dir or tempfile.mkdtemp(prefix="serve-overhead-")
    if not (Path(root) / "store").exists():
        make_tiny_store(root)
    floor = json.loads(subprocess.run(
        [sys.executable, __file__, "--floor", root, "--clients", str(args.clients),
         "--tokens", str(args.tokens)], env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    relays = args.relays.split(",")
    servers = {relay: start_server(root, relay, args.clients, args.code) for relay in relays}
    runs: dict[str, list[dict]] = {relay: [] for relay in relays}
    try:
        urls = {relay: server.stdout.readline().strip() for relay, server in servers.items()}
        for relay in relays:  # warm-up: model loaded, kernels ready
            asyncio.run(round_trip(urls[relay], args.clients, args.tokens,
                                   servers[relay].pid))
        for _ in range(args.repeat):
            for relay in relays:
                runs[relay].append(asyncio.run(round_trip(
                    urls[relay], args.clients, args.tokens, servers[relay].pid)))
    finally:
        for server in servers.values():
            server.stdin.close()
            server.wait(30)
    summary = {relay: {key: statistics.median(r[key] for r in runs[relay])
                       for key in runs[relay][0]} for relay in relays}
    report = {"clients": args.clients, "tokens": args.tokens, "code": args.code, **floor,
              "median": summary, "runs": runs}
    if len(relays) == 2:
        new, old = (summary[r] for r in relays)
        report["ratio_old_over_new"] = {key: old[key] / new[key] for key in
                                        ("us_per_token", "ttft_p50_ms", "ttft_p95_ms")}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{args.clients} clients x {args.tokens} tokens; engine floor "
          f"{floor['floor_us_per_token']:.0f} us/token CPU")
    for relay, row in summary.items():
        print(f"  {relay:8s} server CPU {row['us_per_token']:6.0f} us/token  "
              f"TTFT p50 {row['ttft_p50_ms']:6.0f} ms  p95 {row['ttft_p95_ms']:6.0f} ms  "
              f"{row['tok_s']:7.0f} tok/s")
    if "ratio_old_over_new" in report:
        print("  old/new: " + ", ".join(f"{k} {v:.2f}x"
                                        for k, v in report["ratio_old_over_new"].items()))


if __name__ == "__main__":
    main()
