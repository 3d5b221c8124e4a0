"""InferenceRunner on a real tiny model in a real store: Ollama-shaped bodies, option
merging, Modelfile settings, context limits, caching, keep_alive."""

from __future__ import annotations

import json
import logging
import threading

import pytest

from exl3cli.engine.text.tokenizer import Tokenizer
from exl3cli.errors import ContextOverflow, InvalidOption, ModelNotFound
from exl3cli.runtime.jobs import ThinkingSplitter
from exl3cli.runtime.options import merge_options, parse_keep_alive
from exl3cli.runtime.residency import InferenceRunner
from exl3cli.store.manifest import Manifest
from tests.fixtures.tiny_store import make_tiny_store

GREEDY = {"temperature": 0}
FINAL_FIELDS = ("total_duration", "load_duration", "prompt_eval_count",
                "prompt_eval_duration", "eval_count", "eval_duration")


@pytest.fixture(scope="module")
def runner(store):
    return InferenceRunner(store)


@pytest.fixture(scope="module")
def tokenizer(store):
    return Tokenizer.from_folder(store.model_folder("tiny"))


def derive(store, name, **settings):
    """Store `name` as the tiny model's weights with Modelfile-like settings."""
    base = store.read_manifest("tiny")
    store.write_manifest(name, Manifest(files=dict(base.files), source=dict(base.source),
                                        **settings))


def generate(runner, **req):
    return list(runner.generate({"model": "tiny", **req}))


def text_of(chunks):
    return "".join(c.get("response") or (c.get("message") or {}).get("content", "")
                   for c in chunks)


def test_generate_streams_chunks_then_a_final_object_with_ollama_counters(runner):
    chunks = generate(runner, prompt="Hello there", options={**GREEDY, "num_predict": 8})
    assert all(c["done"] is False and c["model"] == "tiny" for c in chunks[:-1])
    assert all(isinstance(c["response"], str) and c["created_at"].endswith("Z")
               for c in chunks[:-1])
    final = chunks[-1]
    assert final["done"] is True and final["response"] == ""
    assert final["done_reason"] == "length"
    assert final["eval_count"] == 8
    for name in FINAL_FIELDS:
        assert isinstance(final[name], int) and final[name] >= 0, name
    assert final["total_duration"] >= final["prompt_eval_duration"] + final["eval_duration"]
    # context = the prompt tokens, then the generated ones
    assert len(final["context"]) == final["prompt_eval_count"] + final["eval_count"]


def test_greedy_is_deterministic_and_stream_false_matches_the_stream(runner):
    options = {**GREEDY, "num_predict": 12}
    first = text_of(generate(runner, prompt="Once upon a time", options=options))
    second = text_of(generate(runner, prompt="Once upon a time", options=options))
    whole = generate(runner, prompt="Once upon a time", options=options, stream=False)
    assert first and first == second
    assert len(whole) == 1 and whole[0]["done"] is True
    assert whole[0]["response"] == first


def test_chat_streams_assistant_messages(runner):
    req = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
           "options": {**GREEDY, "num_predict": 6}}
    chunks = list(runner.chat(req))
    assert all(c["message"]["role"] == "assistant" for c in chunks)
    final = chunks[-1]
    assert final["done"] is True and final["message"]["content"] == ""
    assert final["eval_count"] == 6 and "context" not in final
    whole = list(runner.chat({**req, "stream": False}))
    assert whole[0]["message"]["content"] == text_of(chunks[:-1])


def test_num_predict_and_stop_strings(runner):
    full = text_of(generate(runner, prompt="The sky is", options={**GREEDY, "num_predict": 30}))
    stop = full.strip()[4:7]
    assert len(stop) == 3 and stop.strip()
    chunks = generate(runner, prompt="The sky is",
                      options={**GREEDY, "num_predict": 30, "stop": [stop]})
    assert text_of(chunks) == full[:full.index(stop)]
    assert chunks[-1]["done_reason"] == "stop"
    # a single string works as well as a list
    again = generate(runner, prompt="The sky is", options={**GREEDY, "num_predict": 30,
                                                          "stop": stop})
    assert text_of(again) == text_of(chunks)


def test_manifest_parameters_are_defaults_that_request_options_override(runner, store):
    derive(store, "tiny-three", parameters={"num_predict": 3, "temperature": 0})
    chunks = list(runner.generate({"model": "tiny-three", "prompt": "Hello"}))
    assert chunks[-1]["eval_count"] == 3
    chunks = list(runner.generate({"model": "tiny-three", "prompt": "Hello",
                                   "options": {"num_predict": 5}}))
    assert chunks[-1]["eval_count"] == 5


def test_manifest_system_messages_and_template_shape_the_prompt(runner, store, tokenizer):
    options = {**GREEDY, "num_predict": 1}
    derive(store, "tiny-system", system="Answer briefly.")
    with_manifest = generate(runner, prompt="Hi", options=options)[-1]
    from_manifest = list(runner.generate({"model": "tiny-system", "prompt": "Hi",
                                          "options": options}))[-1]
    from_request = generate(runner, prompt="Hi", system="Answer briefly.", options=options)[-1]
    prompt_len = from_request["prompt_eval_count"]
    assert from_manifest["context"][:prompt_len] == from_request["context"][:prompt_len]
    assert "Answer briefly." in tokenizer.decode(from_manifest["context"][:prompt_len])
    assert "Answer briefly." not in tokenizer.decode(with_manifest["context"])

    derive(store, "tiny-messages", messages=[{"role": "user", "content": "earlier question"},
                                             {"role": "assistant", "content": "old answer"}])
    final = list(runner.generate({"model": "tiny-messages", "prompt": "Hi",
                                  "options": options}))[-1]
    prompt = tokenizer.decode(final["context"][:final["prompt_eval_count"]])
    assert prompt.index("earlier question") < prompt.index("old answer") < prompt.index("Hi")

    derive(store, "tiny-template", template="Q: {{ messages[-1]['content'] }} A:")
    final = list(runner.generate({"model": "tiny-template", "prompt": "Hi there",
                                  "options": options}))[-1]
    assert final["prompt_eval_count"] == len(tokenizer.encode("Q: Hi there A:"))


def test_raw_prompt_skips_the_template(runner, tokenizer):
    final = generate(runner, prompt="plain text", raw=True, options={**GREEDY,
                                                                    "num_predict": 1})[-1]
    assert final["prompt_eval_count"] == len(tokenizer.encode("plain text"))


def test_prompt_longer_than_the_context_is_an_error_at_call_time(runner, tokenizer):
    with pytest.raises(ContextOverflow, match="context"):
        runner.generate({"model": "tiny", "prompt": "word " * 100, "options": {"num_ctx": 32}})
    # the model's own limit (max_position_embeddings 256) also applies
    with pytest.raises(ContextOverflow):
        runner.generate({"model": "tiny", "prompt": "Hello there friend " * 200})
    # unless truncation is asked for: then the prompt keeps its first num_keep tokens and
    # its most recent ones, half a context in all
    final = generate(runner, prompt="word " * 100, raw=True,
                     options={**GREEDY, "num_ctx": 32, "truncate": True, "num_keep": 3,
                              "num_predict": 2})[-1]
    ids = tokenizer.encode("word " * 100)
    assert final["context"][:-final["eval_count"]] == ids[:3] + ids[-13:]
    assert final["prompt_eval_count"] == 16
    # and generation stops at the context end with done_reason "length"
    final = generate(runner, prompt="Hi", options={**GREEDY, "num_ctx": 48})[-1]
    assert final["done_reason"] == "length"
    assert final["prompt_eval_count"] + final["eval_count"] <= 48


def test_unknown_options_are_ignored_with_a_warning(runner, caplog):
    with caplog.at_level(logging.WARNING):
        final = generate(runner, prompt="Hi", options={**GREEDY, "num_predict": 2,
                                                       "no_such_option": 1})[-1]
    assert final["eval_count"] == 2
    assert final["warnings"] == ["invalid option provided: no_such_option"]
    assert "no_such_option" in caplog.text


def test_bad_option_values_and_unknown_models_raise(runner):
    with pytest.raises(InvalidOption):
        runner.generate({"model": "tiny", "prompt": "Hi", "options": {"temperature": "hot"}})
    with pytest.raises(ModelNotFound):
        runner.generate({"model": "missing-model", "prompt": "Hi"})
    with pytest.raises(InvalidOption):
        runner.chat({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]})


def test_empty_prompt_loads_keep_alive_zero_unloads_and_ps_reports(store):
    runner = InferenceRunner(store)
    assert runner.ps() == {"models": []}
    [loaded] = list(runner.generate({"model": "tiny", "prompt": ""}))
    assert loaded["done"] is True and loaded["done_reason"] == "load"
    [entry] = runner.ps()["models"]
    assert entry["name"] == "tiny:latest" and entry["size"] > 0 and entry["size_vram"] == 0
    assert entry["details"]["family"] == "llama"
    assert entry["expires_at"].endswith("Z")
    [unloaded] = list(runner.chat({"model": "tiny", "messages": [], "keep_alive": 0}))
    assert unloaded["done_reason"] == "unload"
    assert runner.ps() == {"models": []}


def test_a_held_model_stays_loaded_until_the_hold_ends(store):
    runner = InferenceRunner(store)
    manifest = store.read_manifest("tiny")
    with runner.holding("tiny", manifest, keep_alive=0) as loaded:
        assert loaded.in_use == 1 and loaded.text_model is not None
        assert runner.unload_all() == []  # in use: not dropped
        assert len(runner.ps()["models"]) == 1
    assert loaded.in_use == 0
    assert runner.ps() == {"models": []}  # keep_alive 0: gone once let go
    with pytest.raises(RuntimeError), runner.holding("tiny", manifest, None) as loaded:
        raise RuntimeError("the block failed")
    assert loaded.in_use == 0 and len(runner.ps()["models"]) == 1  # let go all the same


def test_names_sharing_weights_share_one_loaded_model(store):
    runner = InferenceRunner(store, max_loaded=2)
    derive(store, "tiny-alias", parameters={"num_predict": 2})
    list(runner.generate({"model": "tiny", "prompt": ""}))
    final = list(runner.generate({"model": "tiny-alias", "prompt": "Hi",
                                  "options": GREEDY}))[-1]
    assert len(runner.ps()["models"]) == 1
    assert final["eval_count"] == 2


def test_closing_a_stream_early_cancels_and_frees_the_model(runner):
    chunks = runner.generate({"model": "tiny", "prompt": "Hello",
                              "options": {**GREEDY, "num_predict": 50}})
    first = next(chunks)
    assert first["done"] is False
    chunks.close()
    # the model is free again: a new request runs to completion
    final = generate(runner, prompt="Hello", options={**GREEDY, "num_predict": 3})[-1]
    assert final["eval_count"] == 3


def test_merge_options_and_keep_alive_parsing():
    merged, ignored = merge_options({"temperature": 0.5, "stop": ["a"]},
                                    {"temperature": 0.1, "stop": "b", "bogus": 1,
                                     "top_k": None})
    assert merged == {"temperature": 0.1, "stop": ["b"]} and ignored == ["bogus"]
    assert parse_keep_alive("5m") == 300
    assert parse_keep_alive("1h30m") == 5400
    assert parse_keep_alive("250ms") == pytest.approx(0.25)
    assert parse_keep_alive(0) == 0
    assert parse_keep_alive("-1") is None and parse_keep_alive(-5) is None
    with pytest.raises(InvalidOption):
        parse_keep_alive("soon")


def test_thinking_splitter_routes_the_think_block_even_across_deltas():
    splitter = ThinkingSplitter(enabled=True)
    out = []
    for delta in ["<th", "ink>\nstep one", " two</th", "ink>\n\nThe answer", "."]:
        out += splitter.push(delta)
    out += splitter.flush()
    thinking = "".join(t for kind, t in out if kind == "thinking")
    content = "".join(t for kind, t in out if kind == "content")
    assert thinking == "step one two" and content == "The answer."
    plain = ThinkingSplitter(enabled=True)
    assert plain.push("No tags here") == [("content", "No tags here")]
    off = ThinkingSplitter(enabled=False)
    assert off.push("<think>x</think>") == [("content", "<think>x</think>")]


def test_a_conversation_longer_than_the_context_drops_its_oldest_turns(runner, tokenizer):
    history = []
    for turn in range(6):
        history += [{"role": "user", "content": f"question {turn} " + "words " * 12},
                    {"role": "assistant", "content": "answer " * 12}]
    messages = [{"role": "system", "content": "Be brief."}, *history,
                {"role": "user", "content": "last question"}]
    final = list(runner.chat({"model": "tiny", "messages": messages,
                              "options": {**GREEDY, "num_ctx": 120, "num_predict": 2}}))[-1]
    assert final["done"] is True
    assert final["prompt_eval_count"] < 120
    # a single message that cannot fit is still an error
    with pytest.raises(ContextOverflow):
        runner.chat({"model": "tiny", "messages": [{"role": "user", "content": "x " * 300}],
                     "options": {"num_ctx": 120}})


# ---- the continuous-batching generator behind the runner ---------------------------

PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                                   "age": {"type": "integer"}},
                 "required": ["name", "age"]}


@pytest.fixture(scope="module")
def long_store(tmp_path_factory):
    """The tiny model with room for prompts longer than a cache page (256 tokens)."""
    return make_tiny_store(tmp_path_factory.mktemp("inference-long"),
                           max_position_embeddings=1280)


def test_concurrent_requests_share_generator_steps_and_keep_their_greedy_text(store):
    requests = [{"model": "tiny", "prompt": text,
                 "options": {**GREEDY, "num_predict": 60}}
                for text in ("Once upon a time", "The weather today is")]
    alone_runs = [list(InferenceRunner(store).generate(req)) for req in requests]
    alone = [text_of(chunks) for chunks in alone_runs]
    assert min(chunks[-1]["eval_count"] for chunks in alone_runs) >= 30
    runner = InferenceRunner(store, num_parallel=2)
    list(runner.generate({**requests[0], "options": {**GREEDY, "num_predict": 1}}))
    generator = runner.generator_for("tiny")
    reports = []
    generator.step_observers.append(reports.append)
    # Both are submitted at the call; the generator's thread steps them together.
    streams = [runner.generate(req) for req in requests]
    answers = [list(stream) for stream in streams]
    assert [text_of(chunks) for chunks in answers] == alone
    assert [c[-1]["eval_count"] for c in answers] == [c[-1]["eval_count"] for c in alone_runs]
    shared = [r for r in reports if r.jobs == 2 and len(set(r.job_ids)) == 2]
    assert len(shared) >= 20  # most decode steps ran both jobs in one forward pass
    assert runner.generator_for("tiny") is generator  # same settings: no rebuild
    assert generator.pool.pages_in_use == 0
    runner.close()


def test_a_second_request_sharing_a_long_prefix_reuses_its_pages(long_store):
    tokenizer = Tokenizer.from_folder(long_store.model_folder("tiny"))
    prefix = " ".join(f"document line {i} says the value is {i * 7}." for i in range(26))
    first_req = {"model": "tiny", "prompt": prefix + " First question?", "raw": True,
                 "options": {**GREEDY, "num_predict": 5}}
    second_req = {**first_req, "prompt": prefix + " A different, second question?"}
    prompt_len = len(tokenizer.encode(second_req["prompt"]))
    assert prompt_len > 600
    runner = InferenceRunner(long_store)
    first = list(runner.generate(first_req))[-1]
    assert first["prompt_cache_count"] == 0
    second = list(runner.generate(second_req))
    final = second[-1]
    reused = final["prompt_cache_count"]
    assert reused >= 512 and reused % 256 == 0
    assert final["prompt_eval_count"] == prompt_len - reused
    assert len(final["context"]) == prompt_len + final["eval_count"]
    # Reused keys/values give the answer a fresh runner computes from scratch.
    fresh = list(InferenceRunner(long_store).generate(second_req))
    assert fresh[-1]["prompt_cache_count"] == 0
    assert text_of(second) == text_of(fresh)
    runner.close()


def test_kv_cache_type_comes_from_the_request_option_or_the_environment(store, monkeypatch):
    runner = InferenceRunner(store)
    chunks = generate(runner, prompt="Hello", options={**GREEDY, "num_predict": 6,
                                                       "kv_cache_type": "q8"})
    assert chunks[-1]["eval_count"] == 6
    generator = runner.generator_for("tiny")
    assert generator.cache_type.name == "q8" and generator.pool.cache_type.quantized
    q8_bytes = generator.pool.bytes_per_token()
    # Another type rebuilds the (idle) generator; the environment is the default.
    monkeypatch.setenv("EXL3_KV_CACHE_TYPE", "q4")
    generate(runner, prompt="Hello", options={**GREEDY, "num_predict": 2})
    q4 = runner.generator_for("tiny")
    assert q4 is not generator and q4.cache_type.name == "q4"
    assert q4.pool.cache_type.key_bits == q4.pool.cache_type.value_bits == 4
    derive(store, "tiny-fp16", parameters={"kv_cache_type": "fp16"})  # Modelfile PARAMETER
    list(runner.generate({"model": "tiny-fp16", "prompt": "Hello",
                          "options": {**GREEDY, "num_predict": 2}}))
    unquantized = runner.generator_for("tiny")
    assert unquantized.cache_type.name == "fp16"
    assert unquantized.pool.bytes_per_token() > q8_bytes
    with pytest.raises(InvalidOption):
        runner.generate({"model": "tiny", "prompt": "Hi", "options": {"kv_cache_type": "q99"}})
    runner.close()


def test_a_larger_num_ctx_waits_for_the_running_jobs_then_rebuilds(tmp_path):
    store = make_tiny_store(tmp_path, max_position_embeddings=8192)
    runner = InferenceRunner(store, num_parallel=2)
    generate(runner, prompt="Hi", options={**GREEDY, "num_predict": 1, "num_ctx": 64})
    first = runner.generator_for("tiny")
    assert first.num_ctx == 4096  # the default context, though the request asked less
    request = {**GREEDY, "num_predict": 80}
    alone = text_of(generate(runner, prompt="Hello", options=request))
    running = runner.generate({"model": "tiny", "prompt": "Hello", "options": request})
    waited: list = []
    idle_at_submit: list[bool] = []

    def ask_for_more_context() -> None:
        stream = runner.generate({"model": "tiny", "prompt": "Hi",  # submits at the call
                                  "options": {**GREEDY, "num_predict": 2, "num_ctx": 6000}})
        idle_at_submit.append(not first.has_work)
        waited.extend(stream)

    larger = threading.Thread(target=ask_for_more_context)
    larger.start()
    chunks = list(running)  # runs to its end on the first generator meanwhile
    larger.join(60)
    assert text_of(chunks) == alone and chunks[-1]["eval_count"] == 80
    assert waited and waited[-1]["eval_count"] == 2
    assert idle_at_submit == [True]  # the rebuild waited for the running job
    rebuilt = runner.generator_for("tiny")
    assert rebuilt is not first and rebuilt.num_ctx == 6000
    assert runner.ps()["models"][0]["context_length"] == 6000
    runner.close()


def test_a_json_schema_format_constrains_the_answer(runner):
    for seed in (3, 4):
        final = generate(runner, prompt="Who are you?", format=PERSON_SCHEMA, stream=False,
                         options={"temperature": 1.0, "seed": seed, "num_predict": 48})[-1]
        person = json.loads(final["response"])
        assert isinstance(person["name"], str) and isinstance(person["age"], int)
    whole = generate(runner, prompt="Hi", format="json", options={**GREEDY, "num_predict": 40})
    assert isinstance(json.loads(text_of(whole)), dict)


def test_cancel_and_early_close_return_the_pages_to_the_pool(runner):
    generate(runner, prompt="warm up", options={**GREEDY, "num_predict": 1})
    pool = runner.generator_for("tiny").pool
    baseline = (pool.pages_in_use, pool.reserved)
    cancel = threading.Event()
    chunks = runner.generate({"model": "tiny", "prompt": "Hello",
                              "options": {**GREEDY, "num_predict": 150}}, cancel=cancel)
    assert next(chunks)["done"] is False
    assert pool.pages_in_use > baseline[0]
    cancel.set()  # what the daemon does when the client goes away
    rest = list(chunks)
    assert len(rest) < 150 and not any(c["done"] for c in rest)  # no final object
    assert (pool.pages_in_use, pool.reserved) == baseline
    closed = runner.generate({"model": "tiny", "prompt": "Hello",
                              "options": {**GREEDY, "num_predict": 150}})
    next(closed)
    closed.close()
    assert (pool.pages_in_use, pool.reserved) == baseline
