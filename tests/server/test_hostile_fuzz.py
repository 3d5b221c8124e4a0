"""A hostile client fuzzing every route's JSON fields while innocent streams run.

Each route has a valid base body; each request replaces one field (top level, inside
`options`, or inside the first message) with a hostile value, or sends a hostile
whole body. Requests are bounded and seeded; every answer must be < 500 with the
route's error shape, and every innocent stream must end with its final object.
Counts are printed (`-s`) and recorded in tests/README.md.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
from urllib.parse import urlsplit

import pytest

from exl3cli.store.modelfile import PARAMETER_TYPES
from tests.fixtures.daemon import Daemon
from tests.fixtures.tiny_store import make_tiny_store

HOSTILE_VALUES: list[object] = [
    None, True, False, 0, -1, 1, 2**63, -(2**63) - 1, 10**30, 1e300, -1e300, 0.5, "",
    "x" * 5000, "\ud800", "../../etc/passwd", "/etc", "~/.ssh/id_rsa", "a:b:c", "hf.co",
    "{{ range(10**9) }}", "<|im_end|>", [], [1, 2], [None], ["a"], [{}], [[[[[]]]]], {},
    {"a": 1}, {"type": "function"}, {"role": "user"}, {"content": None},
    [{"role": "system", "content": 3}], [{"type": "function", "function": {"name": ""}}],
    [2**40, -5], ["not base64 !!"], "sha256:" + "0" * 64,
]
HOSTILE_BODIES: list[bytes] = [
    b"", b"null", b"[]", b"42", b'"text"', b"{", b"\xff\xfe", b'{"model": "tiny"', b"[" * 5000,
    b'{"a": ' * 3000 + b"1" + b"}" * 3000, b'{"model": NaN}', b'{"model": Infinity}',
    b'{"model": "\\ud800"}', json.dumps({"model": "tiny", "x": "y" * 100_000}).encode(),
]
INFER = {"model": "fuzz", "options": {"num_predict": 3}, "keep_alive": "1m"}
MESSAGES = [{"role": "user", "content": "hi"}]
ROUTES: list[tuple[str, str, dict]] = [
    ("POST", "/api/generate", {**INFER, "prompt": "hi", "stream": False}),
    ("POST", "/api/generate", {**INFER, "prompt": "hi", "system": "s", "raw": False,
                               "context": [1, 2], "format": "json", "suffix": "",
                               "template": "{{ messages[0].content }}", "think": False}),
    ("POST", "/api/chat", {**INFER, "messages": MESSAGES, "stream": True, "tools": [],
                           "format": None}),
    ("POST", "/api/show", {"model": "fuzz", "verbose": False}),
    ("POST", "/api/copy", {"source": "fuzz", "destination": "fuzz-copy"}),
    ("DELETE", "/api/delete", {"model": "fuzz-copy"}),
    ("POST", "/api/pull", {"model": "not-in-catalog-xyz", "stream": False, "insecure": False}),
    ("POST", "/api/create", {"model": "fuzz-made", "from": "fuzz", "system": "s",
                             "parameters": {"temperature": 0}, "messages": MESSAGES,
                             "template": "{{ 1 }}", "license": "L", "stream": False}),
    ("POST", "/api/create", {"model": "fuzz-made2", "modelfile": "FROM fuzz\n",
                             "files": None, "stream": True}),
    ("POST", "/api/embed", {"model": "fuzz", "input": ["a", "b"], "truncate": True}),
    ("POST", "/api/embeddings", {"model": "fuzz", "prompt": "a"}),
    ("POST", "/v1/chat/completions", {"model": "fuzz", "messages": MESSAGES, "max_tokens": 3,
                                      "temperature": 0.5, "top_p": 0.9, "stream": True,
                                      "stream_options": {"include_usage": True},
                                      "stop": ["x"], "seed": 1, "n": 1, "tools": None,
                                      "response_format": {"type": "text"}}),
    ("POST", "/v1/completions", {"model": "fuzz", "prompt": "hi", "max_tokens": 3,
                                 "echo": False, "stream": False}),
    ("POST", "/v1/embeddings", {"model": "fuzz", "input": "a", "encoding_format": "float"}),
    ("GET", "/api/tags", {}), ("GET", "/api/ps", {}), ("GET", "/api/stats", {}),
    ("GET", "/v1/models", {}), ("GET", "/api/version", {}),
    ("POST", "/api/blobs/sha256:" + "1" * 64, {"data": "x"}),
    ("HEAD", "/api/blobs/sha256-" + "2" * 64, {}),
]
REQUESTS_PER_ROUTE = 40
INNOCENT_STREAMS = 6
OPTION_NAMES = sorted(PARAMETER_TYPES)


def mutations(rng: random.Random, base: dict) -> list[bytes]:
    """Bodies for one route: one field replaced at a time, then whole hostile bodies."""
    bodies = []
    keys = sorted(base) or ["model"]
    for _ in range(REQUESTS_PER_ROUTE):
        body = json.loads(json.dumps(base))
        where = rng.random()
        value = rng.choice(HOSTILE_VALUES)
        if where < 0.25 and "options" in body:
            body["options"] = dict(body["options"], **{rng.choice(OPTION_NAMES): value})
        elif where < 0.35 and "messages" in body:
            field = rng.choice(["role", "content", "images", "tool_calls", "thinking"])
            body["messages"] = [dict(body["messages"][0], **{field: value})]
        else:
            body[rng.choice(keys + ["unknown_field"])] = value
        bodies.append(json.dumps(body).encode())
    return bodies + HOSTILE_BODIES


def send(url: str, method: str, path: str, data: bytes) -> tuple[int, bytes]:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        connection.request(method, path, body=data if method not in ("GET", "HEAD") else None,
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def error_shape_ok(path: str, status: int, raw: bytes) -> bool:
    if status < 400:
        return True
    try:
        error = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    if path.startswith("/v1/"):
        return isinstance(error, dict) and isinstance(error.get("message"), str)
    return isinstance(error, str) and bool(error)


def stream_errors(raw: bytes) -> list[str]:
    """Error lines inside a 200 NDJSON/SSE answer (they must be 4xx-style messages)."""
    found = []
    for line in raw.splitlines():
        line = line.removeprefix(b"data: ").strip()
        if line.startswith(b"{") and b'"error"' in line:
            found.append(line.decode("utf-8", "replace"))
    return found


@pytest.fixture(scope="module")
def fuzz_daemon(tmp_path_factory):
    store = make_tiny_store(tmp_path_factory.mktemp("fuzz"), name="fuzz")
    manifest = store.read_manifest("fuzz")
    manifest.parameters.update({"num_predict": 4, "num_ctx": 256})
    store.write_manifest("fuzz", manifest)
    store.copy("fuzz", "innocent")
    with Daemon(store, num_parallel=4, max_queue=64) as daemon:
        yield daemon


def test_fuzz_every_route_while_innocent_streams_run(fuzz_daemon):
    rng = random.Random(12)
    url = fuzz_daemon.url
    innocent_results: list[dict] = []
    stop = threading.Event()

    def innocent() -> None:
        while not stop.is_set():
            status, raw = send(url, "POST", "/api/chat", json.dumps({
                "model": "innocent", "messages": MESSAGES,
                "options": {"num_predict": 12, "temperature": 0}}).encode())
            items = [json.loads(line) for line in raw.splitlines() if line.strip()]
            innocent_results.append({"status": status, "last": items[-1] if items else {}})

    threads = [threading.Thread(target=innocent) for _ in range(INNOCENT_STREAMS)]
    for thread in threads:
        thread.start()
    tried, server_errors, bad_shapes, mid_stream_internal = 0, [], [], []
    try:
        for method, path, base in ROUTES:
            for data in mutations(rng, base):
                status, raw = send(url, method, path, data)
                tried += 1
                if status >= 500 and status != 503:
                    server_errors.append((path, data[:200], status, raw[:300]))
                if method != "HEAD" and not error_shape_ok(path, status, raw):
                    bad_shapes.append((path, data[:200], status, raw[:300]))
                for line in stream_errors(raw) if status == 200 else []:
                    if "internal error" in line:
                        mid_stream_internal.append((path, data[:200], line[:300]))
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
    lost = [r for r in innocent_results
            if r["status"] != 200 or r["last"].get("done") is not True]
    print(f"\nfuzz: {tried} requests tried, {len(server_errors)} 5xx, "
          f"{len(innocent_results)} innocent streams, {len(lost)} lost")
    assert not server_errors, server_errors[:5]
    assert not bad_shapes, bad_shapes[:5]
    assert not mid_stream_internal, mid_stream_internal[:5]
    assert innocent_results and not lost, lost[:5]


def test_concurrent_create_rm_pull_with_kills_leave_a_whole_store(tmp_path, monkeypatch):
    """Creates, copies and deletes over HTTP race each other and `exl3 pull` / `exl3
    create` processes killed with SIGKILL; afterwards every model is whole, no answer
    was a 5xx, and once the store is opened again no leftover remains."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from exl3cli.store.store import ModelStore
    from tests.fixtures.local_hub import LocalHub
    from tests.fixtures.tiny_store import write_tiny_chat_model

    store = make_tiny_store(tmp_path, name="base")
    big = write_tiny_chat_model(tmp_path / "big")
    with open(big / "padding.bin", "wb") as handle:
        handle.write(os.urandom(1 << 20) * 32)
    (tmp_path / "Modelfile").write_text(f"FROM {big}\n")
    statuses: list[tuple[str, int]] = []
    with LocalHub() as hub, Daemon(store) as daemon:
        hub.add_repo("someone/big", big)
        env = dict(os.environ, EXL3_MODELS=str(store.root), HF_ENDPOINT=hub.url,
                   EXL3_HOST="127.0.0.1:9")

        def churn(worker: int) -> None:
            for round_ in range(6):
                name = f"made-{worker}-{round_}"
                for method, path, body in (
                        ("POST", "/api/create", {"model": name, "from": "base",
                                                 "system": f"s{round_}", "stream": False}),
                        ("POST", "/api/copy", {"source": name, "destination": name + "-c"}),
                        ("DELETE", "/api/delete", {"model": name}),
                        ("DELETE", "/api/delete", {"model": name + "-c"})):
                    status, _raw = send(daemon.url, method, path, json.dumps(body).encode())
                    statuses.append((path, status))

        workers = [threading.Thread(target=churn, args=(i,)) for i in range(3)]
        for worker in workers:
            worker.start()
        kills = 0
        for args in (["pull", "hf.co/someone/big"], ["create", "half", "-f",
                                                    str(tmp_path / "Modelfile")]) * 2:
            process = subprocess.Popen([sys.executable, "-m", "exl3cli", *args], env=env,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.3 + 0.4 * kills)
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
                kills += 1
            process.wait(30)
        for worker in workers:
            worker.join(120)
    reopened = ModelStore(store.root)
    leftovers = [p for p in store.root.rglob("*") if p.name.startswith((".tmp-", ".convert-"))]
    broken = [str(row.name) for row in reopened.list_models()
              if not all(reopened.has_blob(d) for d in reopened.read_manifest(row.name)
                         .files.values())]
    print(f"\nchurn: {len(statuses)} store requests, {kills} kills, "
          f"{len(leftovers)} leftovers, {len(broken)} broken models")
    assert all(status < 500 for _path, status in statuses), statuses
    assert all(status == 200 for path, status in statuses if path == "/api/create")
    assert kills >= 1 and not leftovers and not broken
