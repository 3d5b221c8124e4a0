"""Decode steps from CUDA graphs (engine/cuda_graphs.py) against the eager path.

CPU: the fixed-shape step that the graphs capture ("static" mode: positions and key
writes on the device, span buckets, masked attention) is run eagerly and must decode
the same greedy tokens as `CausalLM.forward`; the CPU default stays plain `forward`.
CUDA (`-m cuda`): graph replays give the static step's logits and the same 64 greedy
tokens as eager `forward`, on synthetic EXL3 models (fused kernels).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exl3cli.engine import cuda_graphs
from exl3cli.engine.cuda_graphs import DecodeGraphRunner, open_session, runner_for
from exl3cli.engine.generate import generate_tokens
from exl3cli.engine.linear import Exl3Linear
from exl3cli.engine.loader import load_causal_lm
from exl3cli.engine.quant.synthetic import random_exl3_linear, write_synthetic_model
from exl3cli.engine.sampling import build_sampler

STEPS = 64


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_model(tmp_path_factory.mktemp("tiny"), "tiny", bits=4.0, seed=3)


def _prompt(vocab: int, length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


def _greedy_eager(model, prompts: list[list[int]], steps: int, max_len: int):
    """Reference: right-padded prefill, then plain forward one token per row."""
    cache = model.new_cache(len(prompts), max_len)
    return _greedy(model, prompts, steps, cache,
                   lambda ids: model.forward(ids, cache, last_logits_only=True)[:, -1])


def _greedy(model, prompts, steps, cache, step_fn):
    width = max(len(p) for p in prompts)
    padded = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=model.device)
    logits = model.forward(padded, cache, input_lengths=[len(p) for p in prompts],
                           last_logits_only=True)[:, -1]
    tokens, all_logits = [], []
    for _ in range(steps):
        token = logits.argmax(dim=-1)
        tokens.append(token.tolist())
        logits = step_fn(token[:, None]).clone()
        all_logits.append(logits)
    return tokens, torch.stack(all_logits)


def _greedy_runner(model, runner: DecodeGraphRunner, prompts, steps, max_len):
    cache = runner.cache(len(prompts), max_len)
    tokens, logits = _greedy(model, prompts, steps, cache, lambda ids: runner.step(ids, cache))
    return tokens, logits, cache


@pytest.mark.parametrize("lengths", [[9], [5, 12, 1]])
def test_static_step_decodes_like_forward_on_cpu(tiny_folder: Path, lengths: list[int]):
    model = load_causal_lm(tiny_folder, device="cpu", dtype=torch.float32)
    vocab = model.config.vocab_size
    prompts = [_prompt(vocab, n, seed=n) for n in lengths]
    max_len = max(lengths) + STEPS + 3
    expected, expected_logits = _greedy_eager(model, prompts, STEPS, max_len)
    # A small bucket makes the steps cross several fixed spans.
    runner = DecodeGraphRunner(model, bucket=16, mode="static")
    got, got_logits, cache = _greedy_runner(model, runner, prompts, STEPS, max_len)
    assert got == expected
    torch.testing.assert_close(got_logits, expected_logits, rtol=1e-4, atol=1e-4)
    final = [n + STEPS for n in lengths]
    assert cache.row_lengths() == final
    assert cache.lengths.tolist() == final  # device lengths advanced by the step itself


def test_static_step_refuses_nothing_at_the_cache_end(tiny_folder: Path):
    """The last position of the cache still decodes; one more raises ContextOverflow
    (through the eager path) instead of writing out of bounds."""
    from exl3cli.errors import ContextOverflow

    model = load_causal_lm(tiny_folder, device="cpu", dtype=torch.float32)
    runner = DecodeGraphRunner(model, bucket=8, mode="static")
    cache = runner.cache(1, 6)
    model.forward(torch.tensor([[1, 2, 3, 4, 5]]), cache)
    logits = runner.step([7], cache)
    assert logits.shape == (1, model.config.vocab_size)
    assert cache.row_lengths() == [6]
    with pytest.raises(ContextOverflow):
        runner.step([7], cache)


def test_cpu_path_is_plain_forward(tiny_folder: Path):
    model = load_causal_lm(tiny_folder, device="cpu", dtype=torch.float32)
    assert runner_for(model) is None
    assert open_session(model, 1, 32) is None
    runner = DecodeGraphRunner(model)
    assert runner.mode == "eager"
    with pytest.raises(ValueError):
        DecodeGraphRunner(model, mode="graph")
    prompt = _prompt(model.config.vocab_size, 7, seed=1)
    cache_a, cache_b = runner.cache(1, 40), model.new_cache(1, 40)
    model.forward(torch.tensor([prompt]), cache_a)
    model.forward(torch.tensor([prompt]), cache_b)
    for token in (5, 9, 200):
        got = runner.step([token], cache_a)
        want = model.forward(torch.tensor([[token]]), cache_b, last_logits_only=True)[:, -1]
        assert torch.equal(got, want)
    # generate_tokens on the CPU: the same greedy tokens as a hand-written forward loop.
    sampler = build_sampler({"temperature": 0})
    tokens = list(generate_tokens(model, prompt, sampler, max_seq_len=64, num_predict=12))
    expected, _ = _greedy_eager(model, [prompt], 12, 64)
    assert tokens == [row[0] for row in expected]


def test_runner_reuses_its_cache_while_the_shape_holds(tiny_folder: Path):
    model = load_causal_lm(tiny_folder, device="cpu", dtype=torch.float32)
    runner = DecodeGraphRunner(model, mode="static")
    first = runner.cache(2, 32)
    model.forward(torch.tensor([[1, 2], [3, 4]]), first)
    again = runner.cache(2, 32)
    assert again is first and again.row_lengths() == [0, 0]
    assert again.lengths.tolist() == [0, 0]
    assert runner.cache(1, 32) is not first
    with pytest.raises(ValueError):
        runner.step([1, 2], runner.cache(1, 32))


def test_exl3_forward_into_a_column_slice_on_cpu():
    gen = torch.Generator().manual_seed(0)
    layer = Exl3Linear(random_exl3_linear(64, 48, 4, generator=gen), 64, 48, mode="trellis")
    assert not layer.uses_kernels(torch.zeros(1, 64))
    x = torch.randn(3, 64, generator=gen)
    wide = torch.full((3, 100), float("nan"))
    layer.forward_into(x, wide[:, 20:68])
    torch.testing.assert_close(wide[:, 20:68], layer(x))
    assert torch.isnan(wide[:, :20]).all() and torch.isnan(wide[:, 68:]).all()


# ----------------------------------------------------------------------------- CUDA


def _cuda_model(folder: Path, dtype: torch.dtype):
    assert torch.cuda.is_available(), "cuda tests need a GPU"
    return load_causal_lm(folder, device="cuda", dtype=dtype)


@pytest.fixture(scope="module")
def small_folders(tmp_path_factory: pytest.TempPathFactory, tiny_folder: Path) -> dict:
    smol = write_synthetic_model(tmp_path_factory.mktemp("smol"), "smollm2-135m", bits=4.0,
                                 num_layers=2, seed=5)
    return {"tiny": tiny_folder, "smollm2-135m": smol}


@pytest.mark.cuda
@pytest.mark.parametrize("shape", ["tiny", "smollm2-135m"])
@pytest.mark.parametrize("lengths", [[40], [3, 33, 17, 8]])
def test_graph_replay_matches_the_static_step(small_folders, shape, lengths):
    model = _cuda_model(small_folders[shape], torch.float16)
    layers = [m for m in model.modules() if isinstance(m, Exl3Linear)]
    probe = torch.zeros(1, layers[0].in_features, device="cuda", dtype=torch.float16)
    assert layers and all(m.uses_kernels(probe) for m in layers), "fused kernels not in use"
    prompts = [_prompt(model.config.vocab_size, n, seed=n) for n in lengths]
    max_len = max(lengths) + STEPS + 1
    static = DecodeGraphRunner(model, bucket=32, mode="static")
    want, want_logits, _ = _greedy_runner(model, static, prompts, STEPS, max_len)
    graphs = DecodeGraphRunner(model, bucket=32, mode="graph")
    got, got_logits, cache = _greedy_runner(model, graphs, prompts, STEPS, max_len)
    assert graphs.mode == "graph" and graphs.graph_count >= 2  # buckets crossed
    assert got == want
    # Same kernels in the same order; only cuBLAS' choices under capture may differ.
    torch.testing.assert_close(got_logits, want_logits, rtol=2e-3, atol=2e-3)
    assert torch.isfinite(got_logits).all()
    assert cache.lengths.tolist() == [n + STEPS for n in lengths]


@pytest.mark.cuda
@pytest.mark.parametrize("lengths", [[40], [3, 33, 17, 8]])
def test_graph_decode_gives_the_eager_tokens(small_folders, lengths):
    # float32 activations: eager and graph differ only in summation order, far below
    # the gaps between the top logits.
    model = _cuda_model(small_folders["smollm2-135m"], torch.float32)
    prompts = [_prompt(model.config.vocab_size, n, seed=n + 1) for n in lengths]
    max_len = max(lengths) + STEPS + 1
    want, want_logits = _greedy_eager(model, prompts, STEPS, max_len)
    runner = DecodeGraphRunner(model, bucket=64, mode="graph")
    got, got_logits, _ = _greedy_runner(model, runner, prompts, STEPS, max_len)
    assert runner.graph_count >= 1
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-3, atol=1e-3)


@pytest.mark.cuda
def test_generate_tokens_on_cuda_replays_graphs(small_folders):
    model = _cuda_model(small_folders["tiny"], torch.float32)
    prompt = _prompt(model.config.vocab_size, 20, seed=9)
    sampler = build_sampler({"temperature": 0})
    first = list(generate_tokens(model, prompt, sampler, max_seq_len=128, num_predict=STEPS))
    runner = cuda_graphs.runner_for(model)
    assert runner is not None and runner.mode == "graph" and runner.graph_count >= 1
    assert not runner.lock.locked()  # the session was handed back
    expected, _ = _greedy_eager(model, [prompt], STEPS, 128)
    assert first == [row[0] for row in expected]
    again = list(generate_tokens(model, prompt, sampler, max_seq_len=128, num_predict=STEPS))
    assert again == first  # the reused cache and graphs start clean


@pytest.mark.cuda
def test_graphs_survive_a_new_cache_shape(small_folders):
    # A new cache shape drops the graphs; capturing again must use a fresh memory pool
    # (re-using the old pool handle tripped the allocator's use_count assert on the H200).
    model = _cuda_model(small_folders["tiny"], torch.float32)
    runner = DecodeGraphRunner(model, bucket=32, mode="graph")
    prompts = [_prompt(model.config.vocab_size, 12, seed=3)]
    for max_len in (12 + STEPS + 1, 64, 96):
        got, _, _ = _greedy_runner(model, runner, prompts, STEPS, max_len)
        want, _ = _greedy_eager(model, prompts, STEPS, max_len)
        assert runner.mode == "graph" and runner.graph_count >= 1, max_len
        assert got == want
