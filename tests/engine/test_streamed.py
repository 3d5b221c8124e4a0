"""Streamed layers (engine/layers/streamed.py): trellises in host memory, two device
slots used in turn. On a CPU device the slots are plain copies made as each layer
starts, so these tests check the bookkeeping the GPU path shares (which layer reads
which slot, when each is filled) against the same model with every layer resident:
the logits must be bit-identical. tests/engine/test_streamed_cuda.py runs it with the
copy stream and events."""

from __future__ import annotations

import pytest
import torch

from exl3cli.convert.synthetic import write_synthetic_model
from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.layers.offload import HostLinear
from exl3cli.engine.layers.streamed import STREAMED_BUFFERS
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.models.placement import (
    MemoryEstimate,
    estimate_memory,
    offload_mode,
    plan_placement,
)
from exl3cli.engine.spec.architecture import load_family_config
from exl3cli.engine.text.tokenizer import Tokenizer
from exl3cli.errors import InvalidOption, ModelLoadError

LAYERS = 5  # resident layer 0, then four streamed: slots 0, 1, 0, 1


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # Fractional bits: layers of different K, so the streamed layers differ in size.
    return write_synthetic_model(tmp_path_factory.mktemp("streamed"), "tiny", bits=3.5,
                                 head_bits=6, num_layers=LAYERS, seed=11)


def _budget(folder, resident: int) -> int:
    config = load_family_config(folder)
    estimate = estimate_memory(folder, config, torch.float32, 256)
    fixed = estimate.other + estimate.cache_per_layer * config.num_layers + estimate.workspace
    return fixed + sum(estimate.layers[:resident]) + 2 * max(estimate.layers[resident:])


def _load(folder, **kwargs):
    return load_causal_lm(folder, device="cpu", dtype=torch.float32, cpu_weights="exl3",
                          num_ctx=256, **kwargs)


def _first_trellis(layer) -> torch.Tensor:
    """The layer's first streamed tensor: offset 0 of its slot when streamed."""
    return next(m._buffers[n] for m in layer.modules() for n in STREAMED_BUFFERS
                if m._buffers.get(n) is not None)


def _greedy(model, folder, n: int = 12) -> list[int]:
    tokenizer = Tokenizer.from_folder(folder)
    generator = Generator(model, tokenizer, max_batch=1, num_ctx=128)
    handle = generator.submit(GenerationJob(tokenizer.encode("Stream me"),
                                            {"temperature": 0}, num_predict=n,
                                            ignore_eos=True))
    generator.run_until_done()
    return handle.token_ids


def test_streamed_layers_compute_what_resident_ones_do(folder, monkeypatch) -> None:
    whole = _load(folder)
    assert whole.streamer is None and not whole.placement.offloaded
    monkeypatch.setenv("EXL3_GPU_MEMORY", str(_budget(folder, 1)))
    streamed = _load(folder, offload="stream")
    placement = streamed.placement
    assert (placement.gpu_layers, placement.streamed) == (1, True)
    assert streamed.streamer.streamed == [1, 2, 3, 4]
    assert not any(isinstance(m, HostLinear) for m in streamed.modules())
    # Layers 1 and 3 read slot 0, 2 and 4 slot 1; the host keeps every layer's bytes.
    ptr = [_first_trellis(streamed.layers[i]).data_ptr() for i in range(LAYERS)]
    assert ptr[1] == ptr[3] and ptr[2] == ptr[4] and ptr[1] != ptr[2]
    assert ptr[0] not in (ptr[1], ptr[2])
    held = sum(whole.layers[i].mlp.down.trellis_t.numel() * 2 for i in range(1, LAYERS))
    assert streamed.streamer.host_bytes >= held
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    for _ in range(2):  # the second forward starts over from slot 0
        torch.testing.assert_close(streamed(ids), whole(ids), rtol=0, atol=0)
    assert _greedy(streamed, folder) == _greedy(whole, folder)


def test_every_layer_streamed(folder, monkeypatch) -> None:
    """num_gpu 0 with streaming keeps the model on the device, every layer streamed
    (the first copy is then issued by layer 0 itself)."""
    whole = _load(folder)
    monkeypatch.setenv("EXL3_GPU_MEMORY", "1GiB")
    monkeypatch.setenv("EXL3_OFFLOAD", "stream")
    streamed = _load(folder, gpu_layers=0)
    assert streamed.placement.gpu_layers == 0 and streamed.placement.streamed
    assert streamed.streamer.streamed == list(range(LAYERS))
    ids = torch.tensor([[7, 7, 1, 2]])
    torch.testing.assert_close(streamed(ids), whole(ids), rtol=0, atol=0)
    assert _greedy(streamed, folder, 6) == _greedy(whole, folder, 6)


def test_plan_reserves_two_slots_when_streaming() -> None:
    estimate = MemoryEstimate(layers=(100, 100, 100, 120, 100), other=300, cache_per_layer=10,
                              workspace=50)  # fixed 400
    full = plan_placement(estimate, 1000, None, streamed=True)
    assert (full.gpu_layers, full.streamed, full.gpu_bytes) == (5, False, 920)
    # 919: not all five; three resident + slots 2 x 120 = 1040 > 919; two: 400+200+240.
    split = plan_placement(estimate, 919, None, streamed=True)
    assert (split.gpu_layers, split.streamed, split.gpu_bytes, split.cpu_bytes) == \
        (2, True, 840, 320)
    assert plan_placement(estimate, 919, None).gpu_layers == 5 - 1  # CPU offload: 4 fit
    zero = plan_placement(estimate, 700, None, gpu_layers=0, streamed=True)
    assert (zero.gpu_layers, zero.streamed, zero.gpu_bytes) == (0, True, 640)
    with pytest.raises(ModelLoadError, match="two streamed layers"):
        plan_placement(estimate, 600, None, streamed=True)


def test_offload_mode() -> None:
    assert offload_mode() in ("cpu", "stream")
    assert offload_mode("STREAM") == "stream"
    with pytest.raises(InvalidOption, match="EXL3_OFFLOAD"):
        offload_mode("disk")
