"""EXL3 model folders end to end: write (real trellis encoder), read, run, generate.

Tiny random transformers models are quantized with the spec's incoherence transform and
the real Viterbi encoder, written with the folder writer, loaded by `load_causal_lm`
and compared with the original model's logits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from exl3cli.codec.format import Exl3FolderWriter, make_quantization_config
from exl3cli.convert.synthetic import quantize_linear_plain, write_synthetic_model
from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.models.weights import WeightReader
from exl3cli.engine.text.tokenizer import Tokenizer
from tests.fixtures.tiny_model import tiny_reference_model, write_tiny_model

# One layer and a 128-token vocabulary keep the Viterbi work to a few hundred tiles.
SMALL = {"num_hidden_layers": 1, "vocab_size": 128}
ARCH_SETTINGS = {
    "llama": {**SMALL, "hidden_size": 64},
    "qwen2": {**SMALL, "hidden_size": 96},  # qkv bias; 96 is not a multiple of 128
    "qwen3": {**SMALL, "hidden_size": 64},  # q/k norm, head_dim 32
}
LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _is_linear(module: str) -> bool:
    return module == "lm_head" or module.rsplit(".", 1)[-1] in LINEAR_SUFFIXES


def convert_plain(src: Path, out: Path, k_bits: int, head_bits: int,
                  only: tuple[str, ...] | None = None, shard_bytes: int = 2**40) -> Path:
    """Quantize every linear of `src` (or those ending in `only`; the rest stay 16-bit)."""
    reader = WeightReader(src)
    config = json.loads((src / "config.json").read_text())
    writer = Exl3FolderWriter(out, config, shard_bytes)
    for key in reader.keys():
        module, kind = key.rsplit(".", 1)
        if not _is_linear(module):
            writer.add_tensor(key, reader.get(key))
            continue
        if kind != "weight":
            continue  # biases travel with their module
        bias = reader.get(module + ".bias") if reader.has(module + ".bias") else None
        if only is not None and not module.endswith(only):
            writer.add_dense_linear(module, reader.get(key), bias)
            continue
        k = head_bits if module == "lm_head" else k_bits
        tensors = quantize_linear_plain(reader.get(key), k, "mul1", bias, seed=len(module))
        writer.add_linear_tensors(module, tensors)
    writer.close(make_quantization_config(k_bits, head_bits, "mul1"))
    return out


def _correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()


def _logits_correlation(folder: Path, arch: str) -> float:
    reference = tiny_reference_model(arch, **ARCH_SETTINGS[arch])
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = reference(ids).logits.float()
        got = load_causal_lm(folder, device="cpu")(ids)
    assert got.shape == expected.shape
    return _correlation(got, expected)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("src")
    return {arch: write_tiny_model(root / arch, arch, **settings)
            for arch, settings in ARCH_SETTINGS.items()}


@pytest.fixture(scope="module")
def llama8(sources, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("llama8")
    return convert_plain(sources["llama"], out, 8, 8, shard_bytes=60_000)


def test_llama_8bit_logits_match_original(llama8):
    corr = _logits_correlation(llama8, "llama")
    print(f"llama 8-bit logits correlation: {corr:.5f}")
    assert corr > 0.99


@pytest.mark.slow  # ~20-40 s of Viterbi search on a 2-core box
def test_llama_4bit_logits_track_original(sources, tmp_path):
    folder = convert_plain(sources["llama"], tmp_path, 4, 6)
    corr = _logits_correlation(folder, "llama")
    print(f"llama 4-bit (head 6) logits correlation: {corr:.5f}")
    assert corr > 0.95


def test_qwen2_with_bias_and_16bit_mlp(sources, tmp_path):
    # Only q/k/v quantized (the encoder is slow on CPU); MLP and head stay 16-bit.
    folder = convert_plain(sources["qwen2"], tmp_path, 8, 8, only=("q_proj", "k_proj", "v_proj"))
    reader = WeightReader(folder)
    # 16-bit layers: plain float16 .weight in HF orientation (out, in).
    down = reader.get("model.layers.0.mlp.down_proj.weight")
    assert down.dtype == torch.float16 and down.shape == (96, 96)
    assert not reader.has("model.layers.0.mlp.down_proj.trellis")
    assert reader.get("lm_head.weight").shape == (128, 96)
    bias = reader.get("model.layers.0.self_attn.q_proj.bias")
    assert bias.dtype == torch.float16 and bias.shape == (96,)
    assert reader.get("model.layers.0.self_attn.q_proj.trellis").shape == (8, 8, 128)
    corr = _logits_correlation(folder, "qwen2")
    print(f"qwen2 8-bit logits correlation: {corr:.5f}")
    assert corr > 0.99


def test_qwen3_qk_norm(sources, tmp_path):
    folder = convert_plain(sources["qwen3"], tmp_path, 8, 8, only=("q_proj", "k_proj"))
    reader = WeightReader(folder)
    assert reader.get("model.layers.0.self_attn.q_norm.weight").dtype == torch.float16
    assert reader.get("model.layers.0.self_attn.q_proj.trellis").shape == (8, 8, 128)
    corr = _logits_correlation(folder, "qwen3")
    print(f"qwen3 8-bit logits correlation: {corr:.5f}")
    assert corr > 0.99


def _expected_layout(module: str, k: int, hidden: int = 64, inter: int = 96, vocab: int = 128,
                     q: int = 64, kv: int = 32) -> dict[str, tuple[torch.dtype, tuple]]:
    """EXL3-FORMAT.md section 2, written out for the tiny llama."""
    def pad(n: int) -> int:
        return (n + 127) // 128 * 128

    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden), "lm_head": (hidden, vocab)}
    n_in, n_out = shapes[module.rsplit(".", 1)[-1]]
    return {
        f"{module}.trellis": (torch.int16, (pad(n_in) // 16, pad(n_out) // 16, 16 * k)),
        f"{module}.suh": (torch.float16, (pad(n_in),)),
        f"{module}.svh": (torch.float16, (pad(n_out),)),
        f"{module}.mul1": (torch.int32, ()),
    }


def test_written_files_follow_the_spec(llama8):
    index = json.loads((llama8 / "model.safetensors.index.json").read_text())
    found: dict[str, tuple[torch.dtype, tuple]] = {}
    shard_of: dict[str, str] = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(llama8 / shard), "pt") as handle:
            for key in handle.keys():
                tensor = handle.get_tensor(key)
                found[key] = (tensor.dtype, tuple(tensor.shape))
                shard_of[key] = shard
                if key.endswith(".mul1"):
                    assert int(tensor) == -2082680531
    assert len(set(shard_of.values())) > 1
    expected: dict[str, tuple[torch.dtype, tuple]] = {}
    for suffix in LINEAR_SUFFIXES:
        part = "self_attn" if suffix in LINEAR_SUFFIXES[:4] else "mlp"
        expected |= _expected_layout(f"model.layers.0.{part}.{suffix}", 8)
    expected |= _expected_layout("lm_head", 8)
    expected |= {  # float32 source: embeddings and norms stored as float16
        "model.embed_tokens.weight": (torch.float16, (128, 64)),
        "model.norm.weight": (torch.float16, (64,)),
        "model.layers.0.input_layernorm.weight": (torch.float16, (64,)),
        "model.layers.0.post_attention_layernorm.weight": (torch.float16, (64,)),
    }
    assert found == expected
    for key in found:  # no module straddles two shards
        module = key.rsplit(".", 1)[0]
        assert len({shard_of[k] for k in found if k.rsplit(".", 1)[0] == module}) == 1
    config = json.loads((llama8 / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert config["quantization_config"]["quant_method"] == "exl3"
    assert config["quantization_config"]["head_bits"] == 8
    sidecar = json.loads((llama8 / "quantization_config.json").read_text())
    assert sidecar["tensor_storage"]["lm_head"]["bits_per_weight"] == 8


def test_sidecar_and_quantization_config_not_required(llama8, tmp_path):
    folder = Path(shutil.copytree(llama8, tmp_path / "copy"))
    (folder / "quantization_config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(load_causal_lm(folder, device="cpu")(ids),
                                   load_causal_lm(llama8, device="cpu")(ids))


def test_synthetic_tiny_loads_and_generates(tmp_path):
    folder = write_synthetic_model(tmp_path, "tiny", bits=3.5, head_bits=6)
    reader = WeightReader(folder)
    # hidden 192 and intermediate 320 are stored padded to 256 and 384.
    assert reader.get("model.layers.0.mlp.down_proj.trellis").shape == (24, 16, 64)  # K=4
    assert reader.get("model.layers.1.mlp.up_proj.trellis").shape == (16, 24, 48)  # K=3
    assert reader.get("lm_head.trellis").shape == (16, 24, 96)  # vocab 320 -> 384
    tokenizer = Tokenizer.from_folder(folder)
    prompt = tokenizer.encode("Hello, trellis!")
    assert tokenizer.decode(prompt).endswith("Hello, trellis!")
    model = load_causal_lm(folder, device="cpu")
    generator = Generator(model, tokenizer, max_batch=1, num_ctx=64)
    handle = generator.submit(GenerationJob(prompt, {"temperature": 0}, num_predict=6))
    generator.run_until_done()
    tokens = handle.token_ids
    # Greedy decoding with the cache must agree with full forwards without one.
    ids = list(prompt)
    with torch.no_grad():
        for token in tokens:
            assert token == int(model(torch.tensor([ids]))[0, -1].argmax())
            ids.append(token)
    assert len(tokens) >= 1


def _rewrite_signs(src: Path, out: Path, legacy: bool) -> Path:
    """Copy `src` with every suh/svh replaced by its signs: as float16 or as packed bits."""
    reader = WeightReader(src)
    writer = Exl3FolderWriter(out, json.loads((src / "config.json").read_text()))
    for key in reader.keys():
        tensor = reader.get(key)
        module, kind = key.rsplit(".", 1)
        if kind in ("suh", "svh"):
            negative = (tensor < 0).long()
            if legacy:
                words = (negative.view(-1, 16) << torch.arange(16)).sum(1)
                tensor = torch.where(words >= 2**15, words - 2**16, words).to(torch.int16)
                key = f"{module}.{kind[:2]}"
            else:
                tensor = (1.0 - 2.0 * negative).half()
        writer.add_tensor(key, tensor)
    writer.close({})
    shutil.copy(src / "tokenizer.json", out / "tokenizer.json")
    return out


def test_legacy_su_sv_sign_tensors_load(tmp_path):
    src = write_synthetic_model(tmp_path / "src", "tiny", bits=2, head_bits=3)
    modern = _rewrite_signs(src, tmp_path / "modern", legacy=False)
    legacy = _rewrite_signs(src, tmp_path / "legacy", legacy=True)
    assert WeightReader(legacy).has("lm_head.su")
    assert not WeightReader(legacy).has("lm_head.suh")
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        a = load_causal_lm(modern, device="cpu")(ids)
        b = load_causal_lm(legacy, device="cpu")(ids)
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a, b)


def test_trellis_mode_model_matches_dequantized_model(llama8):
    """The on-the-fly path (CUDA's default) gives the logits of the dequantized one."""
    ids = torch.tensor([[7, 8, 9, 10, 11], [1, 2, 3, 4, 5]])
    with torch.no_grad():
        dense = load_causal_lm(llama8, device="cpu")(ids)
        trellis_model = load_causal_lm(llama8, device="cpu", linear_mode="trellis")
        assert trellis_model.lm_head_weight is None  # the head kept its trellis
        on_the_fly = trellis_model(ids)
    torch.testing.assert_close(on_the_fly, dense, rtol=1e-4, atol=1e-4)
