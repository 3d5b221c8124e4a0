"""GGUF LoRA adapters (llama.cpp's convert_lora_to_gguf layout) become PEFT folders
that give the same logits as the PEFT adapter they were made from."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from exl3cli.engine.adapters.lora import AdapterBank
from exl3cli.engine.adapters.peft import read_peft_adapter
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.errors import AdapterError
from exl3cli.gguf.lora import gguf_lora_to_peft
from tests.engine.test_lora import IDS, make_adapter
from tests.fixtures.tiny_gguf import gguf_name, llama_cpp_permute
from tests.fixtures.tiny_model import tiny_reference_model, write_tiny_model

HEADS, KV_HEADS = 4, 2  # tiny_model's BASE_CONFIG


def write_gguf_lora(peft_folder, path, alpha: float, arch: str = "llama",
                    kind: str = "adapter") -> None:
    """The PEFT adapter as llama.cpp's converter writes it: base tensor names +
    .lora_a/.lora_b, lora_b of q/k with their rows in llama.cpp's rope order."""
    import gguf

    tensors = load_file(str(peft_folder / "adapter_model.safetensors"))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string("general.type", kind)
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for key, value in sorted(tensors.items()):
        module = key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        half = "a" if ".lora_A." in key else "b"
        if half == "b" and module.endswith("q_proj"):
            value = llama_cpp_permute(value, HEADS)
        elif half == "b" and module.endswith("k_proj"):
            value = llama_cpp_permute(value, KV_HEADS)
        writer.add_tensor(f"{gguf_name(module + '.weight')}.lora_{half}",
                          value.float().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_lora_gives_the_peft_logits(tmp_path):
    reference = tiny_reference_model("llama")
    peft_folder = make_adapter(reference, tmp_path / "peft", seed=1, rank=4, alpha=8.0)
    write_gguf_lora(peft_folder, tmp_path / "lora.gguf", alpha=8.0)
    converted = gguf_lora_to_peft(tmp_path / "lora.gguf", tmp_path / "converted", "g",
                                  HEADS, KV_HEADS)
    model = load_causal_lm(write_tiny_model(tmp_path / "model", "llama"), device="cpu",
                           dtype=torch.float32)
    bank = AdapterBank.of(model)
    bank.load(read_peft_adapter(peft_folder, "peft"))
    bank.load(read_peft_adapter(converted, "gguf"))
    bank.select("peft", IDS.numel())
    expected = model(IDS)
    bank.select("gguf", IDS.numel())
    assert (model(IDS) - expected).abs().max().item() < 1e-5


def test_what_is_not_a_gguf_lora_is_refused(tmp_path):
    reference = tiny_reference_model("llama")
    peft_folder = make_adapter(reference, tmp_path / "peft", seed=1, targets=["q_proj"])
    write_gguf_lora(peft_folder, tmp_path / "model.gguf", 8.0, kind="model")
    with pytest.raises(AdapterError, match="adapter m: this GGUF file is not a LoRA adapter"):
        gguf_lora_to_peft(tmp_path / "model.gguf", tmp_path / "o1", "m", HEADS, KV_HEADS)
    write_gguf_lora(peft_folder, tmp_path / "phi.gguf", 8.0, arch="phi2")
    with pytest.raises(AdapterError, match="adapter p: GGUF architecture 'phi2' is not "
                                           "supported"):
        gguf_lora_to_peft(tmp_path / "phi.gguf", tmp_path / "o2", "p", HEADS, KV_HEADS)
