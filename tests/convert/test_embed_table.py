"""Trellis-quantized embedding tables (`exl3 convert --embed-bits`), ExLlamaV3's layout.

`tests/data/embed-table/table-vectors.safetensors`: random packed tables (6 rows of
300 values, 2 groups, K = 1..8) decoded by ExLlamaV3 1.6.5's own Python decoder
(`ngram_codec.dequant_rows`, as its `TableEmbedding` calls it on a CPU), with the
states it unpacked; see the README next to it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from exl3cli.cli.convert import convert
from exl3cli.codec.format import read_quantization_config
from exl3cli.codec.table import decode_table, pack_rings, table_k_bits, table_words, unpack_rings
from exl3cli.convert.embed_quant import quantize_table
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.models.weights import WeightReader
from exl3cli.errors import ModelLoadError
from tests.fixtures.convert_checks import eval_ids, logit_corr
from tests.fixtures.tiny_store import write_tiny_chat_model

VECTORS = Path(__file__).resolve().parents[1] / "data" / "embed-table" / "table-vectors.safetensors"
FAST = ["-b", "4.0", "--head-bits", "6", "--calib-rows", "8", "--calib-cols", "128",
        "--scale-search-tiles", "4"]
EMBED = "model.embed_tokens"


@pytest.mark.parametrize("k", range(1, 9))
def test_decode_matches_exllamav3(k):
    v = load_file(str(VECTORS))
    trellis, signs = v[f"K{k}.trellis"], v[f"K{k}.signs"]
    assert table_k_bits(trellis, signs) == k
    states, scales = unpack_rings(trellis.reshape(-1, table_words(k)), k)
    assert torch.equal(states.view(6, 2, 256), v[f"K{k}.states"].long())
    decoded = decode_table(trellis, signs, 300)
    # The same float16 values up to the rounding of the rotation (one unit in the last place).
    assert torch.allclose(decoded.float(), v[f"K{k}.decoded"].float(), rtol=2e-3, atol=1e-6)
    assert torch.equal(pack_rings(states, scales, k).view(trellis.shape), trellis)
    # A different table does not decode the same: the check can fail.
    assert not torch.allclose(decode_table(trellis.flip(0), signs, 300).float(),
                              v[f"K{k}.decoded"].float(), rtol=2e-3, atol=1e-6)


def test_bad_table_shapes_are_refused():
    v = load_file(str(VECTORS))
    with pytest.raises(ModelLoadError, match="rings of 1 \\+ 16\\*K"):
        table_k_bits(v["K3.trellis"][:, :-1], v["K3.signs"])
    with pytest.raises(ModelLoadError, match="signs must be"):
        table_k_bits(v["K3.trellis"], v["K3.signs"][:, :128])


def test_quantized_table_error_is_near_the_rate_bound():
    torch.manual_seed(0)
    weight = torch.randn(48, 200) * 0.03
    errors = {}
    for k in (3, 4):
        table = quantize_table(weight, k, name=EMBED)
        assert table.tensors["trellis"].shape == (48, table_words(k))
        assert table.tensors["signs"].shape == (1, 256)
        assert torch.equal(table.decoded, decode_table(table.tensors["trellis"],
                                                       table.tensors["signs"], 200))
        errors[k] = table.error
    # Distortion-rate bound 4^-K (EXL3-FORMAT.md 5): 0.0156 at 3 bits, 0.0039 at 4.
    assert errors[3] < 1.3 * 4.0**-3 and errors[4] < 1.3 * 4.0**-4
    with pytest.raises(ValueError, match="1..8"):
        quantize_table(weight, 9)


def test_table_split_into_shards_reads_as_one(tmp_path):
    v = load_file(str(VECTORS))
    trellis, signs = v["K4.trellis"], v["K4.signs"]
    save_file({f"{EMBED}.shard_0.trellis": trellis[:4].clone(),
               f"{EMBED}.shard_1.trellis": trellis[4:].clone(), f"{EMBED}.signs": signs},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"hidden_size": 300}')
    reader = WeightReader(tmp_path)
    assert reader.has(f"{EMBED}.weight") and f"{EMBED}.weight" in reader.keys()
    table = reader.get(f"{EMBED}.weight", dtype=torch.float32)
    assert table.shape == (6, 300)
    assert torch.allclose(table, v["K4.decoded"].float(), rtol=2e-3, atol=1e-6)


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embed")
    src = write_tiny_chat_model(tmp / "src", "llama")
    out = tmp / "out"
    result = CliRunner().invoke(
        convert, [str(src), *FAST, "--embed-bits", "4", "--out", str(out),
                  "--work", str(tmp / "work")],
        env={"EXL3_MODELS": str(tmp / "store")}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return tmp, src, out, result.output


def test_embed_bits_write_exllamav3s_tensors(embedded):
    _, src, out, output = embedded
    reader = WeightReader(out)
    trellis, signs = reader.get(f"{EMBED}.trellis"), reader.get(f"{EMBED}.signs")
    # vocab 400, hidden 64: one 256-wide group per row, 1 + 16 * 4 words.
    assert trellis.dtype == torch.int16 and tuple(trellis.shape) == (400, 65)
    assert signs.dtype == torch.float16 and tuple(signs.shape) == (1, 256)
    assert set(signs.unique().tolist()) == {-1.0, 1.0}
    assert f"{EMBED}.weight" not in reader._file_of  # no unquantized copy is stored
    source = WeightReader(src).get(f"{EMBED}.weight", dtype=torch.float32)
    decoded = reader.get(f"{EMBED}.weight", dtype=torch.float32)
    error = float((decoded - source).pow(2).sum() / source.pow(2).sum())
    assert error < 1.3 * 4.0**-4, error
    assert read_quantization_config(out)["embed_bits"] == 4
    assert "embed    4  error" in output


def test_quantized_embedding_loads_like_its_decoded_table(embedded, tmp_path):
    tmp, src, out, _ = embedded
    # The dequantized reference: the same folder with the table stored decoded, dense.
    dense = tmp_path / "dense"
    dense.mkdir()
    for path in out.iterdir():
        if path.suffix != ".safetensors":
            (dense / path.name).write_bytes(path.read_bytes())
    tensors = load_file(str(out / "model.safetensors"))
    table = WeightReader(out).get(f"{EMBED}.weight")
    del tensors[f"{EMBED}.trellis"], tensors[f"{EMBED}.signs"]
    save_file({**tensors, f"{EMBED}.weight": table}, str(dense / "model.safetensors"))
    ids = eval_ids(src)
    quantized = load_causal_lm(out, "cpu")(ids)
    reference = load_causal_lm(dense, "cpu")(ids)
    assert torch.allclose(quantized, reference, rtol=1e-4, atol=1e-4)
    assert logit_corr(quantized, load_causal_lm(src, "cpu")(ids)) > 0.98


def test_written_recipe_carries_the_embedding_and_feeds_back_identically(embedded):
    tmp, src, out, _ = embedded
    import json

    recipe = json.loads((out / "exl3-recipe.json").read_text())["bits"]
    assert recipe[EMBED] == 4
    again = tmp / "again"
    result = CliRunner().invoke(
        convert, [str(src), *FAST, "--recipe", str(out / "exl3-recipe.json"), "--out",
                  str(again), "--work", str(tmp / "work-again")],
        env={"EXL3_MODELS": str(tmp / "store")}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    for name in files:
        assert (out / name).read_bytes() == (again / name).read_bytes(), name


def test_embed_bits_outside_the_range_are_refused(tmp_path):
    result = CliRunner().invoke(convert, ["nowhere", "-b", "4", "--embed-bits", "12",
                                          "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "--embed-bits" in result.output
