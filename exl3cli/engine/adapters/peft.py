"""LoRA adapters in the PEFT format, read and checked on their own (no model needed).

A PEFT adapter is a folder with `adapter_config.json` (`r`, `lora_alpha`,
`target_modules`, `use_rslora`, `fan_in_fan_out`, ...) and `adapter_model.safetensors`
(`base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r] for
every adapted module). `read_peft_adapter(path, name)` returns a `PeftAdapter`: its
modules by checkpoint name (`model.layers.0.self_attn.q_proj`), each an (A, B) pair with
the scale already folded into B, so a module's output gains `B (A x)`:

    scale = lora_alpha / r          (use_rslora: lora_alpha / sqrt(r))

What this reader does not implement is refused with an AdapterError naming the adapter:
DoRA (`use_dora`, `lora_magnitude_vector` tensors), trained biases (`bias` other than
"none"), `modules_to_save`, per-module `rank_pattern` / `alpha_pattern`,
`layers_to_transform`, embedding LoRA (`lora_embedding_A/B`) and pickled
`adapter_model.bin` files. GGUF LoRA files become PEFT folders first (gguf/lora.py). `fan_in_fan_out` only says how the base
layer stores its weight (GPT-2's Conv1D); PEFT's A and B are nn.Linear weights either
way, so it changes nothing for the linear layers exl3 adapts.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from exl3cli.errors import AdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<half>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")


@dataclass
class LoraPair:
    """One adapted module: its output gains ``b @ (a @ x)`` (the scale is in ``b``)."""

    a: torch.Tensor  # [r, in] float32
    b: torch.Tensor  # [out, r] float32, times the adapter's scale

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass
class PeftAdapter:
    """A LoRA adapter as read from disk, not yet tied to a model."""

    name: str
    rank: int
    alpha: float
    rslora: bool
    scale: float
    target_modules: list[str] | str | None
    modules: dict[str, LoraPair] = field(default_factory=dict)
    source: str = ""
    base_model: str | None = None  # base_model_name_or_path, for error messages

    def describe(self) -> dict[str, Any]:
        """What `/v1/lora` and `exl3 show` print about it."""
        return {"name": self.name, "rank": self.rank, "alpha": self.alpha,
                "rslora": self.rslora, "scale": self.scale,
                "modules": len(self.modules), "source": self.source}


def is_adapter_folder(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def read_peft_adapter(path: str | Path, name: str | None = None,
                      scaling: float = 1.0) -> PeftAdapter:
    """The adapter at `path` (a PEFT folder); AdapterError for anything it cannot apply.
    `scaling` multiplies the adapter's own scale (TabbyAPI's per-LoRA `scaling`)."""
    path = Path(path).expanduser()
    name = name or path.name
    if path.is_file() and path.suffix.lower() == ".gguf":
        raise AdapterError(f"adapter {name}: a GGUF LoRA file is read through "
                           "gguf/lora.py (Modelfile ADAPTER, LLM.load_adapter); here give "
                           f"a PEFT folder ({CONFIG_FILE} + {WEIGHTS_FILE})")
    if not path.is_dir():
        raise AdapterError(f"adapter {name}: {path} is not an adapter folder")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterError(f"adapter {name}: no {CONFIG_FILE} in {path} (a PEFT LoRA "
                           f"folder holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as error:
        raise AdapterError(f"adapter {name}: {CONFIG_FILE} is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name}: {CONFIG_FILE} is not a JSON object")
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        if (path / "adapter_model.bin").is_file():
            raise AdapterError(f"adapter {name}: adapter_model.bin (pickle) is not read; "
                               f"save the adapter with safe_serialization ({WEIGHTS_FILE})")
        raise AdapterError(f"adapter {name}: no {WEIGHTS_FILE} in {path}")
    adapter = adapter_from_config(config, name, scaling)
    adapter.source = str(path)
    adapter.modules = _read_modules(weights, adapter)
    return adapter


def adapter_from_config(config: dict[str, Any], name: str, scaling: float = 1.0) -> PeftAdapter:
    """The adapter's numbers from its adapter_config.json, refusing what is not LoRA."""
    peft_type = str(config.get("peft_type") or "LORA").upper()
    if peft_type != "LORA":
        raise AdapterError(f"adapter {name}: peft_type {peft_type} is not supported "
                           "(only LORA)")
    refusals = [
        ("use_dora", "DoRA (use_dora) is not supported"),
        ("modules_to_save", "modules_to_save (fully trained modules) is not supported"),
        ("rank_pattern", "per-module ranks (rank_pattern) are not supported"),
        ("alpha_pattern", "per-module alphas (alpha_pattern) are not supported"),
        ("layers_to_transform", "layers_to_transform is not supported"),
    ]
    for key, message in refusals:
        if config.get(key):
            raise AdapterError(f"adapter {name}: {message}")
    if str(config.get("bias") or "none") != "none":
        raise AdapterError(f"adapter {name}: trained biases (bias={config['bias']!r}) are "
                           "not supported (only bias=\"none\")")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise AdapterError(f"adapter {name}: r must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise AdapterError(f"adapter {name}: lora_alpha must be a number, got {alpha!r}")
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling):
        raise AdapterError(f"adapter {name}: scaling must be a number, got {scaling!r}")
    rslora = bool(config.get("use_rslora"))
    scale = float(alpha) / (math.sqrt(rank) if rslora else rank) * float(scaling)
    targets = config.get("target_modules")
    if targets is not None and not isinstance(targets, (list, str)):
        raise AdapterError(f"adapter {name}: target_modules must be a list or a string")
    base = config.get("base_model_name_or_path")
    return PeftAdapter(name=name, rank=rank, alpha=float(alpha), rslora=rslora, scale=scale,
                       target_modules=targets, base_model=str(base) if base else None)


def _read_modules(weights: Path, adapter: PeftAdapter) -> dict[str, LoraPair]:
    from safetensors import SafetensorError, safe_open

    name = adapter.name
    halves: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights), framework="pt") as handle:
            for key in handle.keys():
                module, half = _parse_key(key, name)
                halves.setdefault(module, {})[half] = handle.get_tensor(key).float()
    except (SafetensorError, OSError, ValueError) as error:
        raise AdapterError(f"adapter {name}: {WEIGHTS_FILE} cannot be read ({error})") from None
    if not halves:
        raise AdapterError(f"adapter {name}: {WEIGHTS_FILE} holds no LoRA tensors")
    modules = {}
    for module, pair in sorted(halves.items()):
        missing = {"A", "B"} - set(pair)
        if missing:
            raise AdapterError(f"adapter {name}: module {module} has no lora_{missing.pop()} "
                               "tensor")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2:
            raise AdapterError(f"adapter {name}: module {module} has lora_A {tuple(a.shape)} "
                               f"and lora_B {tuple(b.shape)}; both must be matrices")
        if a.shape[0] != adapter.rank or b.shape[1] != adapter.rank:
            raise AdapterError(
                f"adapter {name}: rank mismatch at {module}: adapter_config.json says "
                f"r={adapter.rank}, its tensors have lora_A {tuple(a.shape)} and "
                f"lora_B {tuple(b.shape)}")
        modules[module] = LoraPair(a.contiguous(), (b * adapter.scale).contiguous())
    return modules


def _parse_key(key: str, name: str) -> tuple[str, str]:
    """(module name as the base checkpoint names it, "A" or "B") for a tensor key."""
    if "lora_magnitude_vector" in key:
        raise AdapterError(f"adapter {name}: DoRA tensors ({key}) are not supported")
    if "lora_embedding_" in key:
        raise AdapterError(f"adapter {name}: embedding LoRA ({key}) is not supported")
    if ".base_layer." in key or key.endswith((".embed_tokens.weight", "lm_head.weight")):
        raise AdapterError(f"adapter {name}: {key} is a base model weight saved with the "
                           "adapter (PEFT saves those when it adapts the embeddings or the "
                           "head); exl3 adapts the attention and MLP projections only")
    match = _KEY.match(key)
    if match is None:
        raise AdapterError(f"adapter {name}: unexpected tensor {key} (a LoRA adapter holds "
                           "<module>.lora_A.weight and <module>.lora_B.weight)")
    return match["module"].removeprefix(_PREFIX), match["half"]


def combine_adapters(adapters: list[PeftAdapter], name: str) -> PeftAdapter:
    """One adapter that applies all of `adapters` at once (their sum: the ranks of a
    module's pairs side by side), as TabbyAPI applies every loaded LoRA."""
    modules: dict[str, LoraPair] = {}
    for adapter in adapters:
        for module, pair in adapter.modules.items():
            if module in modules:
                known = modules[module]
                pair = LoraPair(torch.cat([known.a, pair.a]), torch.cat([known.b, pair.b], dim=1))
            modules[module] = pair
    targets: list[str] = sorted({t for a in adapters if isinstance(a.target_modules, list)
                                 for t in a.target_modules})
    return PeftAdapter(name=name, rank=sum(a.rank for a in adapters),
                       alpha=sum(a.alpha for a in adapters), rslora=False, scale=1.0,
                       target_modules=targets or None, modules=modules,
                       source=" + ".join(a.source or a.name for a in adapters))
