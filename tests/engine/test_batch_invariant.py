"""The batch-invariant mode (ops/batch_invariant.py, engine/generation/invariant.py) on
the CPU: the switch, the GEMM split choice it pins, the 64-row dense product, a row's
logits alone and beside 1..63 other rows of a fixed-shape step (bit-identical; without
the mode the CPU matmul past 8 rows differs), and the generator's scheduling: every
step on the fixed-shape step, prompt chunks beside decode rows, and concurrent greedy
jobs giving exactly each job's solo tokens."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from exl3cli.engine.generation import invariant
from exl3cli.engine.kvcache.paged_attention import PagedBatch
from exl3cli.ops import batch_invariant as mode
from exl3cli.ops import cuda_kernels as kernels
from tests.fixtures.invariance import probe_logits, solo_and_together


@pytest.fixture
def invariant_on():
    mode.set_batch_invariant(True)
    yield
    mode.set_batch_invariant(None)


@pytest.fixture
def invariant_off():
    mode.set_batch_invariant(False)
    yield
    mode.set_batch_invariant(None)


def test_the_switch_reads_the_environment_and_refuses_bad_values(monkeypatch):
    monkeypatch.setenv("EXL3_BATCH_INVARIANT", "1")
    assert mode.batch_invariant()
    monkeypatch.setenv("EXL3_BATCH_INVARIANT", "off")
    assert not mode.batch_invariant()
    mode.set_batch_invariant(True)
    try:
        assert mode.batch_invariant()  # the override wins over the environment
    finally:
        mode.set_batch_invariant(None)
    monkeypatch.setenv("EXL3_BATCH_INVARIANT", "maybe")
    with pytest.raises(ValueError, match="EXL3_BATCH_INVARIANT"):
        mode.batch_invariant()


def test_splits_ignore_the_row_count_only_in_the_mode(monkeypatch):
    device = torch.device("cuda", 0)
    monkeypatch.setitem(kernels._SMS, device, 132)  # an H200's SMs, no GPU needed
    monkeypatch.delenv("EXL3_GEMM_WARPS_PER_SM", raising=False)
    shapes = [(256, 1792), (896, 256), (256, 384), (36, 24), (36, 3072)]  # 8B, SmolLM2
    try:
        mode.set_batch_invariant(False)
        plain = {s: [kernels.choose_splits(*s, device, rows=r) for r in range(1, 65)]
                 for s in shapes}
        mode.set_batch_invariant(True)
        pinned = {s: [kernels.choose_splits(*s, device, rows=r) for r in range(1, 65)]
                  for s in shapes}
    finally:
        mode.set_batch_invariant(None)
    assert any(len(set(counts)) > 1 for counts in plain.values())  # the cause
    for shape, counts in pinned.items():
        assert counts == [plain[shape][-1]] * 64  # the 9-64-row choice at every count


def test_padded_linear_is_linear_and_row_invariant():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 96, generator=gen)
    bias = torch.randn(300, generator=gen)
    x = torch.randn(150, 96, generator=gen)
    out = mode.padded_linear(x, weight, bias)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    alone = mode.padded_linear(x[7:8], weight, bias)
    for rows in (2, 9, 16, 33, 64, 65, 150):
        batch = torch.cat([x[rows % 5 : rows % 5 + rows - 1], x[7:8]])
        assert torch.equal(mode.padded_linear(batch, weight, bias)[-1:], alone), rows
    assert mode.padded_linear(x[:0], weight, bias).shape == (0, 300)


def test_row_blocks_keep_the_rows_trailing_dims():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(3, 16, generator=gen)  # per-head norm weights [heads, head_dim]

    def norm(rows):
        return F.rms_norm(rows, (16,), None, 1e-6) * weight

    for shape in [(1, 5, 3, 16), (2, 70, 3, 16), (130, 3, 16)]:
        x = torch.randn(*shape, generator=gen)
        torch.testing.assert_close(mode.row_blocks(norm, x, keep=2), norm(x))


@pytest.mark.parametrize("probe_last", [False, True])
def test_a_rows_logits_are_the_same_alone_and_in_batches(text_model, invariant_on,
                                                         probe_last):
    model = text_model.model
    probe = [5, 17, 33, 2, 99, 250]
    alone = probe_logits(model, probe, len(probe), seed=0)
    for rows in (len(probe) + 1, 9, 16, 33, 64):
        got = probe_logits(model, probe, rows, seed=rows, probe_last=probe_last,
                           history=300 if rows == 33 else 0)
        assert torch.equal(got, alone), rows


def test_without_the_mode_rows_past_eight_differ_on_the_cpu(text_model, invariant_off):
    # What the mode fixes here (the test above can fail): past GEMV_MAX_ROWS the CPU
    # linear is one matmul whose blocking follows the row count.
    model = text_model.model
    probe = [5, 17, 33, 2, 99, 250]
    alone = probe_logits(model, probe, len(probe), seed=0)
    assert not all(torch.equal(probe_logits(model, probe, rows, seed=rows), alone)
                   for rows in (16, 33, 64))


def test_prompt_room_leaves_half_the_rows_to_waiting_prompts():
    class Job:
        def __init__(self):
            self.trimmed = None

        def trim_draft(self, count):
            self.trimmed = count

    fed = [(Job(), [1] + [2] * 9) for _ in range(6)]  # 6 decoders with 9 drafts: 60 rows
    assert invariant.prompt_room(fed, False, 64, 512) == 4
    assert sum(len(t) for _, t in fed) == 60  # no prompt waiting: drafts kept
    assert invariant.prompt_room(fed, True, 64, 512) == 32
    assert sum(len(t) for _, t in fed) == 32 and all(len(t) >= 1 for _, t in fed)
    assert invariant.prompt_room(fed, True, 64, 20) == 20  # max_prefill_tokens caps it
    assert invariant.prompt_room([], True, 64, 512) == 64


def test_the_mode_needs_and_picks_the_fixed_step_on_the_cpu(monkeypatch):
    monkeypatch.delenv("EXL3_DECODE_MODE", raising=False)
    cpu = torch.device("cpu")
    assert invariant.decode_mode(None, cpu, True) == "static"
    assert invariant.decode_mode(None, cpu, False) is None
    assert invariant.decode_mode("off", cpu, True) == "off"  # named: kept (not invariant)
    assert invariant.decode_mode(None, torch.device("cuda", 0), True) is None  # graphs


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 400) for _ in range(40)]
    long = [rng.randrange(3, 400) for _ in range(300)]  # a page and more: a prefix hit
    others = [[rng.randrange(3, 400) for _ in range(rng.randrange(2, 90))] for _ in range(5)]
    return [shared, shared, long, *others[:2], long, shared, *others[2:]]


def test_concurrent_greedy_jobs_give_each_jobs_solo_tokens(text_model, invariant_on):
    model = text_model.model
    forward = model.forward
    general = []

    def counted(ids, cache=None, **kwargs):
        general.append(isinstance(cache, PagedBatch))
        return forward(ids, cache, **kwargs)

    model.forward = counted
    try:
        solo, together, generator = solo_and_together(
            model, text_model.tokenizer, _prompts(3), 24, max_batch=8,
            kv_cache_type="fp16")
    finally:
        del model.forward
    assert generator.batch_invariant and generator.decode.mode == "static"
    assert together == solo
    # A prompt's logits are its chunk's last row: the general path agrees (float32, no
    # near-ties in this model), so the mode computes the same text, not just its own.
    mode.set_batch_invariant(False)
    general_solo, _, _ = solo_and_together(model, text_model.tokenizer, _prompts(3)[:4], 24,
                                           max_batch=8, kv_cache_type="fp16",
                                           decode_mode="off")
    assert general_solo == solo[:4]
    assert general and not any(general)  # every step on the fixed-shape step
    assert generator.pool.pages_in_use == 0


def test_the_mode_runs_at_most_64_jobs_at_once():
    assert invariant.max_jobs(128, True) == 64
    assert invariant.max_jobs(16, True) == 16
    assert invariant.max_jobs(128, False) == 128


def test_the_mode_refuses_what_it_does_not_cover(text_model, invariant_on, tmp_path):
    # Jobs with an adapter or image ids, and mixture-of-experts models: a clear error
    # where they are given, not a run that quietly breaks the mode's promise.
    from exl3cli.engine.generation.generator import Generator
    from exl3cli.engine.generation.jobs import GenerationJob
    from exl3cli.engine.generation.textmodel import TextModel
    from exl3cli.errors import InvalidOption
    from tests.fixtures.tiny_model import write_tiny_model
    from tests.fixtures.tiny_tokenizer import write_tiny_tokenizer

    generator = Generator(text_model.model, text_model.tokenizer, max_batch=4)
    with pytest.raises(InvalidOption, match="does not cover LoRA adapters"):
        generator.submit(GenerationJob(prompt_ids=[5, 6, 7], adapter="mine"))
    vocab = text_model.model.config.vocab_size
    assert invariant.job_refusal(GenerationJob(prompt_ids=[5]), [5, vocab], vocab) \
        == "batch-invariant mode does not cover prompts with images"
    assert invariant.job_refusal(GenerationJob(prompt_ids=[5]), [5, 6], vocab) is None
    handle = generator.submit(GenerationJob(prompt_ids=[5, 6, 7], num_predict=2))
    generator.run_until_done()
    assert len(handle.token_ids) == 2  # the generator still serves plain jobs

    folder = write_tiny_model(tmp_path / "moe", "qwen3_moe", vocab_size=400)
    write_tiny_tokenizer(folder)
    moe = TextModel.load(folder, device="cpu")
    with pytest.raises(InvalidOption, match="does not cover mixture-of-experts"):
        Generator(moe.model, moe.tokenizer, max_batch=4)
