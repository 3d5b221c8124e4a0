"""Draft models draft for all jobs in one batch per position, and drafting backs off by
itself when its drafts are rejected; the greedy text never changes."""

from __future__ import annotations

import random

import pytest
from exl3_plugins.drafters import ModelDrafter

from exl3cli.engine.generation.draft_policy import DraftBackoff
from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.models.loader import load_causal_lm
from tests.fixtures.drafters import PeekingDrafter
from tests.fixtures.tiny_model import write_tiny_model

GREEDY = {"temperature": 0}
MS = 1_000_000


class CountingModel:
    """A draft model whose forward passes are counted (rows fed per pass too)."""

    def __init__(self, model):
        self.inner, self.calls, self.rows = model, 0, []
        self.config, self.layers = model.config, model.layers
        self.dtype, self.device = model.dtype, model.device

    def __getattr__(self, name):  # what fixed-shape draft steps use (decode_step.py)
        return getattr(self.inner, name)

    def forward(self, ids, cache=None, **kwargs):
        if not hasattr(cache, "tables"):  # a fixed-shape step's forward: not counted
            return self.inner.forward(ids, cache, **kwargs)
        self.calls += 1
        self.rows.append(len(cache.tables))
        return self.inner.forward(ids, cache, **kwargs)


@pytest.fixture(scope="module")
def draft_models(tmp_path_factory):
    """The target's own weights (drafts it agrees with) and another random model of the
    same shape (drafts it mostly rejects)."""
    root = tmp_path_factory.mktemp("drafts")
    same = write_tiny_model(root / "same", "llama", vocab_size=400,
                            max_position_embeddings=1280)
    other = write_tiny_model(root / "other", "llama", seed=7, vocab_size=400,
                             max_position_embeddings=1280)
    return {"same": load_causal_lm(same, device="cpu"), "other": load_causal_lm(other, device="cpu")}


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(rng.randrange(5, 60))] for _ in range(count)]


def _run(text_model, prompts, lengths, draft_model=None, k=3, max_batch=16):
    generator = Generator(text_model.model, text_model.tokenizer, max_batch=max_batch,
                          num_ctx=512, draft_cost=False)  # acceptance only: no timing
    handles = [generator.submit(GenerationJob(
        p, GREEDY, num_predict=n, drafter=ModelDrafter(draft_model) if draft_model else None,
        draft_tokens=k if draft_model else 0)) for p, n in zip(prompts, lengths, strict=True)]
    steps = []
    while generator.has_work:
        before = draft_model.calls if draft_model else 0
        report = generator.step()
        steps.append((report, (draft_model.calls if draft_model else 0) - before))
    assert generator.pool.pages_in_use == 0
    return handles, steps


def test_a_draft_model_drafts_all_jobs_in_one_pass_per_position(text_model, draft_models):
    prompts = _prompts(16, seed=1)
    lengths = [random.Random(i).randrange(8, 40) for i in range(16)]
    plain, _ = _run(text_model, prompts, lengths)
    counting = CountingModel(draft_models["same"])
    drafted, steps = _run(text_model, prompts, lengths, counting, k=3)
    assert [h.token_ids for h in drafted] == [h.token_ids for h in plain]
    kept = sum(h.final.draft_accepted for h in drafted)
    assert kept >= 0.9 * sum(h.final.draft_count for h in drafted) > 0
    # At most k draft passes per generator step, whatever the number of drafting jobs,
    # and some of those passes drafted for many jobs at once.
    assert max(calls for _, calls in steps) <= 3
    assert max(counting.rows) >= 8
    drafting_steps = [r for r, calls in steps if calls]
    assert sum(calls for _, calls in steps) <= 3 * len(drafting_steps)
    assert max(r.draft_tokens for r in drafting_steps) >= 8 * 3 // 2


def test_one_job_alone_drafts_the_same_as_in_a_batch(text_model, draft_models):
    prompts = _prompts(4, seed=2)
    counting = CountingModel(draft_models["same"])
    together, _ = _run(text_model, prompts, [30] * 4, counting, k=4)
    for prompt, handle in zip(prompts, together, strict=True):
        (alone,), _ = _run(text_model, [prompt], [30], CountingModel(draft_models["same"]),
                           k=4, max_batch=1)
        assert alone.token_ids == handle.token_ids
        assert alone.final.draft_accepted == handle.final.draft_accepted
        # the job's page table left the shared draft cache when it ended
        assert alone.job.drafter.table is None


def test_drafting_backs_off_when_drafts_are_rejected(text_model, draft_models):
    prompts = _prompts(4, seed=3)
    plain, plain_steps = _run(text_model, prompts, [60] * 4)
    drafted, steps = _run(text_model, prompts, [60] * 4, CountingModel(draft_models["other"]),
                          k=4)
    assert [h.token_ids for h in drafted] == [h.token_ids for h in plain]
    drafts = sum(h.final.draft_count for h in drafted)
    kept = sum(h.final.draft_accepted for h in drafted)
    assert kept < 0.25 * drafts  # a model of other weights: its drafts are mostly wrong
    # Without back-off every decode step would draft 4 tokens per job; with it, most
    # steps draft nothing after the first rejections.
    decode_steps = sum(1 for r, _ in steps if r.decode_tokens)
    assert drafts < 0.4 * 4 * sum(r.decode_tokens for r, _ in steps)
    assert sum(1 for r, _ in steps if r.decode_tokens and not r.draft_tokens) > decode_steps / 2


def test_backoff_pauses_double_and_a_good_probe_ends_them():
    backoff = DraftBackoff(min_rate=0.25, first_pause=4, max_pause=16)
    assert backoff.may_draft(0)
    backoff.record(4, 0, produced=1)  # rate 0.5: still drafting
    assert backoff.may_draft(1) and backoff.pauses == 0
    backoff.record(4, 0, produced=2)  # rate 0.25: on the threshold, still drafting
    backoff.record(4, 0, produced=3)  # 0.125: pause 4 tokens
    assert backoff.pauses == 1 and not backoff.may_draft(6) and backoff.may_draft(7)
    backoff.record(4, 0, produced=8)  # the probe fails: pause 8
    assert backoff.paused_until == 16 and not backoff.may_draft(15)
    backoff.record(4, 0, produced=17)
    backoff.record(4, 0, produced=34)  # capped at 16
    assert backoff.paused_until == 50
    backoff.record(4, 3, produced=54)  # a good probe: drafting resumes at once
    assert backoff.pause == 0 and backoff.may_draft(55)
    assert backoff.paused_tokens == 2


def test_backed_off_jobs_run_ahead_on_the_fixed_shape_path(text_model, draft_models):
    """While a job's drafting is paused its steps are plain decode steps: they take the
    fixed-shape runner and launch ahead (a step in flight), and the text is unchanged."""
    prompts = _prompts(3, seed=4)
    plain, _ = _run(text_model, prompts, [80] * 3)
    generator = Generator(text_model.model, text_model.tokenizer, max_batch=4, num_ctx=512,
                          decode_mode="static", draft_cost=False)
    handles = [generator.submit(GenerationJob(
        p, GREEDY, num_predict=80, drafter=ModelDrafter(draft_models["other"]), draft_tokens=4))
        for p in prompts]
    in_flight = 0
    while generator.has_work or generator._flight is not None:
        generator.step()
        in_flight += generator._flight is not None
    assert [h.token_ids for h in handles] == [h.token_ids for h in plain]
    assert in_flight > 0
    assert sum(h.final.draft_count for h in handles) > 0  # it did draft, then paused


def _run_static(text_model, prompts, drafters, tokens, generators=None):
    generator = Generator(text_model.model, text_model.tokenizer, max_batch=4, num_ctx=512,
                          decode_mode="static", draft_cost=False)
    if generators is not None:
        generators.append(generator)
    handles = [generator.submit(GenerationJob(p, GREEDY, num_predict=tokens, drafter=d,
                                              draft_tokens=4 if d else 0, ignore_eos=True))
               for p, d in zip(prompts, drafters, strict=True)]
    steps = in_flight = 0
    while generator.has_work or generator._flight is not None:
        generator.step()
        steps += 1
        in_flight += generator._flight is not None
    return handles, steps, in_flight


def test_a_drafter_that_peeks_nothing_lets_its_job_run_ahead(text_model):
    """A host-side drafter with nothing to propose (n-gram on text that does not
    repeat) kept its job off the run-ahead path at every step (run 56 on the H200:
    n-gram 0.95x at 16 jobs on free text). With `peek` the steps run ahead as plain
    decoding's do; where the peek finds a draft the job drafts at the next step, and
    the text is plain greedy's either way."""
    prompts = _prompts(2, seed=9)
    plain, steps, in_flight = _run_static(text_model, prompts, [None, None], 80)
    answers = [h.token_ids for h in plain]
    assert all(len(a) == 80 for a in answers) and in_flight >= steps - 3
    dry = [PeekingDrafter(p, a) for p, a in zip(prompts, answers, strict=True)]
    handles, steps, in_flight = _run_static(text_model, prompts, dry, 80)
    assert [h.token_ids for h in handles] == answers
    assert in_flight >= steps - 3  # without peek: 0 (every step waited for the lookup)
    assert all(d.proposals <= 3 and d.peeks >= 70 for d in dry)
    # Drafts from position 30 to 52: found (by a peek, one step late at worst), drafted.
    wet = [PeekingDrafter(p, a, hits=range(30, 52)) for p, a in zip(prompts, answers,
                                                                     strict=True)]
    handles, steps, in_flight = _run_static(text_model, prompts, wet, 80)
    assert [h.token_ids for h in handles] == answers
    kept = [h.final.draft_accepted for h in handles]
    assert all(k >= 16 for k in kept), kept
    assert steps < 80 - 10 and in_flight >= 40


class FalseAlarmDrafter(PeekingDrafter):
    """Its peek finds something on every text of an even length and nothing on an odd
    one (n-gram on free text: the last two tokens were seen before, yet the token in
    flight does not go on as they did); its proposals are always empty."""

    def _lookup(self, history, count):
        return []

    def peek(self, history, count):
        self.peeks += 1
        return [self.answer[0]] if len(history) % 2 == 0 else []


def test_a_peek_that_the_token_in_flight_refutes_still_runs_ahead(text_model):
    """A peek that finds something made the next step synchronous; when the drafter
    then found nothing with the token in flight (run 58: 6 of 59 passes at 16 jobs on
    free text, each a host round trip for every job), that pass was lost. Now the step
    waits for the token in flight only, asks the drafter again with it and launches
    when it finds nothing: every step still runs in flight, the text is plain greedy's."""
    prompts = _prompts(2, seed=9)
    plain, _, _ = _run_static(text_model, prompts, [None, None], 80)
    answers = [h.token_ids for h in plain]
    alarms = [FalseAlarmDrafter(p, a) for p, a in zip(prompts, answers, strict=True)]
    generator_steps = []
    handles, steps, in_flight = _run_static(text_model, prompts, alarms, 80,
                                            generators=generator_steps)
    assert [h.token_ids for h in handles] == answers
    assert in_flight >= steps - 3  # before: 1 of 80 (each waited for the host)
    assert generator_steps[0].launched_late >= 30
    assert all(d.proposals <= 3 for d in alarms)


def test_draft_steps_propose_what_the_general_path_proposes(text_model, tmp_path, monkeypatch):
    """One-token draft forwards as the draft model's own fixed-shape steps (static mode
    on the CPU: what a CUDA graph replays) against the general path (EXL3_DRAFT_STEPS=0),
    several jobs drafting together over many positions, accepting part of each draft;
    and the generator's text with them is plain greedy's."""
    folder = write_tiny_model(tmp_path / "draft", "llama", vocab_size=400,
                              max_position_embeddings=1280)
    monkeypatch.setenv("EXL3_DECODE_MODE", "static")
    monkeypatch.setenv("EXL3_DRAFT_STEPS", "1")
    stepped_model = load_causal_lm(folder, device="cpu")
    stepped = [ModelDrafter(stepped_model) for _ in range(3)]
    monkeypatch.setenv("EXL3_DRAFT_STEPS", "0")
    plain_model = load_causal_lm(folder, device="cpu")
    plain = [ModelDrafter(plain_model) for _ in range(3)]
    histories = _prompts(3, seed=5)
    rng = random.Random(5)
    for _ in range(6):
        counts = [rng.randrange(1, 5) for _ in histories]
        want = plain[0].propose_batch(plain, histories, counts)
        got = stepped[0].propose_batch(stepped, histories, counts)
        assert got == want
        # keep part of each draft, then a token of "the target's" own
        histories = [h + d[: rng.randrange(len(d) + 1)] + [rng.randrange(3, 400)]
                     for h, d in zip(histories, got, strict=True)]
    runner = stepped[0].cache.runner
    assert runner is not None and runner.mode == "static" and runner._steps
    assert plain[0].cache.runner is None

    prompts = _prompts(4, seed=6)
    want, _ = _run(text_model, prompts, [24] * 4)
    monkeypatch.setenv("EXL3_DRAFT_STEPS", "1")
    counting = CountingModel(stepped_model)
    got, _ = _run(text_model, prompts, [24] * 4, counting, k=3)
    assert [h.token_ids for h in got] == [h.token_ids for h in want]
    assert sum(h.final.draft_accepted for h in got) > 0
    drafter = got[0].job.drafter
    assert drafter.cache.runner is not None and drafter.cache.runner._steps
    assert counting.calls < sum(h.final.draft_count for h in got)  # most ran as steps


def test_a_draft_step_that_captured_a_graph_is_not_timed(tmp_path, monkeypatch):
    """The first replay of a bucket captures its graph (decode_step.py): that forward's
    time is not a draft forward's cost; a scratch timing (time_forward) runs again and
    times the replay. Captures stood in for on the CPU (static steps)."""
    import types

    from exl3cli.engine.generation import draft_gate

    folder = write_tiny_model(tmp_path / "draft", "llama", vocab_size=400,
                              max_position_embeddings=1280)
    monkeypatch.setenv("EXL3_DECODE_MODE", "static")
    monkeypatch.setenv("EXL3_DRAFT_STEPS", "1")
    drafter = ModelDrafter(load_causal_lm(folder, device="cpu"))
    drafter.time_forward(2)  # makes the draft model's step runner
    runner = drafter.cache.runner
    assert runner is not None and runner.mode == "static"
    clock = types.SimpleNamespace(now=0)
    monkeypatch.setattr(draft_gate, "time", types.SimpleNamespace(perf_counter_ns=lambda: clock.now))
    real, calls = runner.run, []

    def run(rows, *args):
        calls.append(len(rows))
        if len(calls) == 1:
            runner.captures += 1  # as a capture would
            clock.now += 50 * MS
        else:
            clock.now += MS
        return real(rows, *args)

    monkeypatch.setattr(runner, "run", run)
    cost = drafter.cache.forward_cost = draft_gate.DraftForwardCost()
    drafter.time_forward(1)
    assert calls == [1, 1] and cost.forward_ns(1) == MS
    assert cost.take_catch_up() == 51 * MS  # both scratch: left out of the step's charge
