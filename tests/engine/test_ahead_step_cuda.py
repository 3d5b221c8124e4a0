"""Decode steps launched ahead on the GPU (`-m cuda`): graph replays fed with the device
tokens of the step before, pinned read-backs, against the same generator with
EXL3_ASYNC_STEP off (every step read back before the next one), on synthetic EXL3
models. The same graphs on the same inputs: the tokens must be the same bit for bit."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from exl3cli.convert.synthetic import write_synthetic_model
from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.text.tokenizer import Tokenizer

pytestmark = pytest.mark.cuda
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_model(tmp_path_factory.mktemp("smol"), "smollm2-135m", bits=4.0,
                                 num_layers=2, seed=5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # float32 on this shape: the graph step and the general path agree to the token
    # (test_generator_cuda.py), so steps that move from one to the other keep the tokens.
    return write_synthetic_model(tmp_path_factory.mktemp("tiny"), "tiny", bits=4.0, seed=3)


def _run(model, tokenizer, jobs, async_step, seed=None, late=2):
    if seed is not None:
        torch.manual_seed(seed)
    generator = Generator(model, tokenizer, decode_mode="graph", num_ctx=1024, max_batch=4,
                          async_step=async_step)
    assert generator.decode.mode == "graph"
    first = jobs[: len(jobs) - late]
    handles = [generator.submit(job) for job in first]
    for _ in range(4):
        generator.step()
    # Joining mid-way: while a step is in flight, a job joins one step later than it
    # would without launching ahead, so those steps run on the other path (graph or
    # general): the same tokens in float32, not always in bfloat16 (near-ties).
    handles += [generator.submit(job) for job in jobs[len(first):]]
    generator.run_until_done()
    while generator._flight is not None:
        generator.step()
    assert generator.pool.pages_in_use == 0
    return [(h.token_ids, h.text(), h.final.done_reason, h.final.eval_count)
            for h in handles], generator


def _prompts(vocab: int, seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab // 2) for _ in range(rng.choice([3, 40, 255, 300]))]
            for _ in range(count)]


def test_graph_steps_launched_ahead_give_the_synchronous_tokens(tiny):
    # float32: a job joining or leaving while a step is in flight changes which path
    # or bucket computes the other jobs' next step, with the same tokens in float32.
    model = load_causal_lm(tiny, device="cuda", dtype=torch.float32)
    tokenizer = Tokenizer.from_folder(tiny)
    prompts = _prompts(model.config.vocab_size, 7, 5)
    plain, _ = _run(model, tokenizer, [GenerationJob(p, GREEDY, num_predict=30,
                                                     ignore_eos=True) for p in prompts], False)
    text = plain[0][1]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    jobs = [GenerationJob(p, GREEDY, num_predict=n, ignore_eos=True, stop=[stop] if i == 0
                          else []) for i, (p, n) in enumerate(zip(prompts, [30, 12, 41, 30, 9],
                                                                  strict=True))]
    want, _ = _run(model, tokenizer, jobs, False)
    got, ahead = _run(model, tokenizer, jobs, True)
    assert got == want
    assert ahead.launched_ahead > 0
    assert want[0][2] == "stop" and want[0][3] < 30  # the stop string ended job 0 mid-batch
    assert [w[3] for w in want[1:]] == [12, 41, 30, 9]


def test_bfloat16_graph_steps_launched_ahead_are_the_same_bits(folder):
    # The same jobs throughout (nobody joins or leaves early): the same graphs replay the
    # same inputs both ways, so even bfloat16 near-ties fall the same way.
    model = load_causal_lm(folder, device="cuda", dtype=torch.bfloat16)
    tokenizer = Tokenizer.from_folder(folder)
    jobs = [GenerationJob(p, GREEDY, num_predict=40, ignore_eos=True)
            for p in _prompts(model.config.vocab_size, 9, 4)]
    want, _ = _run(model, tokenizer, jobs, False, late=0)
    got, ahead = _run(model, tokenizer, jobs, True, late=0)
    assert got == want
    assert ahead.launched_ahead > 30


def test_unseeded_sampling_from_one_seed_launched_ahead(tiny):
    model = load_causal_lm(tiny, device="cuda", dtype=torch.float32)
    tokenizer = Tokenizer.from_folder(tiny)
    options = {"temperature": 0.9, "top_k": 50, "top_p": 0.9}
    jobs = [GenerationJob(p, options, num_predict=20, ignore_eos=True)
            for p in _prompts(model.config.vocab_size, 8, 3)]
    # No job joins or leaves early: both ways draw once per step over the same rows.
    want, _ = _run(model, tokenizer, jobs, False, seed=3, late=0)
    got, ahead = _run(model, tokenizer, jobs, True, seed=3, late=0)
    assert got == want
    assert ahead.launched_ahead > 0


def test_the_argmax_inside_the_graph_gives_the_same_tokens(folder, monkeypatch):
    model = load_causal_lm(folder, device="cuda", dtype=torch.bfloat16)
    tokenizer = Tokenizer.from_folder(folder)
    jobs = [GenerationJob(p, GREEDY, num_predict=40, ignore_eos=True)
            for p in _prompts(model.config.vocab_size, 10, 4)]
    want, _ = _run(model, tokenizer, jobs, True, late=0)
    monkeypatch.setenv("EXL3_STEP_ARGMAX", "1")
    got, folded = _run(model, tokenizer, jobs, True, late=0)
    assert got == want
    assert folded.decode.step_argmax and folded.decode.greedy is not None
    assert folded.launched_ahead > 30


@pytest.mark.parametrize("options", [GREEDY, {"temperature": 0.8, "top_k": 40, "top_p": 0.9},
                                     {"temperature": 0.7}])
def test_launching_a_step_never_waits_for_the_device(folder, options):
    """The launch path (fixed-shape step, on-device sampling, the read-back's start) makes
    no synchronising call: a stream sync there would wait for the step launched ahead.
    torch's sync debug mode raises on one (blocking copies, .item(), multinomial's checks)."""
    model = load_causal_lm(folder, device="cuda", dtype=torch.bfloat16)
    tokenizer = Tokenizer.from_folder(folder)
    generator = Generator(model, tokenizer, decode_mode="graph", num_ctx=1024, max_batch=4)
    prompts = _prompts(model.config.vocab_size, 11, 3)
    mixed = [options, GREEDY, options]  # greedy rows next to drawn ones

    def submit_all():
        for prompt, opts in zip(prompts, mixed, strict=True):
            generator.submit(GenerationJob(prompt, opts, num_predict=24, ignore_eos=True))

    submit_all()
    generator.run_until_done()  # graphs of these buckets captured (a capture syncs)
    captures = generator.decode.captures
    run, launch = generator.decode.run, generator._launch

    def strict(fn):
        def call(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return call

    generator.decode.run, generator._launch = strict(run), strict(launch)
    ahead = generator.launched_ahead
    submit_all()
    generator.run_until_done()
    assert generator.decode.captures == captures
    assert generator.launched_ahead - ahead > 10


def test_draw_rows_is_torch_multinomial_on_the_gpu():
    from exl3cli.engine.generation.batch_sampling import draw_rows

    for shape in [(1, 40), (3, 4000), (2, 128256)]:
        probs = torch.softmax(3 * torch.randn(*shape, device="cuda"), dim=-1)
        torch.manual_seed(7)
        want = torch.multinomial(probs, 1)[:, 0]
        torch.manual_seed(7)
        assert torch.equal(draw_rows(probs), want)


def test_passes_with_drafts_launched_before_their_text_work(tiny, monkeypatch):
    """verify_ahead.py on graph steps: the same tokens as with EXL3_VERIFY_AHEAD=0, and
    launching the pass after a read-back one (its drafts' graph step, the picks drawn
    on the device, the read-back's start) makes no synchronising call."""
    from tests.fixtures.drafters import OracleDrafter

    model = load_causal_lm(tiny, device="cuda", dtype=torch.float32)
    tokenizer = Tokenizer.from_folder(tiny)
    prompts = _prompts(model.config.vocab_size, 12, 4)
    plain, _ = _run(model, tokenizer, [GenerationJob(p, GREEDY, num_predict=40,
                                                     ignore_eos=True) for p in prompts],
                    False, late=0)

    def run(ahead: bool, strict: bool = False):
        """Two rounds on one generator: the first captures the graphs, the second (where
        `strict`) launches with sync checks on. The second round's batches differ from the
        first's (the 300-token prompts' first pages are cached by then), so its tokens are
        compared with the other setting's second round, not with `plain`."""
        monkeypatch.setenv("EXL3_VERIFY_AHEAD", "1" if ahead else "0")
        generator = Generator(model, tokenizer, decode_mode="graph", num_ctx=1024, max_batch=4)
        launch_next = generator._launch_next

        def checked():
            torch.cuda.set_sync_debug_mode("error")
            try:
                return launch_next()
            finally:
                torch.cuda.set_sync_debug_mode("default")

        rounds = []
        for round_ in range(2):
            if round_ and strict:
                generator._launch_next = checked
            handles = [generator.submit(GenerationJob(
                p, GREEDY, num_predict=40, ignore_eos=True, draft_tokens=3,
                drafter=OracleDrafter(p, answer[0]))) for p, answer in zip(prompts, plain,
                                                                          strict=True)]
            generator.run_until_done()
            rounds.append([h.token_ids for h in handles])
        return rounds, generator

    want, _ = run(False)
    got, ahead = run(True, strict=True)
    assert got[0] == want[0] == [answer[0] for answer in plain]
    assert got[1] == want[1]
    assert ahead.launched_before_text > 5
