import random
import threading

import pytest

from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.generator_thread import GeneratorThread
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.generation.textmodel import TextModel
from exl3cli.errors import ContextOverflow, GeneratorBusy
from tests.fixtures.paged import greedy_reference

GREEDY = {"temperature": 0}


def new_generator(text_model, **settings):
    settings.setdefault("num_ctx", 1280)
    return Generator(text_model.model, text_model.tokenizer, **settings)


def random_prompt(rng, length):
    return [rng.randrange(3, 400) for _ in range(length)]


def run_alone(text_model, job):
    generator = new_generator(text_model, max_batch=1)
    handle = generator.submit(job)
    generator.run_until_done()
    assert generator.pool.pages_in_use == 0
    return handle.token_ids, handle.final


def test_concurrent_jobs_match_jobs_run_alone(text_model):
    rng = random.Random(5)
    jobs = [GenerationJob(random_prompt(rng, rng.randrange(3, 600)), GREEDY,
                          num_predict=rng.randrange(2, 30)) for _ in range(16)]
    alone_runs = [run_alone(text_model, job) for job in jobs]
    alone = [tokens for tokens, _ in alone_runs]
    # The paged path agrees with whole-sequence forwards without a cache.
    for job, tokens in zip(jobs[:3], alone, strict=False):
        expected = greedy_reference(text_model.model, job.prompt_ids, job.num_predict,
                                    text_model.tokenizer.eos_token_ids)
        assert expected == tokens

    generator = new_generator(text_model, max_batch=8, max_prefill_tokens=96)
    before = (generator.pool.pages_in_use, generator.pool.available)
    handles = [generator.submit(job) for job in jobs[:10]]
    doomed = [generator.submit(GenerationJob(random_prompt(rng, 300), GREEDY, num_predict=50))
              for _ in range(2)]
    mixed_steps = 0
    for _ in range(12):
        report = generator.step()
        mixed_steps += report.decode_tokens > 0 and report.prefill_tokens > 0
        assert report.prefill_tokens <= 96
    handles += [generator.submit(job) for job in jobs[10:]]  # join mid-way
    while not all(handle.done for handle in doomed):
        generator.step()
        for handle in doomed:
            if not handle.done and handle.token_ids:
                handle.cancel()  # cancelled mid-generation
    generator.run_until_done()
    assert mixed_steps > 0  # decode tokens and prompt chunks did share forward passes
    for handle, (tokens, final) in zip(handles, alone_runs, strict=True):
        assert handle.token_ids == tokens
        assert handle.final.done_reason == final.done_reason
        assert handle.final.eval_count == final.eval_count
    assert sum(final.done_reason == "length" for _, final in alone_runs) >= 8
    for handle in doomed:
        assert handle.final.cancelled and 0 < len(handle.token_ids) < 50
    assert (generator.pool.pages_in_use, generator.pool.available) == before


def test_cancel_frees_pages_at_once(text_model):
    generator = new_generator(text_model, max_batch=2)
    handle = generator.submit(GenerationJob(list(range(3, 303)), GREEDY, num_predict=20))
    generator.step()
    assert generator.pool.pages_in_use == 2
    handle.cancel()
    assert generator.pool.pages_in_use == 0 and generator.pool.reserved == 0
    events = list(handle)
    assert events[-1].done and events[-1].cancelled


def test_shared_prefix_is_reused_not_recomputed(text_model):
    rng = random.Random(7)
    prefix = random_prompt(rng, 1000)
    first_prompt = prefix + random_prompt(rng, 20)
    second_prompt = prefix + random_prompt(rng, 35)
    generator = new_generator(text_model, max_batch=4)
    first = generator.submit(GenerationJob(first_prompt, GREEDY, num_predict=4))
    generator.run_until_done()
    second = generator.submit(GenerationJob(second_prompt, GREEDY, num_predict=4))
    generator.run_until_done()
    assert first.final.prompt_cache_count == 0
    assert first.final.prompt_eval_count == len(first_prompt)
    reused = second.final.prompt_cache_count
    assert reused >= 768
    assert second.final.prompt_eval_count == len(second_prompt) - reused
    # Reused pages hold the same keys/values: the answer is the one computed from scratch.
    assert second.token_ids == run_alone(text_model, GenerationJob(second_prompt, GREEDY,
                                                                   num_predict=4))[0]


def test_running_jobs_share_their_full_pages(text_model):
    rng = random.Random(8)
    prefix = random_prompt(rng, 600)
    generator = new_generator(text_model, max_batch=4)
    first = generator.submit(GenerationJob(prefix + [5], GREEDY, num_predict=30))
    while first.final is None and len(first.token_ids) < 1:
        generator.step()
    second = generator.submit(GenerationJob(prefix + [6, 7], GREEDY, num_predict=3))
    generator.run_until_done()
    assert second.final.prompt_cache_count == 512


def test_limits_and_stop_conditions(text_model):
    generator = new_generator(text_model, num_ctx=300)
    with pytest.raises(ContextOverflow):
        generator.submit(GenerationJob(list(range(3, 303)), GREEDY))
    truncated = generator.submit(GenerationJob(list(range(3, 353)), GREEDY, num_predict=2,
                                               truncate=True, num_keep=4))
    assert len(truncated.prompt) == 150 and truncated.prompt[:4] == [3, 4, 5, 6]
    assert truncated.prompt[-1] == 352
    # Without num_predict, a job ends at the context's end with "length".
    filling = generator.submit(GenerationJob(list(range(3, 283)), GREEDY))
    generator.run_until_done()
    assert filling.final.done_reason == "length" and filling.final.eval_count == 20
    # A stop string cuts the text and ends the job with "stop".
    probe = generator.submit(GenerationJob(list(range(3, 40)), GREEDY, num_predict=12))
    full_text = probe.text()
    assert len(full_text) > 4
    stop = full_text[2:4]
    stopped = generator.submit(GenerationJob(list(range(3, 40)), GREEDY, num_predict=12,
                                             stop=[stop]))
    events = list(stopped)
    text = "".join(e.text for e in events)
    assert text == full_text[: full_text.index(stop)]
    assert events[-1].done_reason == "stop"


def test_queue_is_bounded(text_model):
    generator = new_generator(text_model, max_batch=1, max_queue=2)
    generator.submit(GenerationJob([5, 6], GREEDY, num_predict=1))
    generator.submit(GenerationJob([5, 6], GREEDY, num_predict=1))
    with pytest.raises(GeneratorBusy):
        generator.submit(GenerationJob([5, 6], GREEDY, num_predict=1))
    generator.run_until_done()
    generator.submit(GenerationJob([5, 6], GREEDY, num_predict=1))


def test_background_thread_serves_concurrent_consumers(text_model):
    rng = random.Random(9)
    jobs = [GenerationJob(random_prompt(rng, 40 + 30 * i), GREEDY, num_predict=6)
            for i in range(4)]
    expected = [run_alone(text_model, job)[0] for job in jobs]
    generator = new_generator(text_model, max_batch=4)
    results: dict[int, list[int]] = {}

    def consume(index):
        handle = generator.submit(jobs[index])
        for _ in handle:
            pass
        results[index] = handle.token_ids

    with GeneratorThread(generator):
        threads = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    assert [results[i] for i in range(4)] == expected
    assert generator.pool.pages_in_use == 0


@pytest.mark.slow
def test_smollm2_concurrent_jobs_match_jobs_run_alone(tmp_path):
    from exl3cli.store.pull import pull_model
    from exl3cli.store.store import ModelStore

    store = ModelStore(tmp_path / "store")
    pull_model(store, "smollm2")
    model = TextModel.load(store.model_folder("smollm2"), device="cpu")
    texts = ["The capital of France is", "def fibonacci(n):",
             "Once upon a time, in a small village,", "The three primary colors are",
             "Water boils at", "A haiku about autumn:\n"]
    jobs = [GenerationJob(model.tokenizer.encode(t * (1 + i)), GREEDY, num_predict=6 + i)
            for i, t in enumerate(texts)]
    alone = [run_alone(model, job)[0] for job in jobs]
    generator = Generator(model.model, model.tokenizer, max_batch=6, num_ctx=512,
                          kv_cache_type="fp16", max_prefill_tokens=16)
    handles = [generator.submit(job) for job in jobs[:3]]
    for _ in range(3):
        generator.step()
    handles += [generator.submit(job) for job in jobs[3:]]
    generator.run_until_done()
    assert [h.token_ids for h in handles] == alone
    assert generator.pool.pages_in_use == 0


def test_structured_output_constraints_apply_per_job_in_the_batch(text_model):
    import json

    from exl3cli.engine.grammar.constraints import build_constraint

    schema = {"type": "object", "properties": {"n": {"type": "integer"},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"]}
    rng = random.Random(11)
    prompts = [random_prompt(rng, 30 + 20 * i) for i in range(3)]
    sampled = {"temperature": 1.0, "seed": 3}
    free_job = GenerationJob(prompts[2], GREEDY, num_predict=12)

    def constrained(index, fmt):
        return GenerationJob(prompts[index], sampled, num_predict=40,
                             constraint=build_constraint(fmt, text_model.tokenizer))

    generator = new_generator(text_model, max_batch=3)
    handles = [generator.submit(constrained(0, "json")), generator.submit(constrained(1, schema)),
               generator.submit(free_job)]
    reports = []
    generator.step_observers.append(reports.append)
    generator.run_until_done()
    assert max(r.jobs for r in reports) == 3  # the three ran in the same forward passes
    texts = [handle.text() for handle in handles]
    assert isinstance(json.loads(texts[0]), dict)
    value = json.loads(texts[1])
    assert isinstance(value["n"], int) and isinstance(value["ok"], bool)
    # Each constrained job gives exactly what it gives alone with the same constraint;
    # the unconstrained job in the batch is not affected.
    for index, fmt in ((0, "json"), (1, schema)):
        tokens, final = run_alone(text_model, constrained(index, fmt))
        assert tokens == handles[index].token_ids
        assert final.done_reason == handles[index].final.done_reason
        assert final.eval_count == handles[index].final.eval_count
    assert handles[2].token_ids == run_alone(text_model, free_job)[0]
    assert generator.pool.pages_in_use == 0
