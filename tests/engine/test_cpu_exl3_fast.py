"""The CPU decode path's second round (bench/NOTES-cpu-exl3.md): the inexact "fast" GEMV
mode (ops/cpu_gemv_mode.py) against its PyTorch twin and the exact product, the
whole-stack decode op (models/exl3_stack.py) against its twin and the per-layer path,
and the float32 default of EXL3 folders on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from exl3cli.convert.synthetic import write_synthetic_model
from exl3cli.engine.kvcache.paged_attention import PagedBatch
from exl3cli.engine.kvcache.paged_cache import PagePool, PageTable, pages_for
from exl3cli.engine.models.causal_lm import DecoderLayer
from exl3cli.engine.models.exl3_stack import Exl3DecodeStack
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.errors import InvalidOption
from exl3cli.ops import cpu_exl3_layer as layer_ops
from exl3cli.ops import cpu_kernels
from exl3cli.ops.cpu_gemv_mode import exl3_matmul_fast_reference, set_exl3_gemv_mode
from tests.engine.test_cpu_exl3 import _fresh, _has_step_order, _kernel_required, _random_trellis


@pytest.fixture
def fast_mode():
    _kernel_required()
    yield set_exl3_gemv_mode("fast")
    set_exl3_gemv_mode("exact")


# (kb, nb): one tile, one strip, odd sizes, more than 16 tiles per strip (int32 flushes:
# kb 40 and 304 are the SmolLM2 / Qwen2.5-0.5B down projections).
FAST_SHAPES = [(1, 1), (7, 3), (17, 5), (40, 9), (304, 2)]


@pytest.mark.parametrize("k", [1, 1.5, 2, 3, 4, 5, 6, 8], ids=str)
def test_fast_gemv_matches_its_twin(k: float, fast_mode: str) -> None:
    """The integer product equals its PyTorch twin to float32 order, and stays within
    ~2e-4 of the exact (dequantized) product: inexact, by the float16 rounding it skips."""
    kind = "steps-int" if _has_step_order() else cpu_kernels.exl3_gemv_kind(k, 1)
    assert fast_mode == ("fast" if _has_step_order() else "exact")
    assert [cpu_kernels.exl3_gemv_kind(k, r) for r in (1, 2)] == [kind, kind]
    g = _fresh()
    for kb, nb in FAST_SHAPES:
        trellis_t = _random_trellis(kb, nb, k, g).transpose(0, 1).contiguous()
        for rows in (1, 2, 3):
            xh = torch.randn(rows, 16 * kb, generator=g) * 3
            got = cpu_kernels.exl3_matmul_cpu(xh, trellis_t, k, "mul1")
            exact = cpu_kernels.exl3_matmul_reference(xh, trellis_t, k, "mul1")
            if rows <= 2 and kind == "steps-int":
                twin = exl3_matmul_fast_reference(xh, trellis_t, k)
                scale = twin.abs().max()
                torch.testing.assert_close(got / scale, twin / scale, rtol=0, atol=2e-6)
                err = ((got - exact).norm() / exact.norm()).item()
                assert 1e-6 < err < 5e-4, err  # inexact, but by the rounding only
            else:  # 3 rows (and builds without the integer product): exact
                scale = exact.abs().max()
                torch.testing.assert_close(got / scale, exact / scale, rtol=0, atol=1e-5)


@pytest.mark.parametrize("codebook", ["mcg", "3inst"])
def test_fast_mode_keeps_other_codebooks_exact(codebook: str, fast_mode: str) -> None:
    g = _fresh()
    trellis_t = _random_trellis(9, 4, 4, g).transpose(0, 1).contiguous()
    xh = torch.randn(1, 144, generator=g)
    torch.testing.assert_close(cpu_kernels.exl3_matmul_cpu(xh, trellis_t, 4, codebook),
                               cpu_kernels.exl3_matmul_reference(xh, trellis_t, 4, codebook),
                               rtol=1e-5, atol=1e-5)


def test_fast_mode_zero_rows_and_bad_values(fast_mode: str) -> None:
    g = _fresh()
    trellis_t = _random_trellis(3, 2, 4, g).transpose(0, 1).contiguous()
    zero = cpu_kernels.exl3_matmul_cpu(torch.zeros(1, 48), trellis_t, 4, "mul1")
    assert torch.equal(zero, torch.zeros(1, 32))
    with pytest.raises(ValueError, match="exact, fast"):
        set_exl3_gemv_mode("quick")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
    out = write_synthetic_model(tmp_path_factory.mktemp("stack"), "tiny", bits=4.0,
                                head_bits=6, num_layers=3, seed=7)
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"  # as SmolLM2's and Qwen2.5's checkpoints say
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_bad_gemv_mode_is_refused_at_load(folder, monkeypatch) -> None:
    monkeypatch.setenv("EXL3_CPU_GEMV", "turbo")
    with pytest.raises(InvalidOption, match="EXL3_CPU_GEMV must be one of exact, fast"):
        load_causal_lm(folder, device="cpu")


def test_exl3_folder_computes_in_float32_on_the_cpu(folder) -> None:
    """A bf16 checkpoint's EXL3 folder runs float32 activations in the exl3 weight mode
    (the decode layer's kernels need them); the dense modes keep the checkpoint's rule."""
    model = load_causal_lm(folder, device="cpu")
    assert model.dtype == torch.float32
    assert model.layers[0]._decode_plan() is not None
    assert load_causal_lm(folder, device="cpu", cpu_weights="off").dtype == torch.bfloat16


def _decode(model, steps: int, seqs: int = 2) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy decode of `seqs` sequences of different lengths, one paged step each."""
    config = model.config
    pool = PagePool(pages_for(40) * seqs, len(model.layers), config.num_kv_heads,
                    config.head_dim, model.dtype, model.device)
    tables = [PageTable(pool) for _ in range(seqs)]
    prompts = [[5 + i + j for j in range(3 + 4 * i)] for i in range(seqs)]
    for table, ids in zip(tables, prompts, strict=True):
        table.admit(ids, 40)
    out = [list(p) for p in prompts]
    logits = model(torch.tensor([sum(prompts, [])]), PagedBatch(pool, tables, prompts),
                   last_logits_only=True)
    seen = []
    for _ in range(steps):
        new = [[int(row.argmax())] for row in logits[0]]
        for o, n in zip(out, new, strict=True):
            o += n
        logits = model(torch.tensor([sum(new, [])]), PagedBatch(pool, tables, new),
                       last_logits_only=True)
        seen.append(logits)
    return out, torch.cat(seen)


def test_stack_op_matches_the_per_layer_path(folder, monkeypatch) -> None:
    stacked = load_causal_lm(folder, device="cpu")
    monkeypatch.setenv("EXL3_CPU_STACK", "0")
    layered = load_causal_lm(folder, device="cpu")
    tokens, logits = _decode(layered, 6)
    assert layered._stack is None
    monkeypatch.delenv("EXL3_CPU_STACK")
    tokens_s, logits_s = _decode(stacked, 6)
    assert isinstance(stacked._stack, Exl3DecodeStack)
    assert [held is not None for _, _, held in stacked._stack.segments] == [True]
    assert tokens_s == tokens
    torch.testing.assert_close(logits_s, logits, rtol=1e-5, atol=1e-5)
    # Layers other than the ones it was built from: not run (the caller loops them).
    assert stacked._stack.run(torch.zeros(1, 1, 8), None, list(stacked.layers)[:2]) is None


def test_stack_op_matches_its_twin(folder) -> None:
    model = load_causal_lm(folder, device="cpu")
    stack = Exl3DecodeStack.of(model.layers, DecoderLayer)
    weights = stack.segments[0][2][0]._replace(windows=(None, 3, None))  # one sliding layer
    config, g = model.config, torch.Generator().manual_seed(3)
    rows, slots_total, dim = 2, 32, config.head_dim
    stores = [torch.randn(slots_total, config.num_kv_heads, dim, generator=g)
              for _ in range(2 * len(model.layers))]
    keys, values = stores[::2], stores[1::2]
    keys_ref, values_ref = [k.clone() for k in keys], [v.clone() for v in values]
    x = torch.randn(rows, config.hidden_size, generator=g)
    angles = torch.rand(rows, dim // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    write = torch.tensor([9, 20])
    history = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [11, 12, 13, 20, 0, 0, 0, 0, 0, 0]])
    lengths = torch.tensor([10, 4])
    got = layer_ops.exl3_decode_stack_cpu(x, weights, cos, sin, keys, values, write, history,
                                          lengths)
    want = layer_ops.exl3_decode_stack_reference(x, weights, cos, sin, keys_ref, values_ref,
                                                 write, history, lengths)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for a, b in zip(keys + values, keys_ref + values_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # the new rows written alike
