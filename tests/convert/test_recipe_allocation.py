"""Recipes, the measured knapsack, the error estimate behind it, and `convert --recipe`."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from exl3cli.cli.convert import convert
from exl3cli.codec.format import read_quantization_config
from exl3cli.convert.hessian import HessianAccumulator, proxy_error
from exl3cli.convert.knapsack import CODEC_MSE, TensorCost, allocate_measured, expected_error
from exl3cli.convert.quantize_layer import QuantSettings, quantize_group, quantize_mixed
from exl3cli.convert.recipe import load_recipe, parse_recipe, resolve, write_recipe
from exl3cli.convert.sensitivity import predicted_error
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.models.weights import WeightReader
from exl3cli.errors import ConversionError
from tests.fixtures.tiny_store import write_tiny_chat_model

NAMES = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj",
         "model.layers.1.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"]


def test_recipe_later_entries_override_and_yaml_json_agree(tmp_path):
    (tmp_path / "r.yaml").write_text('"*": 4\n"*.mlp.*": 5\nmodel.layers.1.*: 16\n'
                                     "lm_head: 8\n")
    (tmp_path / "r.json").write_text(json.dumps(
        {"bits": [["*", 4], ["*.mlp.*", 5], ["model.layers.1.*", 16], ["lm_head", 8]]}))
    a, b = load_recipe(tmp_path / "r.yaml"), load_recipe(tmp_path / "r.json")
    assert a == b
    assert resolve(a, NAMES) == {NAMES[0]: 4, NAMES[1]: 5, NAMES[2]: 16, NAMES[3]: 16,
                                 "lm_head": 8}
    # order matters: the catch-all last wins everywhere
    assert set(resolve(parse_recipe({"*.mlp.*": 5, "*": 3}), NAMES).values()) == {3}


@pytest.mark.parametrize("text, message", [
    ('{"*": 9}', "bits must be one of"),
    ('{"*": 4.5}', "bits must be one of"),
    ('{"*": true}', "bits must be one of"),
    ("[1, 2]", "pattern, bits"),
    ("{}", "no entries"),
    ("{nope", "not valid JSON"),
])
def test_bad_recipes_are_refused_clearly(tmp_path, text, message):
    path = tmp_path / "r.json"
    path.write_text(text)
    with pytest.raises(ConversionError, match=message):
        load_recipe(path)


def test_written_recipe_reads_back(tmp_path):
    bits = {n: 3 + i for i, n in enumerate(NAMES)}
    write_recipe(tmp_path / "out.json", bits, note="hello")
    assert resolve(load_recipe(tmp_path / "out.json"), NAMES) == bits


def _items() -> list[TensorCost]:
    # (name, weights, cost): a small important tensor, a big cheap one, two in between.
    return [TensorCost("a", 1000, 50.0), TensorCost("b", 8000, 1.0),
            TensorCost("c", 2000, 4.0), TensorCost("d", 2000, 4.0)]


@pytest.mark.parametrize("bpw", [2.0, 2.5, 3.0, 4.0, 5.0])
def test_knapsack_meets_the_budget_and_beats_uniform(bpw):
    items = _items()
    bits = allocate_measured(items, bpw)
    total = sum(t.weights for t in items)
    assert sum(t.weights * bits[t.name] for t in items) <= bpw * total + 1e-6
    # It spends what it can: no tensor below the cap would still fit in what is left.
    left = bpw * total - sum(t.weights * bits[t.name] for t in items)
    assert all(t.weights > left for t in items if bits[t.name] < int(bpw + 0.5) + 2)
    # equal tensors differ by at most the last step the budget allowed one of them
    assert bits["a"] >= max(bits["c"], bits["d"]) and min(bits["c"], bits["d"]) >= bits["b"]
    assert abs(bits["c"] - bits["d"]) <= 1
    if bpw.is_integer():
        uniform = {t.name: int(bpw) for t in items}
        assert expected_error(items, bits) < expected_error(items, uniform)


def test_knapsack_keeps_fixed_tensors_and_excludes_kept_ones():
    items = _items()
    bits = allocate_measured(items, 3.0, fixed={"a": 2, "b": 16})
    assert bits["a"] == 2 and bits["b"] == 16
    # budget 3.0 x (1000 + 2000 + 2000), a takes 2000 bits: c and d share 13000
    assert 2000 * (bits["c"] + bits["d"]) <= 13000 and bits["c"] + bits["d"] == 6
    with pytest.raises(ConversionError, match="leave"):
        allocate_measured(items, 2.0, fixed={"b": 8})


def test_group_unit_gives_a_group_one_k_unless_the_recipe_splits_it():
    from types import SimpleNamespace

    from exl3cli.convert.allocation_plan import _by_group

    mods = {"qkv": ["q", "k", "v"], "o": ["o"]}
    conv = SimpleNamespace(config=SimpleNamespace(num_layers=1), layer_modules=lambda i: mods)
    costs, sizes = {"q": 1, "k": 50, "v": 50, "o": 2}, {"q": 100, "k": 50, "v": 50, "o": 100}
    bits = _by_group(conv, costs, sizes, 3.0, {})
    assert bits["q"] == bits["k"] == bits["v"] and sum(bits[m] * sizes[m] for m in bits) <= 900
    assert allocate_measured([TensorCost(m, sizes[m], costs[m]) for m in costs], 3.0)["q"] < \
        allocate_measured([TensorCost(m, sizes[m], costs[m]) for m in costs], 3.0)["k"]
    split = _by_group(conv, costs, sizes, 3.0, {"q": 16})
    assert split["q"] == 16 and split["k"] == split["v"] > split["o"]


def test_predicted_error_matches_a_trial_quantization():
    """The allocation's estimate of the H-weighted output error, D(K)·tr(D_rot)·side²,
    against the error the quantizer actually makes, on correlated inputs."""
    torch.manual_seed(3)
    mix = torch.randn(256, 256) / 16
    x = torch.randn(2048, 256) @ (torch.eye(256) + mix) * torch.linspace(0.2, 3.0, 256)
    acc = HessianAccumulator(256)
    acc.add(x)
    h = acc.hessian()
    weights = [torch.randn(256, 128) * torch.linspace(0.5, 2, 128), torch.randn(256, 256)]
    names = ["t.q", "t.v"]
    per_col = predicted_error(h, names, weights, seed=0, damping=0.02)
    for k in (2, 3, 4):
        done = quantize_group(names, weights, [None, None], h, QuantSettings(k, seed=0))
        for w, q, pred in zip(weights, done, per_col, strict=True):
            actual = proxy_error(h, w, q.weight) * float((w.double() * (h @ w.double())).sum())
            ratio = CODEC_MSE[k] * float(pred.sum()) / actual
            assert 0.75 < ratio < 1.35, (k, ratio)


def test_mixed_bits_quantize_each_tensor_at_its_own_k():
    torch.manual_seed(0)
    x = torch.randn(512, 128)
    h = x.T @ x / 512
    weights = [torch.randn(128, 128), torch.randn(128, 128), torch.randn(128, 128)]
    done = quantize_mixed(["a", "b", "c"], weights, [None] * 3, h, QuantSettings(3), [2, 4, 2])
    assert [q.name for q in done] == ["a", "b", "c"]
    assert [q.tensors["trellis"].shape[-1] for q in done] == [32, 64, 32]  # 16*K words
    assert done[1].proxy_error < done[0].proxy_error / 4


FAST = ["--head-bits", "6", "--calib-rows", "8", "--calib-cols", "128",
        "--scale-search-tiles", "4"]


def _convert(tmp_path, src, name, *args):
    result = CliRunner().invoke(
        convert, [str(src), *FAST, *args, "--out", str(tmp_path / name),
                  "--work", str(tmp_path / f"work-{name}")],
        env={"EXL3_MODELS": str(tmp_path / "store")}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return tmp_path / name, result.output


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recipe")
    src = write_tiny_chat_model(tmp / "src", "llama")
    # A recipe keeps layer 1's MLP unquantized; the rest shares 3.0 bpw by measurement.
    (tmp / "keep.yaml").write_text('"model.layers.1.mlp.*": 16\n')
    out, output = _convert(tmp, src, "measured", "-b", "3.0", "--recipe", str(tmp / "keep.yaml"))
    return tmp, src, out, output


def test_measured_conversion_reports_bits_per_tensor(measured):
    _, src, out, output = measured
    qconfig = read_quantization_config(out)
    bits = qconfig["tensor_bits"]
    assert len(bits) == 14 and bits["model.layers.1.mlp.down_proj"] == 16
    assert qconfig["bits"] <= 3.0
    assert "bits per tensor" in output and "bits chosen by: measurement and recipe" in output
    assert len({b for b in bits.values() if b <= 8}) > 1  # measured, not uniform
    reader = WeightReader(out)
    for name, b in bits.items():
        if b == 16:  # kept exactly (float16) as the source has it
            kept = reader.get(name + ".weight")
            assert torch.equal(kept, WeightReader(src).get(name + ".weight").to(kept.dtype))
        else:
            assert reader.get(name + ".trellis").shape[-1] == 16 * b
    ids = torch.randint(0, 400, (2, 32))
    assert torch.isfinite(load_causal_lm(out, "cpu")(ids)).all()


def test_written_recipe_fed_back_gives_identical_files(measured):
    tmp, src, out, _ = measured
    again, output = _convert(tmp, src, "again", "--recipe", str(out / "exl3-recipe.json"))
    assert "bits chosen by: recipe" in output
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    for name in files:
        assert (out / name).read_bytes() == (again / name).read_bytes(), name


def test_recipe_errors_are_one_line(measured, tmp_path):
    _, src, _, _ = measured
    (tmp_path / "bad.json").write_text('{"model.layers.7.*": 4}')
    result = CliRunner().invoke(convert, [str(src), "-b", "3", "--recipe",
                                          str(tmp_path / "bad.json"), "--out", str(tmp_path / "o"),
                                          "--work", str(tmp_path / "w")],
                                env={"EXL3_MODELS": str(tmp_path / "store")})
    assert result.exit_code != 0 and "match no tensor" in str(result.exception or result.output)
    (tmp_path / "part.json").write_text('{"*.q_proj": 4}')
    result = CliRunner().invoke(convert, [str(src), "--recipe", str(tmp_path / "part.json"),
                                          "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w")],
                                env={"EXL3_MODELS": str(tmp_path / "store")})
    assert result.exit_code != 0 and "without bits" in str(result.exception or result.output)
    result = CliRunner().invoke(convert, [str(src), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "-b BPW" in result.output
