"""Memory planning and layer offload (engine/models/placement.py, engine/layers/offload.py).

The GPU budget is faked with EXL3_GPU_MEMORY, so a CPU-only machine runs the planner
and the split model: layers past the plan's count run behind a HostLinear (a device hop
that is a no-op when the main device is the CPU too)."""

from __future__ import annotations

import pytest
import torch

from exl3cli.cli.serve import processor_text
from exl3cli.convert.synthetic import write_synthetic_model
from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.layers.offload import HostLinear
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.models.placement import (
    MemoryEstimate,
    Placement,
    estimate_memory,
    parse_bytes,
    plan_placement,
)
from exl3cli.engine.spec.architecture import load_family_config
from exl3cli.engine.text.tokenizer import Tokenizer
from exl3cli.errors import InvalidOption, ModelLoadError
from exl3cli.runtime.loaded_model import LoadedModel

MIB = 2**20


def test_parse_bytes() -> None:
    assert parse_bytes("8GiB") == 8 * 2**30
    assert parse_bytes("512MiB") == 512 * MIB
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes(" 4g ") == 4 * 10**9
    assert parse_bytes("123") == 123
    for bad in ("", "lots", "4 parsecs", "-1G"):
        with pytest.raises(InvalidOption, match="memory size"):
            parse_bytes(bad)


ESTIMATE = MemoryEstimate(layers=(100,) * 10, other=300, cache_per_layer=10, workspace=50)
# The main device always holds other + cache of every layer + workspace = 450.


def test_plan_fits_all_layers_or_offloads_the_rest() -> None:
    full = plan_placement(ESTIMATE, gpu_budget=10_000, cpu_budget=None)
    assert (full.gpu_layers, full.gpu_bytes, full.cpu_bytes) == (10, 1450, 0)
    assert full.processor == "100% GPU" and not full.offloaded
    half = plan_placement(ESTIMATE, gpu_budget=999, cpu_budget=None)  # 450 + 5 x 100
    assert (half.gpu_layers, half.gpu_bytes, half.cpu_bytes) == (5, 950, 500)
    assert half.processor == "34%/66% CPU/GPU"
    assert plan_placement(ESTIMATE, 999, None, gpu_layers=-1) == half


def test_plan_with_num_gpu() -> None:
    three = plan_placement(ESTIMATE, gpu_budget=10_000, cpu_budget=10_000, gpu_layers=3)
    assert (three.gpu_layers, three.cpu_bytes) == (3, 700)
    assert plan_placement(ESTIMATE, 10_000, None, gpu_layers=99).gpu_layers == 10
    zero = plan_placement(ESTIMATE, 10_000, None, gpu_layers=0)  # Ollama: all on the CPU
    assert zero.gpu_layers == 0 and zero.processor == "100% CPU"
    assert zero.cpu_bytes == ESTIMATE.total
    with pytest.raises(ModelLoadError, match="num_gpu 8 needs .* lower num_gpu"):
        plan_placement(ESTIMATE, gpu_budget=999, cpu_budget=None, gpu_layers=8)
    with pytest.raises(InvalidOption, match="num_gpu"):
        plan_placement(ESTIMATE, 10_000, None, gpu_layers=-2)


def test_plan_refuses_what_cannot_fit() -> None:
    with pytest.raises(ModelLoadError, match="at least .* on the GPU"):
        plan_placement(ESTIMATE, gpu_budget=400, cpu_budget=None)
    with pytest.raises(ModelLoadError, match="offloaded layers: .* host memory"):
        plan_placement(ESTIMATE, gpu_budget=999, cpu_budget=499)
    with pytest.raises(ModelLoadError, match="the model: .* host memory"):
        plan_placement(ESTIMATE, gpu_budget=None, cpu_budget=1000)  # CPU only: 1450
    cpu = plan_placement(ESTIMATE, gpu_budget=None, cpu_budget=None)
    assert cpu.processor == "100% CPU" and cpu.cpu_bytes == ESTIMATE.total


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_synthetic_model(tmp_path_factory.mktemp("tiny"), "tiny", bits=3.5, head_bits=6)


def test_estimate_reads_the_headers(tiny) -> None:
    config = load_family_config(tiny)
    kept = estimate_memory(tiny, config, torch.float32, num_ctx=1000)
    assert len(kept.layers) == config.num_layers
    # Layer 0's down projection: K=4 trellis (24, 16, 64) int16 = 48 KiB, kept as stored.
    assert kept.layers[0] > 24 * 16 * 64 * 2
    assert kept.cache_per_layer == 2 * config.num_kv_heads * config.head_dim * 1000 * 4
    expanded = estimate_memory(tiny, config, torch.float32, 1000, dequantized_bytes=4)
    assert expanded.layers[0] > 2 * kept.layers[0]  # float32 matrices instead of trellis
    assert expanded.other > kept.other  # the quantized head too


def _greedy(model, folder, n: int = 10) -> list[int]:
    tokenizer = Tokenizer.from_folder(folder)
    generator = Generator(model, tokenizer, max_batch=1, num_ctx=128)
    handle = generator.submit(GenerationJob(tokenizer.encode("Offload me"),
                                            {"temperature": 0}, num_predict=n))
    generator.run_until_done()
    return handle.token_ids


def test_small_budget_offloads_instead_of_failing(tiny, monkeypatch) -> None:
    """A forced small device budget splits the model; the split model generates the
    same greedy text, and logits, as the unsplit one."""
    config = load_family_config(tiny)
    whole = load_causal_lm(tiny, device="cpu", dtype=torch.float32, cpu_weights="exl3",
                           num_ctx=256)
    assert whole.placement.gpu_layers == config.num_layers
    estimate = estimate_memory(tiny, config, torch.float32, 256)
    fixed = estimate.other + estimate.cache_per_layer * config.num_layers + estimate.workspace
    monkeypatch.setenv("EXL3_GPU_MEMORY", str(fixed + estimate.layers[0]))
    split = load_causal_lm(tiny, device="cpu", dtype=torch.float32, cpu_weights="exl3",
                           num_ctx=256)
    assert split.placement.gpu_layers == 1 and split.placement.offloaded
    assert not any(isinstance(m, HostLinear) for m in split.layers[0].modules())
    hosted = [m for m in split.layers[1].modules() if isinstance(m, HostLinear)]
    assert len(hosted) == 4  # qkv, o, gate_up, down
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    torch.testing.assert_close(split(ids), whole(ids), rtol=0, atol=0)
    assert _greedy(split, tiny) == _greedy(whole, tiny)
    # num_gpu asks for a count; too many for the budget is refused with the figures.
    assert load_causal_lm(tiny, device="cpu", dtype=torch.float32, gpu_layers=0,
                          cpu_weights="exl3", num_ctx=256).placement.gpu_layers == 0
    with pytest.raises(ModelLoadError, match="num_gpu 2 needs"):
        load_causal_lm(tiny, device="cpu", dtype=torch.float32, gpu_layers=2,
                       cpu_weights="exl3", num_ctx=256)
    monkeypatch.setenv("EXL3_GPU_MEMORY", "1KiB")
    with pytest.raises(ModelLoadError, match="on the GPU"):
        load_causal_lm(tiny, device="cpu", num_ctx=256)


def test_cpu_load_refuses_beyond_host_memory(tiny, monkeypatch) -> None:
    monkeypatch.delenv("EXL3_GPU_MEMORY", raising=False)
    monkeypatch.setenv("EXL3_CPU_MEMORY", "64KiB")
    with pytest.raises(ModelLoadError, match="host memory needed"):
        load_causal_lm(tiny, device="cpu")


def test_ps_shows_the_split() -> None:
    split = Placement(num_layers=32, gpu_layers=16, gpu_bytes=52, cpu_bytes=48)
    loaded = LoadedModel(key="k", name="m", text_model=None, size=1000, details={},
                         on_gpu=True, placement=split)
    assert loaded.size_vram == 520
    assert processor_text({"size": loaded.size, "size_vram": loaded.size_vram}) == \
        "48%/52% CPU/GPU"
    loaded.on_gpu = False
    assert loaded.size_vram == 0


def test_a_long_cpu_forward_gives_its_workspace_back(tiny, monkeypatch) -> None:
    """A prompt-sized CPU forward ends with malloc_trim (ops/host_memory.py); a decode
    step does not pay for it."""
    import platform

    from exl3cli.engine.models import causal_lm
    from exl3cli.ops.host_memory import trim_host_heap

    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert trim_host_heap() is True
    calls = []
    monkeypatch.setattr(causal_lm, "trim_host_heap", lambda: calls.append(1) or True)
    model = load_causal_lm(tiny, device="cpu", dtype=torch.float32, cpu_weights="exl3",
                           num_ctx=256)
    model(torch.arange(causal_lm.TRIM_AFTER_TOKENS)[None] % 200)
    assert len(calls) == 1
    model(torch.tensor([[1, 2, 3]]))
    assert len(calls) == 1
