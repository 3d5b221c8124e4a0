"""An EXL3 folder written by a second, independent writer loads and runs here.

The writer below uses only safetensors, numpy and EXL3-FORMAT.md (no code of ours):
random trellis words for every linear (three codebooks, K = 3, 4 and 6, padding to
128, one layer kept at 16 bits, legacy su/sv signs on one), two shards cut at module
boundaries with an index, float16 embeddings and norms, quantization_config in
config.json plus the sidecar. The expected model is `transformers`' Llama carrying the
weights that the spec's own decode (tests/engine/quant/spec_reference.py, loops over
bits) and section 4's rotation give; our loader must produce the same logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from exl3cli.engine.models.loader import load_causal_lm
from tests.engine.quant.spec_reference import decode_tile

MARKERS = {"mul1": -2082680531, "mcg": -877912083}  # section 2; 3inst has none
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16",
}
# module -> (in, out, how it is stored)
LINEARS = {
    "model.layers.0.self_attn.q_proj": (128, 128, ("mul1", 4)),
    "model.layers.0.self_attn.k_proj": (128, 64, ("mul1", 4)),
    "model.layers.0.self_attn.v_proj": (128, 64, ("mcg", 3)),
    "model.layers.0.self_attn.o_proj": (128, 128, "fp16"),
    "model.layers.0.mlp.gate_proj": (128, 96, ("3inst", 4)),
    "model.layers.0.mlp.up_proj": (128, 96, ("mul1", 3)),
    "model.layers.0.mlp.down_proj": (96, 128, ("mul1", 4, "legacy signs")),
    "lm_head": (128, 300, ("mul1", 6)),
}


def _pad(n: int) -> int:
    return -(-n // 128) * 128


def _hadamard_blocks(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < 128:
        h = np.block([[h, h], [h, -h]])
    h /= np.sqrt(128)
    return np.kron(np.eye(n // 128), h)


def _random_linear(rng, n_in: int, n_out: int, codebook: str, k: int,
                   legacy: bool) -> dict:
    """Stored tensors of one quantized linear, and its logical weight (in, out).
    `legacy`: sign-only `su`/`sv` (unit scales) instead of `suh`/`svh`."""
    p_in, p_out = _pad(n_in), _pad(n_out)
    words = rng.integers(-(2**15), 2**15, size=(p_in // 16, p_out // 16, 16 * k),
                         dtype=np.int64).astype(np.int16)
    rotated = np.zeros((p_in, p_out))
    for kb in range(p_in // 16):
        for nb in range(p_out // 16):
            tile = decode_tile([int(w) for w in words[kb, nb]], k, codebook)
            rotated[16 * kb:16 * kb + 16, 16 * nb:16 * nb + 16] = tile
    signs_in, signs_out = rng.choice([-1.0, 1.0], p_in), rng.choice([-1.0, 1.0], p_out)
    if legacy:
        suh, svh = signs_in, signs_out
        tensors = {"trellis": words, "su": _legacy_signs(signs_in),
                   "sv": _legacy_signs(signs_out)}
    else:
        suh = (signs_in * rng.uniform(0.8, 1.2, p_in)).astype(np.float16)
        svh = (signs_out * rng.uniform(0.02, 0.04, p_out)).astype(np.float16)
        tensors = {"trellis": words, "suh": suh, "svh": svh}
    weight = (suh.astype(np.float64)[:, None] * (_hadamard_blocks(p_in) @ rotated
              @ _hadamard_blocks(p_out)) * svh.astype(np.float64)[None, :])
    if codebook in MARKERS:
        tensors[codebook] = np.array(MARKERS[codebook], dtype=np.int32)
    return {"tensors": tensors, "weight": weight[:n_in, :n_out]}


def _legacy_signs(signs: np.ndarray) -> np.ndarray:
    """Section 2: bit i of int16 word j = sign of element 16j+i, 1 = negative."""
    bits = (signs < 0).reshape(-1, 16).astype(np.int64)
    return (bits << np.arange(16)).sum(axis=1).astype(np.uint16).view(np.int16)


def _write_foreign_folder(folder: Path, seed: int = 3) -> dict[str, np.ndarray]:
    """Write the folder; return every logical weight in Hugging Face orientation."""
    rng = np.random.default_rng(seed)
    shards: list[dict[str, np.ndarray]] = [{}, {}]
    hf: dict[str, np.ndarray] = {}
    sidecar: dict[str, dict] = {}
    embed = (rng.standard_normal((300, 128)) * 0.5).astype(np.float16)
    shards[0]["model.embed_tokens.weight"] = embed
    hf["model.embed_tokens.weight"] = embed
    for name in ("model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
                 "model.norm"):
        norm = rng.uniform(0.7, 1.3, 128).astype(np.float16)
        shards[1 if name == "model.norm" else 0][name + ".weight"] = norm
        hf[name + ".weight"] = norm
    for name, (n_in, n_out, how) in LINEARS.items():
        shard = shards[1] if name.startswith(("lm_head", "model.layers.0.mlp")) else shards[0]
        if how == "fp16":
            weight = (rng.standard_normal((n_out, n_in)) * 0.03).astype(np.float16)
            shard[name + ".weight"] = weight
            hf[name + ".weight"] = weight
            continue
        codebook, k = how[0], how[1]
        linear = _random_linear(rng, n_in, n_out, codebook, k, "legacy signs" in how)
        tensors = linear["tensors"]
        for suffix, tensor in tensors.items():
            shard[f"{name}.{suffix}"] = tensor
        hf[name + ".weight"] = linear["weight"].T.astype(np.float32)
        sidecar[name] = {"quant_format": "exl3", "bits_per_weight": k,
                         "stored_tensors": {f"{name}.{s}": {"shape": list(t.shape),
                                                            "dtype": str(t.dtype)}
                                            for s, t in tensors.items()}}
    folder.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for index, shard in enumerate(shards, start=1):
        file = f"model-{index:05d}-of-00002.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map.update({key: file for key in shard})
        total += sum(t.nbytes for t in shard.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    quant = {"quant_method": "exl3", "version": "0.0.x", "bits": 3.79, "head_bits": 6,
             "calibration": {"rows": 100, "cols": 2048}, "out_scales": "auto",
             "codebook": "mul1"}
    (folder / "config.json").write_text(json.dumps({**CONFIG, "quantization_config": quant}))
    (folder / "quantization_config.json").write_text(json.dumps({**quant,
                                                                 "tensor_storage": sidecar}))
    return hf


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    folder = tmp_path_factory.mktemp("foreign-exl3")
    return folder, _write_foreign_folder(folder)


def test_folder_from_an_independent_writer_gives_the_spec_logits(foreign):
    folder, weights = foreign
    import transformers

    config = transformers.LlamaConfig(**{k: v for k, v in CONFIG.items()
                                         if k not in ("architectures", "torch_dtype")})
    config._attn_implementation = "eager"
    reference = transformers.LlamaForCausalLM(config).eval()
    state = {name: torch.from_numpy(np.asarray(w, dtype=np.float32))
             for name, w in weights.items()}
    missing, unexpected = reference.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), missing
    ids = torch.tensor([[1, 17, 250, 3, 99, 42, 7, 7, 180, 5]])
    with torch.no_grad():
        want = reference(ids).logits
    got = load_causal_lm(folder, device="cpu", dtype=torch.float32)(ids)
    assert got.shape == want.shape
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) < 2e-3 * scale
