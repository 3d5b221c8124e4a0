"""LoRA adapters through the batched generator: each job its own adapter or none."""

from __future__ import annotations

import pytest

from exl3cli.engine.adapters.lora import AdapterBank
from exl3cli.engine.adapters.peft import read_peft_adapter
from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.generation.textmodel import TextModel
from exl3cli.errors import InvalidOption
from tests.engine.test_lora import make_adapter
from tests.fixtures.beside import count_beside_steps
from tests.fixtures.tiny_model import tiny_reference_model, write_tiny_model
from tests.fixtures.tiny_tokenizer import write_tiny_tokenizer

GREEDY = {"temperature": 0}
SETTINGS = {"vocab_size": 400, "max_position_embeddings": 1280}


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """The tiny Llama with adapters "a" (all projections) and "b" (rank 8 on q and
    down) loaded, each strong enough to change greedy text."""
    root = tmp_path_factory.mktemp("lora-generator")
    folder = write_tiny_model(root / "model", "llama", **SETTINGS)
    write_tiny_tokenizer(folder)
    reference = tiny_reference_model("llama", **SETTINGS)
    text_model = TextModel.load(folder, device="cpu")
    bank = AdapterBank.of(text_model.model)
    bank.load(read_peft_adapter(make_adapter(reference, root / "a", seed=1), "a"))
    bank.load(read_peft_adapter(make_adapter(reference, root / "b", seed=2, rank=8,
                                             targets=["q_proj", "down_proj"]), "b"))
    return text_model


def _run(text_model, jobs: list[GenerationJob], max_batch: int) -> list[list[int]]:
    generator = Generator(text_model.model, text_model.tokenizer, max_batch=max_batch,
                          num_ctx=1280)
    handles = [generator.submit(job) for job in jobs]
    generator.run_until_done()
    assert generator.pool.pages_in_use == 0
    return [handle.token_ids for handle in handles]


def test_two_adapters_and_the_base_in_one_batch_match_their_solo_runs(adapted):
    prompt = list(range(5, 300))  # longer than a page: the prefix cache is in play
    jobs = [GenerationJob(prompt, GREEDY, num_predict=12, ignore_eos=True, adapter=name)
            for name in ("a", None, "b")]
    solo = [_run(adapted, [job], max_batch=1)[0] for job in jobs]
    assert len({tuple(tokens) for tokens in solo}) == 3  # the adapters change the text
    together = _run(adapted, jobs, max_batch=3)
    assert together == solo


def test_pages_cached_under_one_adapter_do_not_serve_another(adapted):
    prompt = [7 + i % 390 for i in range(600)]
    generator = Generator(adapted.model, adapted.tokenizer, max_batch=2, num_ctx=1280)
    first = generator.submit(GenerationJob(prompt, GREEDY, num_predict=4, adapter="a"))
    generator.run_until_done()
    again = generator.submit(GenerationJob(prompt, GREEDY, num_predict=4, adapter="a"))
    other = generator.submit(GenerationJob(prompt, GREEDY, num_predict=4, adapter="b"))
    generator.run_until_done()
    assert again.final.prompt_cache_count > 0 and other.final.prompt_cache_count == 0
    assert again.token_ids == first.token_ids


def test_an_unknown_adapter_fails_its_job_alone(adapted):
    generator = Generator(adapted.model, adapted.tokenizer, max_batch=2, num_ctx=1280)
    with pytest.raises(InvalidOption, match="adapter 'nope' is not loaded"):
        generator.submit(GenerationJob([5, 6, 7], GREEDY, num_predict=2, adapter="nope"))
    assert not generator.has_work
    assert generator.adapters_in_use() == set()
    handle = generator.submit(GenerationJob([5, 6, 7], GREEDY, num_predict=2, adapter="b"))
    assert generator.adapters_in_use() == {"b"}
    generator.run_until_done()
    assert len(handle.token_ids) == 2


def test_fixed_shape_decode_steps_route_adapters(adapted, monkeypatch):
    """The decode runner's static mode (what a CUDA graph replays) pads the batch to a
    bucket: padding rows run without an adapter and real rows keep theirs."""
    monkeypatch.setenv("EXL3_DECODE_MODE", "static")
    prompt = [9, 10, 11, 12]
    jobs = [GenerationJob(prompt, GREEDY, num_predict=6, ignore_eos=True, adapter=name)
            for name in ("b", None, "a")]
    monkeypatch.setenv("EXL3_DECODE_MODE", "off")
    solo = [_run(adapted, [job], max_batch=1)[0] for job in jobs]
    monkeypatch.setenv("EXL3_DECODE_MODE", "static")
    assert _run(adapted, jobs, max_batch=4) == solo


def test_a_prompt_beside_adapted_decode_rows_keeps_each_rows_adapter(adapted, monkeypatch):
    """A job joining while adapted jobs decode takes its prompt in on their fixed-shape
    step (step_forward.prompt_beside): each of the step's rows, the prompt's too, keeps
    its own adapter."""

    prompts = [[9, 10, 11, 12], [20, 21, 22, 23, 24, 25], [30, 31, 32, 33, 34]]
    names, budgets = ["b", None, "a"], [4, 20, 12]

    def jobs():
        return [GenerationJob(p, GREEDY, num_predict=n, ignore_eos=True, adapter=a)
                for p, a, n in zip(prompts, names, budgets, strict=True)]

    monkeypatch.setenv("EXL3_DECODE_MODE", "off")
    solo = [_run(adapted, [job], max_batch=1)[0] for job in jobs()]
    beside = count_beside_steps(monkeypatch)
    monkeypatch.setenv("EXL3_DECODE_MODE", "static")
    assert _run(adapted, jobs(), max_batch=2) == solo  # the third joins beside the second
    assert beside["steps"] == 1
