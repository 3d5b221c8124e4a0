"""LoRA adapters (engine/adapters/lora.py, engine/adapters/peft.py) against transformers + peft.

Random adapters are made with `peft` on tiny random models and saved as PEFT folders;
the engine's logits with the adapter match transformers + peft (float32, max abs diff
< 1e-3) on the dense model and on its EXL3 conversion (against the dequantized base +
the same adapter). Rows of one forward may each use another adapter or none.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from exl3cli.codec.dequant import dequantize_linear
from exl3cli.codec.format import read_exl3_linear
from exl3cli.engine.adapters.lora import AdaptedLinear, AdapterBank
from exl3cli.engine.adapters.peft import read_peft_adapter
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.models.weights import WeightReader
from exl3cli.errors import AdapterError
from tests.engine.test_exl3_model import convert_plain
from tests.fixtures.tiny_model import tiny_reference_model, write_tiny_model

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(reference: torch.nn.Module, folder: Path, seed: int, *, rank: int = 4,
                 alpha: float = 8.0, targets: list[str] = ALL, rslora: bool = False) -> Path:
    """A random ("trained-looking": B is not zero) PEFT LoRA adapter on `reference`,
    saved to `folder`. `reference` is left as it was."""
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                             lora_dropout=0.0, use_rslora=rslora, init_lora_weights=False)
    model = peft.get_peft_model(_copy(reference), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    model.save_pretrained(folder)
    return folder


def _copy(model: torch.nn.Module) -> torch.nn.Module:
    clone = type(model)(model.config).eval()
    clone.load_state_dict(model.state_dict())
    return clone


def peft_logits(reference: torch.nn.Module, adapter: Path | None, ids: torch.Tensor) -> torch.Tensor:
    model = _copy(reference)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter)).eval()
    with torch.no_grad():
        return model(ids).logits.float()


def engine_logits(model, adapter: str | None, ids: torch.Tensor) -> torch.Tensor:
    AdapterBank.of(model).select(adapter, ids.numel())
    return model(ids)


IDS = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("arch,targets,rslora", [
    ("llama", ALL, False),
    ("llama", ["q_proj", "v_proj"], True),
    ("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], False),  # fused modules
    ("glm4", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"], False),
    # glm4: partial rotary (q/k outputs permuted by the loader), gate|up stored fused
])
def test_dense_logits_match_peft(tmp_path, arch, targets, rslora):
    reference = tiny_reference_model(arch)
    folder = write_tiny_model(tmp_path / "model", arch)
    adapter = make_adapter(reference, tmp_path / "lora", seed=1, targets=targets, rslora=rslora)
    model = load_causal_lm(folder, device="cpu", dtype=torch.float32)
    bare = model(IDS)
    AdapterBank.of(model).load(read_peft_adapter(adapter, "mine"))
    got = engine_logits(model, "mine", IDS)
    expected = peft_logits(reference, adapter, IDS)
    assert (got - expected).abs().max().item() < 1e-3
    assert (got - bare).abs().max().item() > 0.1  # the adapter does change the logits
    # Rows without an adapter are the bare model's.
    assert torch.equal(engine_logits(model, None, IDS), bare)
    AdapterBank.of(model).unload("mine")
    assert not any(isinstance(m, AdaptedLinear) for m in model.modules())
    assert torch.equal(model(IDS), bare)


def test_rows_of_one_forward_use_their_own_adapters(tmp_path):
    reference = tiny_reference_model("llama")
    folder = write_tiny_model(tmp_path / "model", "llama")
    first = make_adapter(reference, tmp_path / "a", seed=1)
    second = make_adapter(reference, tmp_path / "b", seed=2, rank=8, targets=["q_proj", "down_proj"])
    model = load_causal_lm(folder, device="cpu", dtype=torch.float32)
    bank = AdapterBank.of(model)
    bank.load(read_peft_adapter(first, "a"))
    bank.load(read_peft_adapter(second, "b"))
    ids = IDS[:1].expand(3, -1).contiguous()
    bank.select_rows(["a", None, "b"], [ids.shape[1]] * 3)
    mixed = model(ids)
    expected = [peft_logits(reference, first, ids[:1]), peft_logits(reference, None, ids[:1]),
                peft_logits(reference, second, ids[:1])]
    for row, want in enumerate(expected):
        assert (mixed[row] - want[0]).abs().max().item() < 1e-3


def _dequantized_state_dict(folder: Path, reference: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The EXL3 folder's weights as a transformers state dict (linears dequantized)."""
    reader = WeightReader(folder)
    state = {}
    for key, value in reference.state_dict().items():
        module = key.removesuffix(".weight")
        found = read_exl3_linear(reader, module) if key.endswith(".weight") else None
        if found is not None:
            out_features, in_features = value.shape
            state[key] = dequantize_linear(found, in_features, out_features).t().contiguous()
        else:
            state[key] = reader.get(key).float()
    return state


def test_exl3_logits_match_peft_on_dequantized_base(tmp_path):
    settings = {"num_hidden_layers": 1, "vocab_size": 128}
    reference = tiny_reference_model("llama", **settings)
    source = write_tiny_model(tmp_path / "model", "llama", **settings)
    exl3 = convert_plain(source, tmp_path / "exl3", 2, 2)
    assert WeightReader(exl3).has("model.layers.0.self_attn.q_proj.trellis")
    dequantized = _copy(reference)
    dequantized.load_state_dict(_dequantized_state_dict(exl3, reference))
    adapter = make_adapter(reference, tmp_path / "lora", seed=4)
    model = load_causal_lm(exl3, device="cpu", dtype=torch.float32)
    AdapterBank.of(model).load(read_peft_adapter(adapter, "mine"))
    ids = IDS % 128
    got = engine_logits(model, "mine", ids)
    assert (got - peft_logits(dequantized, adapter, ids)).abs().max().item() < 1e-3
    assert (got - peft_logits(dequantized, None, ids)).abs().max().item() > 0.1


# ---- adapters that do not fit are refused, naming the adapter and the mismatch ---------

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    return tiny_reference_model("llama"), load_causal_lm(
        write_tiny_model(root / "model", "llama"), device="cpu", dtype=torch.float32)


def _edit_config(folder: Path, **changes) -> Path:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    return folder


def test_adapter_for_another_base_is_refused(llama, tmp_path):
    wide = tiny_reference_model("llama", hidden_size=96)
    adapter = make_adapter(wide, tmp_path / "wide", seed=1)
    with pytest.raises(AdapterError, match=r"adapter wide: shape mismatch at "
                                           r"model\.layers\.0\..*96.*64"):
        AdapterBank.of(llama[1]).load(read_peft_adapter(adapter, "wide"))
    assert "wide" not in AdapterBank.of(llama[1])


def test_adapter_of_another_architecture_is_refused(llama, tmp_path):
    phi = tiny_reference_model("phi3")
    adapter = make_adapter(phi, tmp_path / "phi", seed=1, targets=["qkv_proj"])
    with pytest.raises(AdapterError, match="adapter phi: target_modules names qkv_proj"):
        AdapterBank.of(llama[1]).load(read_peft_adapter(adapter, "phi"))
    _edit_config(adapter, target_modules=".*qkv_proj")  # a regex: the tensors tell
    with pytest.raises(AdapterError, match=r"adapter phi: targets model\.layers\.0\.self_attn"
                                           r"\.qkv_proj.*does not have as an adaptable projection"):
        AdapterBank.of(llama[1]).load(read_peft_adapter(adapter, "phi"))


def test_unknown_target_modules_are_refused(llama, tmp_path):
    adapter = make_adapter(llama[0], tmp_path / "c", seed=1, targets=["q_proj"])
    _edit_config(adapter, target_modules=["q_proj", "c_attn"])
    with pytest.raises(AdapterError, match="adapter c: target_modules names c_attn"):
        AdapterBank.of(llama[1]).load(read_peft_adapter(adapter, "c"))
    head = make_adapter(llama[0], tmp_path / "head", seed=1, targets=["q_proj", "lm_head"])
    with pytest.raises(AdapterError, match="adapter head: .*lm_head.* is a base model weight"):
        read_peft_adapter(head, "head")


def test_rank_not_matching_tensors_is_refused(llama, tmp_path):
    adapter = _edit_config(make_adapter(llama[0], tmp_path / "r", seed=1), r=16)
    with pytest.raises(AdapterError, match=r"adapter r: rank mismatch at .*r=16.*lora_A \(4, \d+\)"):
        read_peft_adapter(adapter, "r")


@pytest.mark.parametrize("changes,message", [
    ({"use_dora": True}, "DoRA"),
    ({"bias": "all"}, "trained biases"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"peft_type": "IA3"}, "peft_type IA3"),
    ({"r": 0}, "r must be a positive integer"),
])
def test_what_is_not_implemented_is_refused(llama, tmp_path, changes, message):
    adapter = _edit_config(make_adapter(llama[0], tmp_path / "x", seed=1), **changes)
    with pytest.raises(AdapterError, match=f"adapter x: .*{message}"):
        read_peft_adapter(adapter, "x")


def test_missing_and_foreign_files_are_refused(tmp_path):
    with pytest.raises(AdapterError, match="adapter none: .* is not an adapter folder"):
        read_peft_adapter(tmp_path / "none", "none")
    (tmp_path / "f.gguf").write_bytes(b"GGUF")
    with pytest.raises(AdapterError, match="a GGUF LoRA file is read through gguf/lora.py"):
        read_peft_adapter(tmp_path / "f.gguf", "g")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        read_peft_adapter(tmp_path / "empty", "e")


def test_a_selection_holds_for_its_own_thread_until_released(llama, tmp_path):
    """Forwards of other threads (an embedding request beside the generator) and
    forwards after `release()` run the base model."""
    import threading

    model = llama[1]
    bare = model(IDS)
    bank = AdapterBank.of(model)
    bank.load(read_peft_adapter(make_adapter(llama[0], tmp_path / "t", seed=5), "t"))
    try:
        bank.select("t", IDS.numel())
        adapted = model(IDS)
        elsewhere: list[torch.Tensor] = []
        thread = threading.Thread(target=lambda: elsewhere.append(model(IDS)))
        thread.start()
        thread.join()
        assert torch.equal(elsewhere[0], bare) and not torch.equal(adapted, bare)
        bank.release()
        assert torch.equal(model(IDS), bare)
    finally:
        bank.unload("t")
