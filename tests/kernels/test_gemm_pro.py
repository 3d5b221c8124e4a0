"""exl3cli.ops.gemm_pro (EXL3_LAYER_FOLD=pro): the fused GEMM that makes its own input.

CPU: the twin (norm_hadamard / glu_hadamard, then gemm_parts) against an independent
PyTorch computation, the fold's name, and a fused layer with the fold on giving the
default's bits. ``cuda``: the one-launch kernel into NaN-poisoned partials gives exactly
the partials of the two launches it replaces (same x bits, same sums), over the 8B and
SmolLM2-sized shapes, every codebook, K = 2..6, float16 and bfloat16, 1..8 rows, split
counts whose runs do and do not start on a 128-column block, and q/k/v parts meeting
inside a block; the generator gives the default's tokens with the fold on.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from exl3cli.codec import block_hadamard, decode_tiles
from exl3cli.convert.synthetic import write_synthetic_model
from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.layers.fused_layer import FusedDecodeLayer
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.text.tokenizer import Tokenizer
from exl3cli.ops import cuda_kernels as kernels
from exl3cli.ops import gemm_pro, layer_fold, layer_kernels
from tests.fixtures.bits import describe_mismatch
from tests.fixtures.fused_shapes import write_fused_shapes

cuda = pytest.mark.cuda
CODEBOOKS = ("mul1", "mcg", "3inst")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _trellises(gen, kb, nbs, k2):
    return [torch.randint(-32768, 32768, (kb, nb, 8 * k2), dtype=torch.int16, generator=gen)
            for nb in nbs]


def _norm_case(rows, cols, width, nbs, k2, dtype, seed, unit_offset=False):
    gen = _gen(seed)
    x = (torch.randn(rows, cols, generator=gen) * 2).to(dtype)
    weight = torch.rand(cols, generator=gen) + 0.5
    pres = [torch.randn(width, generator=gen).sign() for _ in nbs]
    return x, weight, pres, _trellises(gen, width // 16, nbs, k2)


def test_prologue_rounds_every_product_that_meets_an_add():
    # Run 40: ptxas fused kProGlu's act(gate) * up * suh into the Hadamard's first add (an
    # FFMA: no rounding of the product) where glu_hadamard_kernel kept FMUL then FADD, so
    # the two x differed in the last bit. PTX mul/add without .rn may be fused by ptxas,
    # case by case; __fmul_rn / __fadd_rn never are. Every svh, bias and suh term of the
    # element code must go through them.
    text = (kernels.CUDA_DIR / "layer_prologue.cuh").read_text()
    terms = re.findall(r"[^\n;]*\b(?:pre|post_gate|post_up|bias_gate|bias_up)\[c\][^\n;]*", text)
    assert len(terms) >= 6
    for term in terms:
        assert "__fmul_rn(" in term or "__fadd_rn(" in term, term.strip()


def test_fold_name_pro_is_off_in_all():
    assert layer_fold.fold_names("pro") == {"pro"}
    assert layer_fold.fold_names("kv,pro") == {"kv", "pro"}
    assert "pro" not in layer_fold.fold_names("all")


def test_kernel_takes_few_rows_k2_to_6_half_types():
    assert gemm_pro.kernel_takes(1, 8, torch.float16)
    assert gemm_pro.kernel_takes(8, 12, torch.bfloat16)
    assert not gemm_pro.kernel_takes(9, 8, torch.float16)
    assert not gemm_pro.kernel_takes(1, 2, torch.float16)  # K = 1
    assert not gemm_pro.kernel_takes(1, 5, torch.float16)  # K = 2.5
    assert not gemm_pro.kernel_takes(1, 8, torch.float32)


def test_pro_rows_from_the_environment(monkeypatch):
    monkeypatch.delenv("EXL3_PRO_ROWS", raising=False)
    assert gemm_pro.pro_rows() == 8
    monkeypatch.setenv("EXL3_PRO_ROWS", "2")
    assert gemm_pro.pro_rows() == 2
    for bad in ("0", "9", "two", "-1"):
        monkeypatch.setenv("EXL3_PRO_ROWS", bad)
        with pytest.raises(ValueError, match="EXL3_PRO_ROWS"):
            gemm_pro.pro_rows()


@pytest.mark.parametrize("unit_offset", [False, True])
def test_norm_gemm_twin_is_rmsnorm_suh_hadamard_then_the_decoded_product(unit_offset):
    rows, cols, width, k2 = 3, 576, 640, 8
    x, weight, pres, trellises = _norm_case(rows, cols, width, [40, 12], k2, torch.bfloat16, 1)
    got = gemm_pro.norm_gemm(x, weight, 1e-5, unit_offset, pres, width, trellises, k2, "mul1", 1)
    normed = F.rms_norm(x.float(), (cols,), None, 1e-5)
    normed = (normed * weight if unit_offset else normed.to(x.dtype).float() * weight)
    padded = F.pad(normed.to(x.dtype).float(), (0, width - cols))
    for g, pre, t in zip(got, pres, trellises, strict=True):
        xh = block_hadamard(padded * pre, dim=-1).half()
        want = xh.float() @ decode_tiles(t, k2 / 2, "mul1").float()
        assert g.shape == (1, rows, 16 * t.shape[1])
        assert torch.allclose(g[0], want, rtol=1e-4, atol=1e-3)


def test_glu_gemm_twin_is_silu_times_up_suh_hadamard_then_the_product():
    rows, inter, width, k2 = 2, 600, 640, 6
    gen = _gen(2)
    gate, up = (torch.randn(3, rows, width, generator=gen) for _ in range(2))
    post_g, post_u, pre = (torch.randn(width, generator=gen) * 0.3 for _ in range(3))
    (trellis,) = _trellises(gen, width // 16, [8], k2)
    got = gemm_pro.glu_gemm(gate, up, post_g, post_u, None, None, inter, "silu", pre,
                            torch.float16, trellis, k2, "mcg", 1)
    g = (block_hadamard(gate.sum(0), dim=-1) * post_g)[:, :inter].half()
    u = (block_hadamard(up.sum(0), dim=-1) * post_u)[:, :inter].half()
    a = F.pad((F.silu(g) * u).float(), (0, width - inter))
    xd = block_hadamard(a * pre, dim=-1).half()
    want = xd.float() @ decode_tiles(trellis, k2 / 2, "mcg").float()
    assert got.shape == (1, rows, 128)
    assert torch.allclose(got[0], want, rtol=1e-3, atol=1e-2)


def test_pro_fold_gives_the_default_layers_bits_on_cpu(monkeypatch, tmp_path_factory):
    folder = write_fused_shapes(tmp_path_factory, seed=7)["test-hd64"]
    model = load_causal_lm(folder, device="cpu", dtype=torch.bfloat16, linear_mode="trellis")
    ids = torch.tensor([[5, 17, 99]])  # 3 rows: the fold's row range
    results = {}
    for folds in ("", "pro"):
        monkeypatch.setattr(layer_fold, "FOLDS", layer_fold.fold_names(folds))
        plans = [FusedDecodeLayer.of(layer, force=True) for layer in model.layers]
        assert all(p.fold_pro == (folds == "pro") for p in plans)
        step = model._plan_step(1, ids.shape[1])
        hidden = model._embed(ids)
        for plan in plans:
            hidden = plan.forward(hidden, step)
        results[folds] = hidden
    assert torch.equal(results[""], results["pro"])


@pytest.mark.parametrize("limit, taken", [("8", True), ("2", False)])
def test_pro_fold_takes_the_steps_up_to_its_row_limit(monkeypatch, tmp_path_factory, limit,
                                                      taken):
    folder = write_fused_shapes(tmp_path_factory, seed=7)["test-hd64"]
    model = load_causal_lm(folder, device="cpu", dtype=torch.bfloat16, linear_mode="trellis")
    calls = []
    for name in ("norm_gemm", "glu_gemm"):
        real = getattr(gemm_pro, name)
        monkeypatch.setattr(gemm_pro, name, lambda *a, _real=real, _n=name, **k: (
            calls.append(_n), _real(*a, **k))[1])
    monkeypatch.setattr(layer_fold, "FOLDS", layer_fold.fold_names("pro"))
    monkeypatch.setenv("EXL3_PRO_ROWS", limit)
    plans = [FusedDecodeLayer.of(layer, force=True) for layer in model.layers]
    ids = torch.tensor([[5, 17, 99]])
    step = model._plan_step(1, ids.shape[1])
    hidden = model._embed(ids)
    for plan in plans:
        hidden = plan.forward(hidden, step)
    # per layer: q/k/v, o, gate/up (norm_gemm) and down (glu_gemm)
    want = len(plans) * ["norm_gemm", "norm_gemm", "norm_gemm", "glu_gemm"] if taken else []
    assert sorted(calls) == sorted(want)


def _norm_on_cuda(x, weight, pres, trellises, k2, codebook, splits, unit_offset=False):
    """(kernel partials into NaN, the two launches' partials, taken)."""
    rows, width = x.shape[0], 16 * trellises[0].shape[0]
    x, weight = x.cuda(), None if weight is None else weight.cuda()
    pres, trellises = [p.cuda() for p in pres], [t.cuda() for t in trellises]
    got = [torch.full((splits, rows, 16 * t.shape[1]), float("nan"), device="cuda")
           for t in trellises]
    ext = layer_kernels._ext(x)
    taken = ext.gemm_norm(x, weight, 1e-5, unit_offset, pres, trellises, k2,
                          kernels._codebook_id(codebook, k2), got)
    xhs = layer_kernels.norm_hadamard(x, weight, 1e-5, unit_offset, pres, width)
    want = layer_kernels.gemm_parts(xhs, trellises, k2, codebook, splits)
    return got, want, taken


def _assert_bits(got, want):
    for g, w in zip(got, want, strict=True):
        assert not g.isnan().any(), f"{int(g.isnan().sum())} partial elements never written"
        assert torch.equal(g, w), describe_mismatch(g, w, "src")  # split, row, column


@cuda
@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("k2", gemm_pro.PRO_K2)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_norm_gemm_kernel_gives_the_two_launches_bits(codebook, k2, dtype, rows):
    # SmolLM2-ish: 576 columns padded to 640; q/k/v-like parts of 36, 10, 10 tile columns
    # (9 + 3 + 3 column groups: the third block holds warps of two parts, the fourth one
    # warp past the last group; k's and v's last groups are half wide).
    x, weight, pres, trellises = _norm_case(rows, 576, 640, [36, 10, 10], k2, dtype, rows + k2)
    splits = kernels.choose_splits(40, 56, torch.device("cuda"), rows=rows)
    got, want, taken = _norm_on_cuda(x, weight, pres, trellises, k2, codebook, splits,
                                     unit_offset=rows == 3)
    assert taken
    _assert_bits(got, want)
    # and near the PyTorch reference (the twin on CPU: its own sum order, float32 matmul)
    ref = gemm_pro.norm_gemm(x, weight, 1e-5, rows == 3, pres, 640, trellises, k2, codebook, 1)
    for g, r in zip(got, ref, strict=True):
        err = (g.sum(0).cpu() - r[0]).abs().max().item()
        assert err <= 2e-2 * r.abs().max().item()


@cuda
@pytest.mark.parametrize("splits", [1, 3, 5, 7, 40])  # runs of 40, 14, 8, 6, 1 tile rows
def test_norm_gemm_kernel_any_split_run(splits):
    x, weight, pres, trellises = _norm_case(5, 640, 640, [40], 8, torch.float16, splits)
    got, want, taken = _norm_on_cuda(x, weight, pres, trellises, 8, "mul1", splits)
    assert taken
    _assert_bits(got, want)


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_norm_gemm_kernel_without_norm_on_a_strided_input(dtype, rows):
    # The o projection's input (attention's output, no norm): 4096 -> 4096 (8B), taken
    # from a wider tensor so the row stride is not the width.
    x, _, pres, trellises = _norm_case(rows, 4096, 4096, [256], 8, dtype, 40 + rows)
    wide = torch.zeros(rows, 4096 + 64, dtype=dtype)
    wide[:, :4096] = x
    splits = kernels.choose_splits(256, 256, torch.device("cuda"), rows=rows)
    got, want, taken = _norm_on_cuda(wide.cuda()[:, :4096], None, pres, trellises, 8, "mul1",
                                     splits)
    assert taken
    _assert_bits(got, want)


@cuda
@pytest.mark.parametrize("shape", ["qkv", "gate_up"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", range(1, 9))
def test_norm_gemm_kernel_8b_shapes(shape, dtype, rows):
    nbs = [256, 64, 64] if shape == "qkv" else [896, 896]  # 4096 -> 6144, 4096 -> 28672
    x, weight, pres, trellises = _norm_case(rows, 4096, 4096, nbs, 8, dtype, rows)
    splits = kernels.choose_splits(256, sum(nbs), torch.device("cuda"), rows=rows)
    got, want, taken = _norm_on_cuda(x, weight, pres, trellises, 8, "mul1", splits)
    assert taken
    _assert_bits(got, want)


def _glu_case(rows, inter, width, nb, k2, seed):
    gen = _gen(seed)
    gate, up = (torch.randn(4, rows, width, generator=gen) for _ in range(2))
    post_g, post_u, pre = (torch.randn(width, generator=gen) * 0.3 for _ in range(3))
    bias_g, bias_u = (torch.randn(inter, generator=gen) * 0.1 for _ in range(2))
    (trellis,) = _trellises(gen, width // 16, [nb], k2)
    return gate, up, post_g, post_u, bias_g, bias_u, pre, trellis


def _glu_on_cuda(case, inter, act, dtype, k2, codebook, splits):
    gate, up, post_g, post_u, bias_g, bias_u, pre, trellis = (t.cuda() for t in case)
    rows = gate.shape[1]
    got = torch.full((splits, rows, 16 * trellis.shape[1]), float("nan"), device="cuda")
    taken = layer_kernels._ext(gate).gemm_glu(
        gate, up, post_g, post_u, bias_g, bias_u, inter, layer_kernels.ACTIVATIONS[act], pre,
        {torch.float16: 0, torch.bfloat16: 1}[dtype], trellis, k2,
        kernels._codebook_id(codebook, k2), got)
    xd = layer_kernels.glu_hadamard(gate, up, post_g, post_u, bias_g, bias_u, inter, act, pre,
                                    dtype)
    want = layer_kernels.gemm_parts([xd], [trellis], k2, codebook, splits)[0]
    return got, want, taken


@cuda
@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("k2", gemm_pro.PRO_K2)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows", [1, 8])
def test_glu_gemm_kernel_gives_the_two_launches_bits(codebook, k2, dtype, act, rows):
    inter, width = 1480, 1536  # SmolLM2's 1536-wide down input, the last block part padding
    case = _glu_case(rows, inter, width, 36, k2, rows + k2)
    splits = kernels.choose_splits(96, 36, torch.device("cuda"), rows=rows)
    got, want, taken = _glu_on_cuda(case, inter, act, dtype, k2, codebook, splits)
    assert taken
    _assert_bits([got], [want])
    gate, up, post_g, post_u, bias_g, bias_u, pre, trellis = case
    ref = gemm_pro.glu_gemm(gate, up, post_g, post_u, bias_g, bias_u, inter, act, pre, dtype,
                            trellis, k2, codebook, 1)[0]
    assert (got.sum(0).cpu() - ref).abs().max().item() <= 3e-2 * ref.abs().max().item()


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", range(1, 9))
def test_glu_gemm_kernel_8b_down(dtype, rows):
    case = _glu_case(rows, 14336, 14336, 256, 8, rows)  # 14336 -> 4096
    splits = kernels.choose_splits(896, 256, torch.device("cuda"), rows=rows)
    got, want, taken = _glu_on_cuda(case, 14336, "silu", dtype, 8, "mul1", splits)
    assert taken
    _assert_bits([got], [want])


@cuda
def test_gemm_norm_refuses_a_partial_of_the_wrong_shape():
    x, weight, pres, trellises = _norm_case(2, 640, 640, [40], 8, torch.float16, 0)
    bad = [torch.empty(1, 3, 640, device="cuda")]  # 3 rows, x has 2
    with pytest.raises(RuntimeError, match="partial must be float32"):
        layer_kernels._ext(x.cuda()).gemm_norm(
            x.cuda(), weight.cuda(), 1e-5, False, [p.cuda() for p in pres],
            [t.cuda() for t in trellises], 8, 2, bad)


@cuda
def test_gemm_norm_declines_nine_rows_and_the_twin_runs():
    x, weight, pres, trellises = _norm_case(9, 640, 640, [40], 8, torch.float16, 9)
    got, want, taken = _norm_on_cuda(x, weight, pres, trellises, 8, "mul1", 2)
    assert not taken
    via = gemm_pro.norm_gemm(x.cuda(), weight.cuda(), 1e-5, False, [p.cuda() for p in pres],
                             640, [t.cuda() for t in trellises], 8, "mul1", 2)
    _assert_bits(via, want)


@cuda
@pytest.mark.parametrize("cache", ["fp16", "q4"])
def test_generator_with_the_pro_fold_gives_the_same_tokens(tmp_path, monkeypatch, cache):
    folder = write_synthetic_model(tmp_path, "smollm2-135m", bits=4.0, num_layers=2, seed=5)
    tokenizer = Tokenizer.from_folder(folder)
    tokens = {}
    for folds in ("", "pro", "all,pro"):
        monkeypatch.setattr(layer_fold, "FOLDS", layer_fold.fold_names(folds.replace(
            "all,", "kv,combine,norm,")))
        model = load_causal_lm(folder, device="cuda", dtype=torch.float16)
        generator = Generator(model, tokenizer, decode_mode="graph", num_ctx=1024,
                              max_batch=4, kv_cache_type=cache)
        handles = [generator.submit(GenerationJob(list(range(10 + j, 10 + j + 40 + 90 * j)),
                                                  {"temperature": 0}, num_predict=40,
                                                  ignore_eos=True)) for j in range(3)]
        generator.run_until_done()
        tokens[folds] = [h.token_ids for h in handles]
        plans = [layer._fused for layer in model.layers]
        assert all(isinstance(p, FusedDecodeLayer) and p.fold_pro == ("pro" in folds)
                   for p in plans)
        del generator, model
    assert tokens[""] == tokens["pro"] == tokens["all,pro"]
