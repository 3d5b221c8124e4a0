"""GGUF LoRA adapters (llama.cpp's `convert_lora_to_gguf` layout, what Ollama's ADAPTER
takes) turned into PEFT folders, which is what the engine reads (engine/adapters/peft.py).

A GGUF adapter has `general.type = "adapter"`, `adapter.type = "lora"`,
`adapter.lora.alpha`, and for each adapted tensor of the base model two tensors named
after it: `<base tensor>.lora_a` [r, in] and `<base tensor>.lora_b` [out, r]
(`blk.0.attn_q.weight.lora_a`). llama.cpp's scale is alpha / r (alpha 0: scale 1). For
the architectures whose q/k rows llama.cpp permutes (Llama, Mistral), the converter
permutes the rows of lora_b of attn_q/attn_k the same way: they are permuted back here,
which needs the base model's head counts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from exl3cli.errors import AdapterError, Exl3Error
from exl3cli.gguf.convert import ARCHITECTURES, hf_tensor_name, unpermute_rotary_rows

_LORA = re.compile(r"^(?P<base>.+\.weight)\.lora_(?P<half>[ab])$")


def gguf_lora_to_peft(path: str | Path, out_dir: str | Path, name: str, num_heads: int,
                      num_kv_heads: int) -> Path:
    """Write the GGUF LoRA at `path` as a PEFT folder in `out_dir`; AdapterError naming
    the adapter (`name`) when it is not a LoRA adapter exl3 can apply."""
    from safetensors.torch import save_file

    from exl3cli.gguf.reader import GgufFile

    try:
        model = GgufFile(path)
    except Exl3Error as error:
        raise AdapterError(f"adapter {name}: {error}") from None
    kind = (model.metadata.get("general.type"), model.metadata.get("adapter.type"))
    if kind != ("adapter", "lora"):
        raise AdapterError(f"adapter {name}: this GGUF file is not a LoRA adapter "
                           f"(general.type {kind[0]!r}, adapter.type {kind[1]!r})")
    if model.metadata.get("adapter.alora.invocation_tokens") is not None:
        raise AdapterError(f"adapter {name}: activated LoRA (aLoRA) is not supported")
    if model.architecture not in ARCHITECTURES:
        raise AdapterError(f"adapter {name}: GGUF architecture {model.architecture!r} is not "
                           f"supported (supported: {', '.join(ARCHITECTURES)})")
    permuted = ARCHITECTURES[model.architecture][2]
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for tensor in model.tensors():
        match = _LORA.match(tensor.name)
        if match is None:
            raise AdapterError(f"adapter {name}: unexpected tensor {tensor.name} in a GGUF "
                               "LoRA (<base tensor>.lora_a / .lora_b)")
        try:
            module = hf_tensor_name(match["base"])
        except Exl3Error:
            module = None
        if module is None or not module.startswith("model.layers."):
            raise AdapterError(f"adapter {name}: {match['base']} is not a projection exl3 "
                               "adapts (the attention and MLP projections)")
        halves.setdefault(module.removesuffix(".weight"), {})[match["half"]] = \
            model.dequantize(tensor.name)
    if not halves:
        raise AdapterError(f"adapter {name}: the GGUF file holds no LoRA tensors")
    tensors, ranks = {}, set()
    for module, pair in sorted(halves.items()):
        if set(pair) != {"a", "b"}:
            raise AdapterError(f"adapter {name}: {module} has only lora_{''.join(pair)}")
        a, b = pair["a"], pair["b"]
        if permuted and module.endswith(("q_proj", "k_proj")):
            heads = num_heads if module.endswith("q_proj") else num_kv_heads
            b = unpermute_rotary_rows(b, heads)
        ranks.add(int(a.shape[0]))
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    if len(ranks) != 1:
        raise AdapterError(f"adapter {name}: modules of different ranks {sorted(ranks)} "
                           "are not supported")
    rank = ranks.pop()
    alpha = float(model.metadata.get("adapter.lora.alpha") or 0.0) or float(rank)
    targets = sorted({module.rsplit(".", 1)[-1] for module in halves})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets,
        "bias": "none", "use_rslora": False, "source": f"GGUF {Path(path).name}",
    }, indent=2))
    return out
