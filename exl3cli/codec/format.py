"""The EXL3 on-disk contract (EXL3-FORMAT.md sections 1 and 2): read and write folders.

Public API:
- ``padded_size(n) -> int``: ``n`` rounded up to a multiple of 128.
- ``exl3_linear_layout(in_features, out_features, k_bits, codebook="mul1", bias=False)
  -> dict[suffix, (dtype, shape)]``: the exact stored tensors of one quantized linear.
- ``write_exl3_linear(prefix, trellis, suh, svh, codebook, bias=None)
  -> dict[str, Tensor]``: the named, validated tensors of one quantized linear
  (``prefix.trellis`` int16, ``prefix.suh``/``.svh`` float16, ``prefix.mul1``/``.mcg``
  int32 scalar marker, ``prefix.bias`` float16).
- ``read_exl3_linear(reader, prefix) -> dict[suffix, Tensor] | None``: the stored
  tensors of module ``prefix`` when it is trellis-quantized, else None (``reader`` is a
  ``WeightReader`` or anything with ``has(name)`` and ``get(name)``).
- ``Exl3FolderWriter(out_dir, config: dict, shard_bytes=4 GiB, workers=0)``:
  ``.add_linear(name, trellis, suh, svh, codebook, bias=None)`` (``name`` is the module,
  e.g. ``"model.layers.0.mlp.up_proj"``), ``.add_dense_linear(name, weight, bias=None)``
  (a 16-bit layer: ``.weight`` float16 in HF orientation (out, in)),
  ``.add_linear_tensors(name, tensors_by_suffix)`` (the dict that
  ``quantize_linear_plain`` or the converter returns), ``.add_tensor(full_name, tensor)``
  (embeddings, norms: bfloat16 kept, float32 -> float16), ``.add_table(name, trellis,
  signs)`` (a trellis-quantized embedding, codec/table.py),
  ``.close(quantization_config: dict) -> Path``. Shards are cut at module boundaries;
  one shard is ``model.safetensors``, several are ``model-0000i-of-0000N.safetensors``
  with ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``).
  ``workers`` > 0 writes full shards on that many threads while the next ones fill
  (``close`` waits for them; a failed write raises there).
  ``close`` writes config.json (with ``quantization_config``, ``tie_word_embeddings:
  false``) and the ``quantization_config.json`` sidecar (``tensor_storage`` per module).
- ``make_quantization_config(bits, head_bits, codebook, ...) -> dict``.
- ``read_quantization_config(folder) -> dict | None``: config.json's object, else the
  sidecar's, else None. Never needed to decode: every tensor says how it is stored.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from exl3cli.codec.bitstream import k_bits_from_words, words_per_tile
from exl3cli.codec.codebooks import CODEBOOKS, MARKER_VALUES
from exl3cli.codec.table import table_k_bits
from exl3cli.errors import ModelLoadError

FORMAT_VERSION = "0.0.1"  # writer version recorded in quantization_config
SIDECAR_FILE = "quantization_config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_SHARD_BYTES = 4 * 2**30
# Every suffix a stored quantized linear may carry (legacy su/sv are read, never written).
EXL3_SUFFIXES = ("trellis", "suh", "svh", "su", "sv", "mul1", "mcg", "bias")
# safetensors header names of the dtypes we store (for the sidecar).
_DTYPE_NAMES = {
    torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
    torch.int16: "I16", torch.int32: "I32",
}


def padded_size(n: int) -> int:
    """``n`` rounded up to the 128-multiple that the trellis and scales cover."""
    return -(-int(n) // 128) * 128


def exl3_linear_layout(
    in_features: int,
    out_features: int,
    k_bits: float,
    codebook: str = "mul1",
    bias: bool = False,
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Suffix -> (dtype, shape) of every tensor one quantized linear stores."""
    pin, pout = padded_size(in_features), padded_size(out_features)
    layout = {
        "trellis": (torch.int16, (pin // 16, pout // 16, words_per_tile(k_bits))),
        "suh": (torch.float16, (pin,)),
        "svh": (torch.float16, (pout,)),
    }
    if codebook in MARKER_VALUES:
        layout[codebook] = (torch.int32, ())
    if bias:
        layout["bias"] = (torch.float16, (out_features,))
    return layout


def write_exl3_linear(
    prefix: str,
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: str = "mul1",
    bias: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The checked, named tensors of one quantized linear, ready for safetensors."""
    if codebook not in CODEBOOKS:
        raise ValueError(f"unknown codebook {codebook!r}; choose from {CODEBOOKS}")
    if trellis.dim() != 3 or trellis.dtype != torch.int16:
        raise ValueError(f"trellis must be int16 (in/16, out/16, words), got "
                         f"{trellis.dtype} {tuple(trellis.shape)}")
    k_bits = k_bits_from_words(trellis.shape[-1])
    if codebook != "mul1" and not k_bits.is_integer():
        raise ValueError(f"K={k_bits} is only defined for the mul1 codebook")
    pin, pout = 16 * trellis.shape[0], 16 * trellis.shape[1]
    if pin % 128 or pout % 128:
        raise ValueError(f"trellis covers {pin}x{pout}: pad both sides to multiples of 128")
    if suh.numel() != pin or svh.numel() != pout:
        raise ValueError(f"suh/svh have {suh.numel()}/{svh.numel()} entries, need {pin}/{pout}")
    tensors = {
        f"{prefix}.trellis": trellis.detach().cpu().contiguous(),
        f"{prefix}.suh": suh.detach().reshape(-1).to("cpu", torch.float16).contiguous(),
        f"{prefix}.svh": svh.detach().reshape(-1).to("cpu", torch.float16).contiguous(),
    }
    if codebook in MARKER_VALUES:
        tensors[f"{prefix}.{codebook}"] = torch.tensor(MARKER_VALUES[codebook], dtype=torch.int32)
    if bias is not None:
        if bias.dim() != 1 or bias.numel() > pout:
            raise ValueError(f"bias of shape {tuple(bias.shape)} does not fit {pout} outputs")
        tensors[f"{prefix}.bias"] = bias.detach().to("cpu", torch.float16).contiguous()
    return tensors


def read_exl3_linear(reader: Any, prefix: str) -> dict[str, torch.Tensor] | None:
    """Stored tensors of module ``prefix`` by suffix, or None if it has no ``.trellis``."""
    if not reader.has(f"{prefix}.trellis"):
        return None
    found = {s: reader.get(f"{prefix}.{s}") for s in EXL3_SUFFIXES if reader.has(f"{prefix}.{s}")}
    trellis = found["trellis"]
    if trellis.dim() != 3 or trellis.dtype != torch.int16:
        raise ModelLoadError(f"{prefix}.trellis must be int16 (in/16, out/16, words), got "
                             f"{trellis.dtype} {tuple(trellis.shape)}")
    if "suh" not in found and "su" not in found:
        raise ModelLoadError(f"{prefix} has a .trellis but neither .suh nor .su")
    if "svh" not in found and "sv" not in found:
        raise ModelLoadError(f"{prefix} has a .trellis but neither .svh nor .sv")
    return found


def make_quantization_config(
    bits: float,
    head_bits: float,
    codebook: str = "mul1",
    calibration: dict[str, int] | None = None,
    out_scales: str = "auto",
    **extra: Any,
) -> dict[str, Any]:
    """The ``quantization_config`` object of config.json (EXL3-FORMAT.md section 1)."""
    if codebook not in CODEBOOKS:
        raise ValueError(f"unknown codebook {codebook!r}")
    return {
        "quant_method": "exl3",
        "version": FORMAT_VERSION,
        "bits": round(float(bits), 2),
        "head_bits": head_bits,
        "calibration": calibration or {"rows": 0, "cols": 0},
        "out_scales": out_scales,
        "codebook": codebook,
        **extra,
    }


def read_quantization_config(folder: str | Path) -> dict[str, Any] | None:
    """config.json's ``quantization_config``, else the sidecar's, else None."""
    folder = Path(folder)
    for path, key in ((folder / "config.json", "quantization_config"), (folder / SIDECAR_FILE, None)):
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read {path}: {exc}") from exc
        if key is not None:
            data = data.get(key) if isinstance(data, dict) else None
        if isinstance(data, dict):
            return data
    return None


def _store_dtype(tensor: torch.Tensor) -> torch.Tensor:
    """Unquantized tensors: bfloat16 and float16 kept, other floats -> float16."""
    if tensor.is_floating_point() and tensor.dtype not in (torch.bfloat16, torch.float16):
        tensor = tensor.to(torch.float16)
    return tensor.detach().cpu().contiguous()


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


class Exl3FolderWriter:
    """Writes an EXL3 model folder module by module, cutting shards at module edges.

    Tensors are buffered until the current shard would exceed ``shard_bytes``; then the
    shard is written (under a temporary name, renamed on ``close`` when the count is
    known). Tokenizer files are the caller's business (copy them into ``out_dir``).
    """

    def __init__(self, out_dir: str | Path, config: dict[str, Any],
                 shard_bytes: int = DEFAULT_SHARD_BYTES, workers: int = 0):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.config = dict(config)
        self.shard_bytes = int(shard_bytes)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[Path] = []
        self._weight_map: dict[str, int] = {}  # tensor name -> shard number
        self._storage: dict[str, dict[str, Any]] = {}  # sidecar tensor_storage
        self._total_bytes = 0
        self._closed = False
        self._pool = ThreadPoolExecutor(workers) if workers > 0 else None
        self._writes: list[Future[None]] = []

    def add_linear(self, name: str, trellis: torch.Tensor, suh: torch.Tensor,
                   svh: torch.Tensor, codebook: str = "mul1",
                   bias: torch.Tensor | None = None) -> None:
        """One trellis-quantized linear module (``name`` without a suffix)."""
        tensors = write_exl3_linear(name, trellis, suh, svh, codebook, bias)
        self._add_module(name, tensors, bits=k_bits_from_words(trellis.shape[-1]))

    def add_dense_linear(self, name: str, weight: torch.Tensor,
                         bias: torch.Tensor | None = None) -> None:
        """A linear kept at 16 bits: ``.weight`` float16 (out, in) + optional ``.bias``."""
        if weight.dim() != 2:
            raise ValueError(f"{name}.weight must be 2-D (out, in), got {tuple(weight.shape)}")
        tensors = {f"{name}.weight": weight.detach().to("cpu", torch.float16).contiguous()}
        if bias is not None:
            tensors[f"{name}.bias"] = bias.detach().to("cpu", torch.float16).contiguous()
        self._add_module(name, tensors, bits=None)

    def add_tensor(self, full_name: str, tensor: torch.Tensor) -> None:
        """An unquantized tensor (embedding, norm) under its full checkpoint name."""
        self._add_module(_module_of(full_name), {full_name: _store_dtype(tensor)}, bits=None)

    def add_table(self, name: str, trellis: torch.Tensor, signs: torch.Tensor) -> None:
        """A trellis-quantized embedding table (codec/table.py): ``name.trellis`` and
        ``name.signs``, no ``.weight``."""
        table_k_bits(trellis, signs)  # refuses shapes a loader would refuse
        self._add_module(name, {f"{name}.trellis": trellis.detach().cpu().contiguous(),
                                f"{name}.signs": signs.detach().to("cpu", torch.float16)
                                .contiguous()}, bits=None)

    def add_linear_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """A quantized linear given as suffix -> tensor (e.g. from ``quantize_linear``)."""
        found = {key.rsplit(".", 1)[-1]: value for key, value in tensors.items()}
        codebook = next((c for c in MARKER_VALUES if c in found), "3inst")
        self.add_linear(name, found["trellis"], found["suh"], found["svh"], codebook,
                        found.get("bias"))

    def _add_module(self, module: str, tensors: dict[str, torch.Tensor],
                    bits: float | None) -> None:
        if self._closed:
            raise RuntimeError("writer is closed")
        for key in tensors:
            if key in self._weight_map or key in self._pending:
                raise ValueError(f"tensor {key!r} written twice")
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if self._pending and self._pending_bytes + size > self.shard_bytes:
            self._flush()
        self._pending.update(tensors)
        self._pending_bytes += size
        self._total_bytes += size
        entry = self._storage.setdefault(module, {"stored_tensors": {}})
        for key, value in tensors.items():
            entry["stored_tensors"][key] = {
                "shape": list(value.shape),
                "n_bytes": value.numel() * value.element_size(),
                "dtype": _DTYPE_NAMES.get(value.dtype, str(value.dtype).removeprefix("torch.")),
            }
        if bits is not None:
            entry["quant_format"] = "exl3"
            entry["bits_per_weight"] = bits

    def _flush(self) -> None:
        number = len(self._shards)
        path = self.out_dir / f".shard-{number:05d}.safetensors.tmp"
        seen: set[int] = set()
        for key, value in self._pending.items():  # safetensors refuses shared storage
            pointer = value.untyped_storage().data_ptr()
            if pointer in seen:
                self._pending[key] = value.clone()
            seen.add(pointer)
        if self._pool is not None:
            self._writes.append(self._pool.submit(save_file, self._pending, str(path),
                                                  {"format": "pt"}))
        else:
            save_file(self._pending, str(path), metadata={"format": "pt"})
        for key in self._pending:
            self._weight_map[key] = number
        self._shards.append(path)
        self._pending, self._pending_bytes = {}, 0

    def close(self, quantization_config: dict[str, Any]) -> Path:
        """Write the last shard, rename shards, write index, config.json and sidecar."""
        if self._pending or not self._shards:
            self._flush()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            for write in self._writes:
                write.result()  # re-raises a failed shard write
        count = len(self._shards)
        names = [SINGLE_FILE] if count == 1 else [
            f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)
        ]
        for old in (self.out_dir / SINGLE_FILE, self.out_dir / INDEX_FILE):
            old.unlink(missing_ok=True)  # a stale file of an earlier write would mislead
        for path, name in zip(self._shards, names, strict=True):
            os.chmod(path, 0o644)  # safetensors leaves owner-only temp permissions
            os.replace(path, self.out_dir / name)
        if count > 1:
            index = {
                "metadata": {"total_size": self._total_bytes},
                "weight_map": {k: names[n] for k, n in sorted(self._weight_map.items())},
            }
            _write_json(self.out_dir / INDEX_FILE, index)
        config = dict(self.config)
        config["quantization_config"] = quantization_config
        config["tie_word_embeddings"] = False
        _write_json(self.out_dir / "config.json", config)
        sidecar = dict(quantization_config)
        sidecar["tensor_storage"] = self._storage
        _write_json(self.out_dir / SIDECAR_FILE, sidecar)
        self._closed = True
        return self.out_dir


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
