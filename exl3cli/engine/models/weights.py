"""Read tensors from a Hugging Face folder: one model.safetensors or shards + index."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from exl3cli.errors import ModelLoadError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class WeightReader:
    """Lazy access to the tensors of a checkpoint folder, by name."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._handles: dict[Path, object] = {}
        self._file_of: dict[str, Path] = self._map_tensors()

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

    def keys(self) -> list[str]:
        """All tensor names in the checkpoint."""
        return list(self._file_of)

    def has(self, name: str) -> bool:
        return name in self._file_of

    def get(
        self,
        name: str,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """The tensor `name`, optionally converted; ModelLoadError if absent."""
        path = self._file_of.get(name)
        if path is None:
            raise ModelLoadError(f"tensor {name!r} not found in {self.folder}")
        tensor = self._open(path).get_tensor(name)
        if dtype is not None or device is not None:
            tensor = tensor.to(dtype=dtype or tensor.dtype, device=device or tensor.device)
        return tensor
