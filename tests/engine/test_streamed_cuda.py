"""Offload on the GPU (`-m cuda`): streamed layers (copy stream + events, replayed from
CUDA graphs) against every layer resident, and a forced small memory budget that splits
the model between GPU and CPU instead of failing."""

from __future__ import annotations

import pytest
import torch

from exl3cli.convert.synthetic import write_synthetic_model
from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.layers.offload import HostLinear
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.models.placement import estimate_memory
from exl3cli.engine.spec.architecture import load_family_config
from exl3cli.engine.text.tokenizer import Tokenizer

pytestmark = pytest.mark.cuda
LAYERS = 5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_synthetic_model(tmp_path_factory.mktemp("stream-cuda"), "smollm2-135m",
                                 bits=3.5, head_bits=6, num_layers=LAYERS, seed=7)


def _fixed_and_layers(folder) -> tuple[int, tuple[int, ...]]:
    config = load_family_config(folder)
    estimate = estimate_memory(folder, config, torch.float16, 512)
    fixed = estimate.other + estimate.cache_per_layer * config.num_layers + estimate.workspace
    return fixed, estimate.layers


def _load(folder, **kwargs):
    return load_causal_lm(folder, device="cuda", dtype=torch.float16, num_ctx=512, **kwargs)


def _generate(model, folder, mode: str | None = None, n: int = 24) -> tuple[list[int], str]:
    tokenizer = Tokenizer.from_folder(folder)
    generator = Generator(model, tokenizer, max_batch=2, num_ctx=256, decode_mode=mode)
    handles = [generator.submit(GenerationJob(list(range(20 + i, 60 + 7 * i)),
                                              {"temperature": 0}, num_predict=n,
                                              ignore_eos=True)) for i in range(2)]
    generator.run_until_done()
    return [t for h in handles for t in h.token_ids], generator.decode.mode


def test_streamed_layers_are_bit_identical_on_cuda(folder, monkeypatch) -> None:
    whole = _load(folder)
    fixed, layers = _fixed_and_layers(folder)
    monkeypatch.setenv("EXL3_GPU_MEMORY", str(fixed + layers[0] + 2 * max(layers[1:])))
    streamed = _load(folder, offload="stream")
    assert (streamed.placement.gpu_layers, streamed.placement.streamed) == (1, True)
    assert streamed.streamer.streamed == [1, 2, 3, 4]
    assert streamed.streamer.host_bytes > 0
    ids = torch.arange(40, 140, device="cuda")[None]
    for _ in range(2):
        torch.testing.assert_close(streamed(ids), whole(ids), rtol=0, atol=0)
    expected, _ = _generate(whole, folder, "static")
    for mode in ("static", "graph"):  # graphs replay the copies and their event edges
        tokens, ran = _generate(streamed, folder, mode)
        assert ran == mode, "the streamed model's decode graph could not be captured"
        assert tokens == expected, mode
    # The device holds less: the four streamed layers' trellises live in two slots.
    assert streamed.streamer.slot_bytes < streamed.streamer.host_bytes


def test_the_plan_covers_what_the_device_holds(folder) -> None:
    """Weights, cache and workspace as planned bound what the allocator hands out for a
    load and a 300-token prompt as the generator runs one (the plan's workspace is sized
    for 2048 tokens and chunked logits: every position's logits of a long prompt, 59 MB
    here, are a perplexity run's choice, not a prompt's)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = _load(folder)
    model(torch.arange(10, 310, device="cuda")[None], last_logits_only=True)
    used = torch.cuda.max_memory_allocated() - before
    assert used <= model.placement.gpu_bytes, (used, model.placement.gpu_bytes)


def test_small_budget_offloads_to_the_cpu_instead_of_failing(folder, monkeypatch) -> None:
    whole = _load(folder)
    fixed, layers = _fixed_and_layers(folder)
    monkeypatch.setenv("EXL3_GPU_MEMORY", str(fixed + layers[0] + layers[1]))
    split = _load(folder)  # automatic split: two layers fit
    assert split.placement.gpu_layers == 2 and split.placement.offloaded
    assert split.placement.processor.endswith("CPU/GPU")
    assert any(isinstance(m, HostLinear) for m in split.layers[2].modules())
    assert not any(isinstance(m, HostLinear) for m in split.layers[1].modules())
    ids = torch.arange(40, 140, device="cuda")[None]
    reference, logits = whole(ids).float(), split(ids).float()
    assert logits.device.type == "cuda"
    # The CPU projections round differently from the GPU kernels: close, not equal.
    assert (logits - reference).abs().max() < 2e-2 * reference.abs().max()
    expected, _ = _generate(whole, folder)
    tokens, _ = _generate(split, folder)
    same = sum(a == b for a, b in zip(tokens, expected, strict=True))
    assert same >= len(expected) // 2, (tokens, expected)


def test_offloaded_prompts_run_on_the_device(folder, monkeypatch) -> None:
    """A prompt through an offloaded layer copies its trellises to the GPU and runs the
    device kernel (no CPU product); one decode row runs on the CPU kernel; with
    EXL3_OFFLOAD_DEVICE_ROWS=0 prompts stay on the CPU too. Logits close either way."""
    from exl3cli.ops import cpu_kernels

    whole = _load(folder)
    fixed, layers = _fixed_and_layers(folder)
    monkeypatch.setenv("EXL3_GPU_MEMORY", str(fixed + layers[0]))
    split = _load(folder)
    hosted = [m for m in split.layers[1].modules() if isinstance(m, HostLinear)]
    assert hosted and all(h.device_rows == 9 for h in hosted)
    assert all(p.trellis_t.is_pinned() for h in hosted for p in h.inner.modules()
               if hasattr(p, "trellis_t"))
    calls: list[int] = []
    kernel = cpu_kernels.exl3_linear_cpu
    monkeypatch.setattr(cpu_kernels, "exl3_linear_cpu",
                        lambda x, *a: calls.append(x.shape[0]) or kernel(x, *a))
    ids = torch.arange(40, 140, device="cuda")[None]
    reference = whole(ids).float()
    logits = split(ids).float()
    assert calls == []
    assert (logits - reference).abs().max() < 2e-2 * reference.abs().max()
    split(ids[:, :1])
    assert calls and set(calls) == {1}
    monkeypatch.setenv("EXL3_OFFLOAD_DEVICE_ROWS", "0")
    on_cpu = _load(folder)
    calls.clear()
    logits = on_cpu(ids).float()
    assert calls and set(calls) == {100}
    assert (logits - reference).abs().max() < 2e-2 * reference.abs().max()
