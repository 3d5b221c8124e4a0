"""Read tensors from a Hugging Face folder: one model.safetensors or shards + index.

A token embedding stored trellis-quantized (ExLlamaV3's ``--embed_bits``: ``X.trellis``
+ ``X.signs`` and no ``X.weight``, or the table split into ``X.shard_N.trellis``;
codec/table.py) reads as its decoded float16 ``X.weight``, trimmed to the config's
hidden size, so every loader sees an ordinary embedding; the stored tensors stay
readable under their own names.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from exl3cli.codec.table import decode_table
from exl3cli.errors import ModelLoadError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class WeightReader:
    """Lazy access to the tensors of a checkpoint folder, by name."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._handles: dict[Path, object] = {}
        self._file_of: dict[str, Path] = self._map_tensors()
        self._tables = self._quantized_tables()  # X.weight -> (trellis names, signs name)

    def _map_tensors(self) -> dict[str, Path]:
        index = self.folder / INDEX_FILE
        single = self.folder / SINGLE_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ModelLoadError(f"cannot read {index}: {exc}") from exc
            files = {name: self.folder / shard for name, shard in weight_map.items()}
            for path in sorted(set(files.values())):
                if not path.is_file():
                    raise ModelLoadError(f"missing checkpoint shard {path.name} in {self.folder}")
            return files
        if single.is_file():
            return {name: single for name in self._open(single).keys()}
        candidates = sorted(self.folder.glob("*.safetensors"))
        if len(candidates) == 1:  # some exports use another name for the only file
            return {name: candidates[0] for name in self._open(candidates[0]).keys()}
        raise ModelLoadError(f"no {SINGLE_FILE} or {INDEX_FILE} in {self.folder}")

    def _open(self, path: Path):
        handle = self._handles.get(path)
        if handle is None:
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types
                raise ModelLoadError(f"cannot read safetensors file {path}: {exc}") from exc
            self._handles[path] = handle
        return handle

    def _quantized_tables(self) -> dict[str, tuple[list[str], str]]:
        tables = {}
        for name in self._file_of:
            if not name.endswith(".signs"):
                continue
            module = name.removesuffix(".signs")
            parts = [f"{module}.trellis"]
            if parts[0] not in self._file_of:  # or split into shards
                parts = []
                while f"{module}.shard_{len(parts)}.trellis" in self._file_of:
                    parts.append(f"{module}.shard_{len(parts)}.trellis")
            if parts and f"{module}.weight" not in self._file_of:
                tables[f"{module}.weight"] = (parts, name)
        return tables

    def _table_width(self) -> int | None:
        """The hidden size a decoded table is trimmed to (config.json's)."""
        try:
            raw = json.loads((self.folder / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
        width = text.get("hidden_size", raw.get("hidden_size"))
        return int(width) if isinstance(width, int) else None

    def _decoded_table(self, name: str, device: torch.device | str | None) -> torch.Tensor:
        parts, signs_name = self._tables[name]
        trellis = torch.cat([self.get(p) for p in parts]) if len(parts) > 1 else self.get(parts[0])
        signs = self.get(signs_name)
        width = self._table_width() or 256 * signs.shape[0]
        if device is not None:
            trellis = trellis.to(device)
        return decode_table(trellis, signs, width)

    def keys(self) -> list[str]:
        """All tensor names in the checkpoint (a quantized table's ``.weight`` too)."""
        return list(self._file_of) + list(self._tables)

    def has(self, name: str) -> bool:
        return name in self._file_of or name in self._tables

    def get(
        self,
        name: str,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """The tensor `name`, optionally converted; ModelLoadError if absent."""
        path = self._file_of.get(name)
        if path is None and name in self._tables:
            tensor = self._decoded_table(name, device)
        elif path is None:
            raise ModelLoadError(f"tensor {name!r} not found in {self.folder}")
        else:
            tensor = self._open(path).get_tensor(name)
        if dtype is not None or device is not None:
            tensor = tensor.to(dtype=dtype or tensor.dtype, device=device or tensor.device)
        return tensor
