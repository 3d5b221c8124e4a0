"""The batched hand-off of generated tokens to the event loop (server/batched_stream.py,
engine/generation/wake.py): many concurrent streams through the official clients get
exactly their solo chunks, in order, none lost or duplicated; the loop is woken at
most once per generator step; a client that leaves mid-stream harms no one else and
its job stops."""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import ollama
import openai
import pytest

from exl3cli.engine.generation.wake import WakeBatcher
from tests.fixtures.daemon import Daemon
from tests.fixtures.http_raw import server_stats as stats
from tests.fixtures.http_raw import wait_for

CLIENTS = 24


def question(index: int) -> list[dict]:
    return [{"role": "user", "content": f"question number {index} " * (1 + index % 3)}]


def greedy(tokens: int) -> dict:
    return {"temperature": 0, "num_predict": tokens}


def ollama_chunks(url: str, index: int, tokens: int = 12) -> list[str]:
    parts = ollama.Client(host=url, timeout=120).chat(
        model="tiny", messages=question(index), options=greedy(tokens), stream=True)
    chunks = list(parts)
    assert chunks[-1].done and sum(1 for c in chunks if c.done) == 1
    return [c.message.content or "" for c in chunks]


def openai_chunks(url: str, index: int, tokens: int = 12) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(model="tiny", messages=question(index),
                                            max_tokens=tokens, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason is not None
    return [c.choices[0].delta.content or "" for c in chunks if c.choices]




def test_a_batcher_wakes_once_for_many_jobs_until_taken():
    wakes: list[int] = []
    batcher = WakeBatcher(lambda: wakes.append(1))
    batcher.flush()
    assert wakes == []  # nothing pending: no wake-up
    for job in range(64):
        batcher.add(job, [f"{job}a"])
    batcher.flush()
    batcher.add(3, ["3b"])
    batcher.flush()  # the consumer has not taken the first batch yet: no second wake
    assert wakes == [1]
    taken = batcher.take()
    assert list(taken) == list(range(64)) and taken[3] == ["3a", "3b"]
    batcher.add(5, ["5c"])
    batcher.flush()
    assert wakes == [1, 1] and batcher.take() == {5: ["5c"]} and batcher.take() == {}


@pytest.mark.parametrize("chunks_of", [ollama_chunks, openai_chunks], ids=["ollama", "openai"])
def test_concurrent_streams_get_exactly_their_solo_chunks(store, chunks_of):
    with Daemon(store, num_parallel=8) as daemon:
        solo = [chunks_of(daemon.url, index) for index in range(CLIENTS)]
        generator = daemon.manager.runner.generator_for("tiny")
        steps: list = []
        generator.step_observers.append(steps.append)
        relay = daemon.manager._relay
        wakes_before = relay.batcher.wakes
        hogging = threading.Event()

        def hog_the_loop() -> None:  # the loop busy now and then: tokens pile up per job
            while not hogging.is_set():
                daemon._loop.call_soon_threadsafe(time.sleep, 0.02)
                time.sleep(0.03)

        hog = threading.Thread(target=hog_the_loop)
        hog.start()
        try:
            with ThreadPoolExecutor(CLIENTS) as pool:
                together = list(pool.map(lambda i: chunks_of(daemon.url, i), range(CLIENTS)))
        finally:
            hogging.set()
            hog.join()
        assert together == solo  # same chunks, same order: none lost, none duplicated
        assert any("".join(chunks) for chunks in solo)
        # one wake-up per generator step at most, however many jobs each step served
        assert relay.batcher.wakes - wakes_before <= len(steps)
        assert max(report.jobs for report in steps) > 1
        wait_for(lambda: stats(daemon.url)["active"] == 0)
        counters = stats(daemon.url)
        assert counters["completed"] == 2 * CLIENTS and counters["failed"] == 0


def test_the_thread_relay_gives_the_same_chunks(store):
    with Daemon(store) as daemon:
        batched = [ollama_chunks(daemon.url, index) for index in range(3)]
        daemon.manager.batched_relay = False
        assert [ollama_chunks(daemon.url, index) for index in range(3)] == batched


def slow_down(generator, seconds: float = 0.01) -> None:
    """Make each generator step last `seconds` longer, so a job of the tiny model's whole
    context (256 tokens) runs for seconds: long enough to be left mid-stream."""
    generator.step_observers.append(lambda report: time.sleep(seconds))


def endless(url: str, index: int) -> dict:
    """A greedy request for the whole context whose answer is checked not to end
    (EOS) within its first 40 tokens, so a test can leave or cancel it in time."""
    answer = ollama.Client(host=url, timeout=120).chat(
        model="tiny", messages=question(index), options=greedy(40))
    assert answer.eval_count == 40 and answer.done_reason == "length"
    return {"model": "tiny", "messages": question(index), "options": greedy(-1)}


def open_stream(url: str, body: dict) -> tuple[http.client.HTTPConnection,
                                               http.client.HTTPResponse]:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    connection.request("POST", "/api/chat", body=json.dumps(body))
    return connection, connection.getresponse()


def test_a_client_that_leaves_mid_stream_harms_no_one_and_its_job_stops(store):
    with Daemon(store, num_parallel=8) as daemon:
        solo = [ollama_chunks(daemon.url, index, tokens=40) for index in range(6)]
        generator = daemon.manager.runner.generator_for("tiny")
        slow_down(generator)
        leaving = endless(daemon.url, 99)
        connection, response = open_stream(daemon.url, leaving)
        for _ in range(3):
            assert json.loads(response.readline())["done"] is False
        results: list = []

        def others() -> None:
            with ThreadPoolExecutor(6) as pool:
                results.extend(pool.map(lambda i: ollama_chunks(daemon.url, i, tokens=40),
                                        range(6)))

        runner = threading.Thread(target=others)
        runner.start()
        time.sleep(0.2)
        connection.sock.close()  # mid-stream, while the others run
        connection.close()
        runner.join(120)
        assert results == solo
        wait_for(lambda: stats(daemon.url)["active"] == 0, timeout=20)
        counters = stats(daemon.url)
        assert counters["cancelled"] == 1 and counters["failed"] == 0
        assert counters["completed"] == 13  # 6 solo, 6 beside it, the check of it
        assert not generator.has_work  # cancelling stopped the endless job
        assert (generator.pool.pages_in_use, generator.pool.reserved) == (0, 0)
        assert daemon.manager._relay._jobs == {} and daemon.manager._relay._unclaimed == {}


def test_cancelling_at_shutdown_stops_a_running_job(store):
    with Daemon(store) as daemon:
        body = endless(daemon.url, 7)  # also loads the model
        generator = daemon.manager.runner.generator_for("tiny")
        slow_down(generator)
        connection, response = open_stream(daemon.url, body)
        assert json.loads(response.readline())["done"] is False
        [job] = daemon.manager._jobs.values()
        job.cancel.set()  # what shutdown and the disconnect watcher do
        lines = [json.loads(line) for line in response.read().splitlines() if line]
        assert not any(line.get("done") for line in lines), lines[-2:]  # cancelled: no final
        wait_for(lambda: stats(daemon.url)["cancelled"] == 1)
        assert stats(daemon.url)["completed"] == 1  # only the check of the request
        assert not generator.has_work and generator.pool.pages_in_use == 0
        connection.close()


def test_a_failed_generator_step_ends_the_stream_with_an_error_line(store):
    with Daemon(store) as daemon:
        ollama_chunks(daemon.url, 0, tokens=1)  # loads the model
        generator = daemon.manager.runner.generator_for("tiny")
        steps: list = []

        def fail_at_the_fifth_step(report) -> None:
            steps.append(report)
            if len(steps) == 5:
                raise RuntimeError("step exploded")

        body = endless(daemon.url, 3)  # does not end by itself before the fifth step
        generator.step_observers.append(fail_at_the_fifth_step)
        connection, response = open_stream(daemon.url, body)
        lines = [json.loads(line) for line in response.read().splitlines() if line]
        connection.close()
        assert lines[-1] == {"error": "step exploded"}
        assert not any(line.get("done") for line in lines[:-1])
        wait_for(lambda: stats(daemon.url)["failed"] == 1)
        assert ollama_chunks(daemon.url, 1, tokens=3)  # the daemon still serves
