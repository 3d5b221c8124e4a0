"""LoRA adapters on the fused decode layer on the GPU (`-m cuda`): the adapted fused layers
against the unfused adapted layers (AdaptedLinear around the EXL3 kernels), in a whole
forward and in a decode step replayed from a CUDA graph, rows of two adapters and bare
rows in one batch. The CPU twins of the same checks: tests/engine/test_fused_lora.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exl3cli.convert.synthetic import SHAPES, write_synthetic_model
from exl3cli.engine.adapters.lora import AdapterBank
from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.layers.fused_layer import FusedDecodeLayer
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.text.tokenizer import Tokenizer
from tests.fixtures.fused_shapes import SHAPE_128
from tests.fixtures.random_lora import random_adapter

pytestmark = pytest.mark.cuda
ROWS = ["a", None, "b", "a"]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(SHAPES, "test-hd128", SHAPE_128)
        return write_synthetic_model(tmp_path_factory.mktemp("hd128"), "test-hd128", seed=13)


def _adapted(folder: Path, dtype: torch.dtype):
    model = load_causal_lm(folder, device="cuda", dtype=dtype)
    bank = AdapterBank.of(model)
    bank.load(random_adapter(model, "a", seed=1))
    bank.load(random_adapter(model, "b", seed=2, rank=8,
                             suffixes=("q_proj", "v_proj", "down_proj")))
    return model, bank


def _fused_with_adapters(model) -> bool:
    return all(isinstance(layer._fused, FusedDecodeLayer) and layer._fused.qkv_lora is not None
               and layer._fused.down_lora is not None for layer in model.layers)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_adapted_fused_layers_give_the_unfused_adapted_logits(folder, dtype):
    model, bank = _adapted(folder, dtype)
    ids = torch.tensor([[5, 17, 99, 3, 42, 7, 7, 8]], device="cuda").expand(len(ROWS), -1)
    ids = ids.contiguous()

    def logits(rows: list[str | None] | None) -> torch.Tensor:
        if rows is not None:
            bank.select_rows(rows, [ids.shape[1]] * len(rows))
        try:
            return model(ids).float()
        finally:
            bank.release()

    fused = logits(ROWS)
    assert _fused_with_adapters(model)
    fused_bare = logits(None)
    for layer in model.layers:
        layer._fused = None  # the unfused kernels, each projection an AdaptedLinear
    plain = logits(ROWS)
    bare = logits(None)
    scale = plain.abs().max().item()
    tolerance = (2e-3 if dtype == torch.float32 else 3e-2) * scale
    assert (fused - plain).abs().max().item() <= tolerance
    assert (fused.argmax(-1) == plain.argmax(-1)).float().mean().item() >= 0.85
    # A row without an adapter is the bare fused layer's to the bit; the adapters move
    # their rows far past the tolerance.
    assert torch.equal(fused[1], fused_bare[1])
    for row, adapter in enumerate(ROWS):
        change = (plain[row] - bare[row]).abs().max().item()
        assert (change > 3 * tolerance) == (adapter is not None), (row, change)


def _first_decode_logits(model, tokenizer, jobs, mode: str) -> tuple[torch.Tensor, Generator]:
    """The logits of the first decode-only step of `jobs` (the same inputs every run)."""
    generator = Generator(model, tokenizer, decode_mode=mode, num_ctx=1024, max_batch=4)
    seen: list[torch.Tensor] = []
    if mode == "graph":
        run = generator.decode.run

        def spy_run(rows, ids=None):
            out = run(rows, ids)
            seen.append(out.float().clone())
            return out

        generator.decode.run = spy_run
    else:
        forward = generator._forward

        def spy_forward(fed):
            result = forward(fed)
            if all(len(tokens) == 1 and not a.prefilling for a, tokens in fed):
                seen.append(result[0].float().clone())
            return result

        generator._forward = spy_forward
    handles = [generator.submit(job) for job in jobs]
    generator.run_until_done()
    assert generator.pool.pages_in_use == 0
    assert all(len(h.token_ids) == job.num_predict for h, job in zip(handles, jobs, strict=True))
    return seen[0], generator


def _jobs(adapters: list[str | None], num_predict: int = 4) -> list[GenerationJob]:
    # Prompts over 64 tokens: every prefill forward takes the unfused path (the fused
    # layer takes up to 64 rows), so fused and unfused runs decode from the same tokens.
    return [GenerationJob([10 + (7 * i + 3 * j) % 200 for j in range(70 + 9 * i)], GREEDY,
                          num_predict=num_predict, ignore_eos=True, adapter=name)
            for i, name in enumerate(adapters)]


def test_adapted_decode_graph_step_matches_the_unfused_step(folder, monkeypatch):
    model, _ = _adapted(folder, torch.float16)
    tokenizer = Tokenizer.from_folder(folder)
    got, generator = _first_decode_logits(model, tokenizer, _jobs(ROWS), "graph")
    assert generator.decode.mode == "graph" and generator.decode.graph_count >= 1
    assert _fused_with_adapters(model)
    bare, _ = _first_decode_logits(model, tokenizer, _jobs([None] * len(ROWS)), "graph")
    monkeypatch.setenv("EXL3_FUSED_LAYER", "0")
    for layer in model.layers:
        layer._fused = False  # decided again: unfused
    want, _ = _first_decode_logits(model, tokenizer, _jobs(ROWS), "off")
    assert all(layer._fused is None for layer in model.layers)
    for row, adapter in enumerate(ROWS):
        error = ((got[row] - want[row]).norm() / want[row].norm()).item()
        change = ((bare[row] - want[row]).norm() / want[row].norm()).item()
        assert error < 2e-2, (row, error)
        assert (change > 0.1) == (adapter is not None), (row, change)


def _joining_tokens(model, tokenizer, mode: str, adapters: list[str | None],
                    first: int = 3, steps: int = 4) -> tuple[list[list[int]], Generator]:
    """Greedy tokens of jobs of `adapters`: `first` submitted, `steps` steps, then the
    rest join (they take the rows of the captured buckets' padding, then replace jobs
    that finish)."""
    generator = Generator(model, tokenizer, decode_mode=mode, num_ctx=1024, max_batch=4)
    jobs = _jobs(adapters, num_predict=12)
    handles = [generator.submit(job) for job in jobs[:first]]
    for _ in range(steps):
        generator.step()
    handles += [generator.submit(job) for job in jobs[first:]]
    generator.run_until_done()
    assert generator.decode.mode == mode
    return [h.token_ids for h in handles], generator


def test_adapted_decode_graphs_give_the_eager_tokens_in_float32(folder):
    # Jobs of different adapters join and leave between replays of the same graphs: the
    # graphs read the rows' slots of each step, never the capture's. The reference is
    # the same fixed-shape step run eagerly ("static"): the same kernels on the same
    # rows at every step, so float32 tokens must be equal. ("off" is no reference for
    # tokens: with a step launched ahead, a job that joins is admitted one step later
    # than in "off", so the same tokens of the other jobs go through different kernels
    # (the unfused prompt path vs the fused layer's float16 Hadamard inputs): logits
    # ~1e-3 apart, more than the top-2 gap of some greedy tokens. Runs 21-31 failed on
    # that near-tie, job 1 token 6, ever since the synthetic weights were drawn on the GPU.)
    model, _ = _adapted(folder, torch.float32)
    tokenizer = Tokenizer.from_folder(folder)
    names = ["a", None, "b", "a", "b", None]
    got, generator = _joining_tokens(model, tokenizer, "graph", names)
    assert _fused_with_adapters(model)
    assert generator.decode.graph_count >= 1
    want, _ = _joining_tokens(model, tokenizer, "static", names)
    assert got == want
    bare, _ = _joining_tokens(model, tokenizer, "graph", [None] * len(names))
    for mine, base, adapter in zip(got, bare, names, strict=True):
        assert (mine != base) == (adapter is not None)  # bare rows: the base model's tokens


def test_a_joining_job_takes_a_captured_padding_row_with_its_own_adapter(folder):
    # The (4 rows, 1 page) graph is captured while 3 jobs run (row 3: padding, slot 0);
    # a fourth job with adapter "b" then fills row 3 of that same graph (no bucket is
    # captured twice). If the graph kept the capture's slots, its tokens would be the
    # base model's; the other rows' tokens do not depend on row 3's adapter.
    model, _ = _adapted(folder, torch.float32)
    tokenizer = Tokenizer.from_folder(folder)
    names = ["a", None, "a", "b"]
    got, generator = _joining_tokens(model, tokenizer, "graph", names)
    assert (4, 1) in generator.decode._graphs
    assert generator.decode.captures == generator.decode.graph_count
    want, _ = _joining_tokens(model, tokenizer, "static", names)
    assert got == want
    bare, _ = _joining_tokens(model, tokenizer, "static", ["a", None, "a", None])
    assert got[3] != bare[3] and got[:3] == bare[:3]


class _CountingExt:
    """The kernel extension, counting its gemm_parts_low launches."""

    def __init__(self, ext):
        self.ext, self.low_launches = ext, 0

    def __getattr__(self, name: str):
        target = getattr(self.ext, name)
        if name != "gemm_parts_low":
            return target

        def counted(*args):
            self.low_launches += 1
            return target(*args)
        return counted


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_first_product_rides_in_each_gemm_launch(folder, dtype, monkeypatch):
    # Every adapted input's x @ A^T is made by its GEMM's launch (four per layer: q|k|v,
    # o, gate|up, down), and the logits are the separate product's (EXL3_LORA_GEMM=0).
    from exl3cli.ops import layer_kernels

    monkeypatch.setattr(layer_kernels, "_LORA_IN_GEMM", True)  # the default (EXL3_LORA_GEMM=1)
    model, bank = _adapted(folder, dtype)
    ids = torch.tensor([[5, 17, 99, 3, 42, 7, 7, 8]], device="cuda").expand(len(ROWS), -1)
    ids = ids.contiguous()
    real = layer_kernels._ext
    counting = _CountingExt(real(ids))
    monkeypatch.setattr(layer_kernels, "_ext", lambda *t: counting if real(*t) else None)

    def logits() -> torch.Tensor:
        bank.select_rows(ROWS, [ids.shape[1]] * len(ROWS))
        try:
            return model(ids).float()
        finally:
            bank.release()

    in_gemm = logits()
    assert _fused_with_adapters(model)
    assert counting.low_launches == 4 * len(model.layers)
    monkeypatch.setattr(layer_kernels, "_LORA_IN_GEMM", False)
    separate = logits()
    assert counting.low_launches == 4 * len(model.layers)
    scale = separate.abs().max().item()
    assert (in_gemm - separate).abs().max().item() <= 3e-2 * scale
    assert (in_gemm.argmax(-1) == separate.argmax(-1)).float().mean().item() >= 0.9
