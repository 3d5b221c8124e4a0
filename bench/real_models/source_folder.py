"""A GGUF file -> a Hugging Face model folder our engine loads (weights dequantized).

Llama-family GGUFs go through exl3's own importer (exl3cli.gguf); families it does not
import (Gemma 3) through transformers' GGUF loader (it needs `gguf` and `accelerate`),
whose dequantized state dict is written as safetensors with its config and tokenizer.

    python bench/real_models/source_folder.py MODEL.gguf OUT_FOLDER [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def via_transformers(gguf: Path, out: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:  # a tied head: the config says so
            continue
        seen.add(tensor.data_ptr())
        state[name] = tensor.to(dtype).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    if not config.get("architectures"):  # transformers leaves it unset for GGUF loads
        config["architectures"] = [type(model).__name__]
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="stored dtype (default: 16 bits; bfloat16 via transformers)")
    args = parser.parse_args(argv)
    from exl3cli.errors import UnsupportedArchitecture
    from exl3cli.gguf.convert import gguf_to_hf_folder

    start = time.perf_counter()
    dtype = DTYPES[args.dtype] if args.dtype else None
    try:
        gguf_to_hf_folder(args.gguf, args.out, dtype=dtype)
        how = "exl3 importer"
    except UnsupportedArchitecture:
        via_transformers(args.gguf, args.out, dtype or torch.bfloat16)
        how = "transformers"
    print(f"{args.gguf.name} -> {args.out} ({how}, {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
