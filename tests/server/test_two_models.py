"""Two models loaded together (EXL3_MAX_LOADED_MODELS=2): neither waits for the other.

On the H200 two models served together collapsed ~15x against one at a time
(bench/NOTES-serve.md, "two models together"). One coupling between them: a request
was handed to its model's generator while the runner-wide lock was held, and handing
it over waits for that generator's step lock, held for a whole step (for a CUDA graph
capture, two warm-up passes and the capture). Every other request, of either model,
and every job's end waited behind it.
"""

from __future__ import annotations

import threading
from pathlib import Path

import ollama
import pytest

from exl3cli.runtime.residency import InferenceRunner
from exl3cli.server.model_manager import ModelManager
from exl3cli.store.store import ModelStore
from tests.fixtures.daemon import Daemon
from tests.fixtures.tiny_store import write_tiny_chat_model

HELLO = [{"role": "user", "content": "hello"}]
SHORT = {"temperature": 0, "num_predict": 3}


@pytest.fixture(scope="module")
def two_store(tmp_path_factory) -> ModelStore:
    root: Path = tmp_path_factory.mktemp("two-models")
    store = ModelStore(root / "store")
    for name, seed in (("alpha", 0), ("beta", 1)):  # other weights: two loaded models
        folder = write_tiny_chat_model(root / f"{name}-src", seed=seed)
        store.import_folder(name, folder, {"type": "folder", "path": str(folder)})
    return store


def chat(runner: InferenceRunner, model: str) -> list[dict]:
    return list(runner.chat({"model": model, "messages": HELLO, "options": SHORT}))


def test_a_request_for_one_model_does_not_wait_for_the_other_models_step(two_store):
    runner = InferenceRunner(two_store, max_loaded=2, num_parallel=4, background=True)
    try:
        chat(runner, "alpha")
        chat(runner, "beta")
        alpha = runner.generator_for("alpha")
        handing_over = threading.Event()
        submit = alpha.submit

        def watched(job):
            handing_over.set()
            return submit(job)

        alpha.submit = watched
        hold, holding = threading.Event(), threading.Event()

        def long_step() -> None:  # alpha's step lock held, as by a step or a capture
            with alpha.lock:
                holding.set()
                hold.wait(30)

        holder = threading.Thread(target=long_step)
        holder.start()
        assert holding.wait(10)
        answers: dict[str, list[dict]] = {}
        alpha_thread = threading.Thread(target=lambda: answers.update(alpha=chat(runner, "alpha")))
        alpha_thread.start()
        assert handing_over.wait(30)  # alpha's request now waits for alpha's step
        beta_thread = threading.Thread(target=lambda: answers.update(beta=chat(runner, "beta")))
        beta_thread.start()
        beta_thread.join(20)
        beta_done = not beta_thread.is_alive()
        hold.set()
        holder.join(10)
        alpha_thread.join(30)
        assert beta_done, "beta's request waited for alpha's step"
        assert answers["alpha"][-1]["done"] and answers["beta"][-1]["done"]
        assert runner.loads == {"alpha:latest": 1, "beta:latest": 1}
    finally:
        runner.close()


def test_two_models_served_together_stay_loaded_and_both_step(two_store):
    manager = ModelManager(two_store, num_parallel=8, max_loaded=2)
    with Daemon(two_store, manager=manager) as daemon:
        def stream(model: str) -> int:
            chunks = list(ollama.Client(host=daemon.url).chat(
                model=model, messages=HELLO, options=SHORT, stream=True))
            return int(chunks[-1].eval_count or 0)

        models = ["alpha", "beta"] * 8
        threads = [threading.Thread(target=stream, args=(m,)) for m in models]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        runner_stats = manager.stats()["runner"]
    assert runner_stats["loads"] == 2 and runner_stats["evictions"] == 0
    by_name = {entry["name"]: entry for entry in runner_stats["models"]}
    assert set(by_name) == {"alpha:latest", "beta:latest"}
    for entry in by_name.values():
        assert entry["loads"] == 1
        assert entry["steps"] >= SHORT["num_predict"]  # both generators stepped
        assert entry["jobs_fed"] >= 9 * SHORT["num_predict"] // 2
        assert entry["decode_mode"] == "off" and entry["capture_failures"] == 0
