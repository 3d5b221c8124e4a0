"""A function-identical copy of a Llama-family folder with its hidden size zero-padded
(SmolLM2: 576 -> 640), for ExLlamaV3, which needs the hidden size a multiple of 128.

The residual stream gets extra channels that stay exactly zero: the embedding gets
zero columns, every linear reading the stream zero input columns, every linear writing
it zero output rows. RMSNorm averages over the padded width, so each norm weight is
scaled by sqrt(old/new) and rms_norm_eps by old/new: then every norm's output is
unchanged (and zero in the padding). head_dim is written out, since hidden / heads no
longer gives it.

    python bench/real_models/pad_hidden.py FOLDER OUT --hidden 640
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

READS_STREAM = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
WRITES_STREAM = ("o_proj", "down_proj")


def pad_tensor(name: str, tensor: torch.Tensor, old: int, new: int) -> torch.Tensor:
    extra = new - old
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
    if name.endswith("norm.weight") and tensor.dim() == 1 and tensor.shape[0] == old:
        scaled = tensor.float() * math.sqrt(old / new)
        return torch.cat([scaled, torch.zeros(extra)]).to(tensor.dtype)
    if "embed_tokens" in name or module in READS_STREAM:
        if name.endswith(".weight") and tensor.shape[-1] == old:
            return torch.nn.functional.pad(tensor, (0, extra))
    if module in WRITES_STREAM and tensor.shape[0] == old:
        pad = (0, 0, 0, extra) if tensor.dim() == 2 else (0, extra)
        return torch.nn.functional.pad(tensor, pad)
    return tensor


def pad_folder(folder: Path, out: Path, hidden: int) -> dict:
    config = json.loads((folder / "config.json").read_text())
    old = int(config["hidden_size"])
    if hidden <= old:
        raise SystemExit(f"--hidden {hidden} must exceed the model's {old}")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as reader:
            for name in reader.keys():
                tensors[name] = pad_tensor(name, reader.get_tensor(name), old, hidden)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["head_dim"] = config.get("head_dim") or old // int(config["num_attention_heads"])
    config["hidden_size"] = hidden
    config["rms_norm_eps"] = float(config.get("rms_norm_eps", 1e-6)) * old / hidden
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for item in folder.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(item, out / item.name)
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--hidden", type=int, default=640)
    args = parser.parse_args(argv)
    config = pad_folder(args.folder, args.out, args.hidden)
    print(f"{args.folder} -> {args.out}: hidden {config['hidden_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
