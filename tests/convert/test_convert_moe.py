"""`exl3 convert` of tiny random Qwen3-MoE and Mixtral models at 4.0 bpw (CPU): every
expert quantized on its own routed rows, named as ExLlamaV3 stores experts, the router
kept at 16 bits, and the folder's logits track the original's."""

from __future__ import annotations

import pytest
import torch

from exl3cli.convert.hessian import HessianAccumulator
from exl3cli.convert.moe_layer import pooled_hessian
from exl3cli.convert.pipeline import ConvertOptions, convert_model
from exl3cli.engine.layers.linear import Exl3Linear
from exl3cli.engine.layers.moe import MoEMLP
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.models.weights import WeightReader
from tests.fixtures.convert_checks import eval_ids, logit_corr
from tests.fixtures.tiny_store import write_tiny_chat_model

FAST = ConvertOptions(bits=4.0, head_bits=16, rows=8, cols=128, scale_search_tiles=4,
                      device="cpu")
EXPERT = {
    "qwen3_moe": "model.layers.{i}.mlp.experts.{e}.{p}",
    "mixtral": "model.layers.{i}.block_sparse_moe.experts.{e}.{p}",
}
PARTS = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}
# Mixtral's experts as narrow as Qwen3-MoE's (32).
OVERRIDES = {"qwen3_moe": {"norm_topk_prob": True}, "mixtral": {"intermediate_size": 32}}
# Measured at 4.0 bpw with every group at 4 bits: Qwen3-MoE 0.9922, Mixtral 0.9877 (the
# 4-bit attention changes 3.5-10% of the expert choices; the experts' own error and the
# 16-bit router cost little, more calibration rows nothing: allocation.py); with
# attention at 6 bits paid by the gate/up experts at 3: Qwen3-MoE 0.9969, Mixtral 0.9936.
MIN_CORRELATION = {"qwen3_moe": 0.99, "mixtral": 0.99}
ROUTER = {"qwen3_moe": "model.layers.{i}.mlp.gate",
          "mixtral": "model.layers.{i}.block_sparse_moe.gate"}


@pytest.fixture(scope="module", params=sorted(EXPERT))
def converted(request, tmp_path_factory) -> dict:
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    overrides = OVERRIDES[arch]
    src = write_tiny_chat_model(root / "src", arch, **overrides)
    events: list = []
    summary = convert_model(src, root / "out", FAST, root / "work", progress=events.append)
    return {"arch": arch, "src": src, "out": root / "out", "summary": summary,
            "events": events}


def _held_out_ids(src) -> torch.Tensor:
    return eval_ids(src)



def test_logits_correlate_with_original(converted):
    ids = _held_out_ids(converted["src"])
    original = load_causal_lm(converted["src"], device="cpu")
    expected = original(ids)
    corr = logit_corr(load_causal_lm(converted["out"], device="cpu")(ids), expected)
    assert corr > MIN_CORRELATION[converted["arch"]], f"{converted['arch']}: {corr:.4f}"
    assert logit_corr(original(ids.flip(1)), expected) < 0.9  # the check can fail


def test_attention_gets_two_more_bits_paid_by_the_experts(converted):
    for report in converted["summary"].layers:
        assert report.bits == {"qkv": 6, "o": 6, "gate_up": 3, "down": 4}
    assert converted["summary"].average_bits <= 4.0


def test_every_expert_is_quantized_under_its_own_name(converted):
    arch, reader = converted["arch"], WeightReader(converted["out"])
    for i in range(2):
        for e in range(4):
            for part, bits in zip(PARTS[arch], (3, 3, 4), strict=True):  # gate, up, down
                name = EXPERT[arch].format(i=i, e=e, p=part)
                assert reader.has(name + ".trellis") and not reader.has(name + ".weight")
                assert reader.get(name + ".trellis").shape[-1] == 16 * bits
        router = ROUTER[arch].format(i=i)
        assert reader.get(router + ".weight").dtype == torch.float16  # kept at 16 bits
    model = load_causal_lm(converted["out"], device="cpu", linear_mode="trellis")
    moe = model.layers[1].mlp
    assert isinstance(moe, MoEMLP) and isinstance(moe.experts[2].down, Exl3Linear)


def test_per_expert_token_counts_are_reported(converted):
    reports = converted["summary"].layers
    rows = FAST.rows * FAST.cols  # calibration tokens; each goes to 2 experts
    for report in reports:
        assert report.expert_tokens is not None and len(report.expert_tokens) == 4
        assert sum(report.expert_tokens) == 2 * rows
    line = next(e for e in converted["events"] if not isinstance(e, str)).line(2)
    assert "expert tokens" in line
    assert "expert calibration tokens" in converted["summary"].table()


def test_an_expert_with_few_rows_is_topped_up_with_the_pool():
    gen = torch.Generator().manual_seed(0)
    features = 32
    pool_rows = torch.randn(400, features, generator=gen)
    pool = HessianAccumulator(features)
    pool.add(pool_rows)
    few = pool_rows[:5] * 3
    h = pooled_hessian(few, pool.hessian(), features)
    # Full rank although 5 rows span 5 dimensions; the 5 rows still weigh in.
    assert torch.linalg.matrix_rank(h) == features
    expected = (few.double().T @ few.double() + 27 * pool.hessian()) / 32
    assert torch.allclose(h, expected, atol=1e-6)
    # No rows at all: the pool; enough rows: the expert's own Hessian.
    assert torch.allclose(pooled_hessian(None, pool.hessian(), features), pool.hessian())
    own = pooled_hessian(pool_rows[:100], pool.hessian(), features)
    assert torch.allclose(own, pool_rows[:100].double().T @ pool_rows[:100].double() / 100,
                          atol=1e-5)


def test_resume_reuses_the_layers_and_writes_the_same_folder(converted, tmp_path):
    """A resumed run reads each layer's checkpoint (expert counts included)."""
    root = converted["out"].parent
    summary = convert_model(converted["src"], tmp_path / "again", FAST, root / "work",
                            resume=True)
    assert all(r.resumed for r in summary.layers)
    assert [r.expert_tokens for r in summary.layers] == [
        r.expert_tokens for r in converted["summary"].layers]
    first, second = WeightReader(converted["out"]), WeightReader(tmp_path / "again")
    name = EXPERT[converted["arch"]].format(i=1, e=3, p=PARTS[converted["arch"]][2])
    assert torch.equal(first.get(name + ".trellis"), second.get(name + ".trellis"))

