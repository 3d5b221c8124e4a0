"""The EXL3 output folder of a conversion, written from its work-folder checkpoints.

``write_output`` assembles the folder beside ``out_dir`` (``.<name>.partial``) and moves
it into place last: the token embedding (16-bit or its trellis table), each layer's
norms, quantized or kept linears, the final norm and head, a multimodal wrapper's other
tensors at 16 bits under ExLlamaV3's names, ``quantization_config.json``, the recipe of
the bits chosen (``RECIPE_FILE``) and the source's other small files (tokenizer, ...).
``conv`` is the pipeline's converter (pipeline._Converter: source reader, names, spec).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exl3cli.codec.format import Exl3FolderWriter, make_quantization_config
from exl3cli.convert.embed_quant import EMBED_FILE
from exl3cli.convert.moe_layer import stored_name
from exl3cli.convert.recipe import write_recipe
from exl3cli.convert.work_folder import load_checkpoint, module_tensors
from exl3cli.engine.models.vision.loader import stored_tensor_name

if TYPE_CHECKING:
    from exl3cli.convert.allocation_plan import BitPlan

# The source's files that the writer makes anew (the others are copied as they are).
WEIGHT_FILES = ("config.json", "quantization_config.json", "model.safetensors.index.json")
RECIPE_FILE = "exl3-recipe.json"


def wrapper_tensors(conv: Any) -> list[str]:
    """A multimodal wrapper's tensors outside its text model (vision tower, projector):
    kept as they are, so the folder stays a whole checkpoint of its architecture."""
    if conv.spec.alt_tensors is None:
        return []
    text = conv.names.embed.removesuffix("embed_tokens.weight")
    head = conv.names.lm_head
    return sorted(k for k in conv.reader.keys() if not k.startswith(text) and k != head)


def write_output(conv: Any, out_dir: Path, work_dir: Path, plan: BitPlan) -> None:
    """Write ``out_dir`` from the checkpoints in ``work_dir`` at ``plan``'s bits (the
    options from ``conv.options``), replacing what was there only once it is whole."""
    options = conv.options
    raw = json.loads((conv.src / "config.json").read_text(encoding="utf-8"))
    if isinstance(raw.get("text_config"), dict) and "tie_word_embeddings" in raw["text_config"]:
        # The engine reads text_config over the top level: untie there too (the
        # writer unties the top level).
        raw["text_config"] = {**raw["text_config"], "tie_word_embeddings": False}
    building = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(building, ignore_errors=True)
    writer = Exl3FolderWriter(building, raw)
    t = conv.names
    if plan.embed_bits <= 8:
        stored, _ = load_checkpoint(work_dir / EMBED_FILE)
        writer.add_table(conv.embed_name(), stored["trellis"], stored["signs"])
    else:
        writer.add_tensor(t.embed, conv.reader.get(t.embed))
    for i in range(conv.config.num_layers):
        stored, _ = load_checkpoint(work_dir / f"layer-{i:04d}.safetensors")
        for name in conv.norm_names(i):
            writer.add_tensor(stored_name(conv.spec, i, name), conv.reader.get(name))
        for modules in conv.layer_modules(i).values():
            for m in modules:
                if plan.tensor_bits[m] > 8:
                    bias = conv.reader.get(m + ".bias") if conv.reader.has(m + ".bias") else None
                    writer.add_dense_linear(m, conv.reader.get(m + ".weight"), bias)
                else:
                    writer.add_linear_tensors(m, module_tensors(stored, m))
        for m in conv.kept_modules(i):
            bias = conv.reader.get(m + ".bias") if conv.reader.has(m + ".bias") else None
            writer.add_dense_linear(m, conv.reader.get(m + ".weight"), bias)
    writer.add_tensor(t.final_norm, conv.reader.get(t.final_norm))
    head = conv.head_name()
    if plan.head_bits >= 16:
        writer.add_dense_linear(head, conv.head_weight().T)
    else:
        stored, _ = load_checkpoint(work_dir / "head.safetensors")
        writer.add_linear_tensors(head, module_tensors(stored, head))
    for name in wrapper_tensors(conv):  # 16-bit, under ExLlamaV3's names
        writer.add_tensor(stored_tensor_name(conv.spec.name, name), conv.reader.get(name))
    qconfig = make_quantization_config(
        plan.average, plan.head_bits, options.codebook,
        {"rows": options.rows, "cols": options.cols},
        tensor_bits=dict(plan.tensor_bits),
        **({"embed_bits": plan.embed_bits} if plan.embed_bits <= 8 else {}),
    )
    writer.close(qconfig)
    write_recipe(building / RECIPE_FILE, plan.recipe_bits(head, conv.embed_name()),
                 note="bits per tensor of this conversion: edit, then pass this file to "
                      "`exl3 convert --recipe` (later entries override earlier ones)")
    for path in sorted(conv.src.iterdir()):
        if path.is_file() and path.name not in WEIGHT_FILES and path.suffix != ".safetensors":
            shutil.copyfile(path, building / path.name)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(building, out_dir)
