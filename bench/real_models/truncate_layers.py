"""A copy of a Hugging Face model folder with only its first N decoder layers (for dry
runs of the GPU script on a CPU: same shapes, tokenizer and embeddings, fewer layers).

    python bench/real_models/truncate_layers.py FOLDER OUT --layers 2
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

LAYER = re.compile(r"\.layers\.(\d+)\.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for shard in sorted(args.folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as reader:
            for name in reader.keys():
                match = LAYER.search(name)
                if match is None or int(match.group(1)) < args.layers:
                    tensors[name] = reader.get_tensor(name)
    save_file(tensors, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((args.folder / "config.json").read_text())
    config["num_hidden_layers"] = args.layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][: args.layers]
    (args.out / "config.json").write_text(json.dumps(config, indent=1))
    for item in args.folder.iterdir():
        if item.suffix != ".safetensors" and item.name not in ("config.json",
                                                                "model.safetensors.index.json"):
            if item.is_file():
                shutil.copy2(item, args.out / item.name)
    print(f"{args.folder} -> {args.out}: {args.layers} layers, {len(tensors)} tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
