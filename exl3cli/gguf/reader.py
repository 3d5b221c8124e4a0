"""Read a GGUF file: its metadata as plain Python values and its tensors dequantised.

The `gguf` package (llama.cpp's own reader) does the parsing and the block
dequantisation; this module only turns its records into values the converter uses.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from exl3cli.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"


@dataclass
class GgufTensor:
    """One tensor as stored: llama.cpp name, HF-order shape, quantisation type name."""

    name: str
    shape: tuple[int, ...]
    type_name: str


def is_gguf_file(path: str | Path) -> bool:
    """True when the file starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == GGUF_MAGIC
    except OSError:
        return False


class GgufFile:
    """A GGUF file opened read-only (memory-mapped by the gguf package)."""

    def __init__(self, path: str | Path):
        import gguf  # imported here: only conversions need it

        self.path = Path(path)
        if not is_gguf_file(self.path):
            raise ModelLoadError(f"{self.path} is not a GGUF file")
        try:
            self._reader = gguf.GGUFReader(str(self.path), "r")
        except (ValueError, OSError, IndexError) as error:  # IndexError: a truncated file
            raise ModelLoadError(f"cannot read GGUF file {self.path}: {error}") from error
        self.metadata: dict[str, Any] = {
            key: _field_value(field) for key, field in self._reader.fields.items()
        }
        self._tensors = {tensor.name: tensor for tensor in self._reader.tensors}

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "llama"))

    def arch_value(self, key: str, default: Any = None) -> Any:
        """A `<architecture>.<key>` metadata value (e.g. `block_count`)."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def tensors(self) -> list[GgufTensor]:
        return [
            GgufTensor(t.name, tuple(int(d) for d in reversed(t.shape)), t.tensor_type.name)
            for t in self._tensors.values()
        ]

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def dequantize(self, name: str) -> torch.Tensor:
        """The tensor as float32, in PyTorch (row-major, HF) order."""
        from gguf.quants import dequantize

        tensor = self._tensors[name]
        shape = tuple(int(d) for d in reversed(tensor.shape))
        try:
            values = dequantize(np.asarray(tensor.data), tensor.tensor_type)
        except NotImplementedError as error:
            raise ModelLoadError(
                f"GGUF tensor {name} uses {tensor.tensor_type.name}, which cannot be dequantised"
            ) from error
        # A copy: F32 tensors come back as read-only views of the memory map.
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)

    def iter_dequantized(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self._tensors:
            yield name, self.dequantize(name)


def _field_value(field: Any) -> Any:
    """A metadata field as str/int/float/bool or a list of them."""
    from gguf import GGUFValueType

    if not field.types:
        return None
    main = field.types[0]
    if main == GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == GGUFValueType.STRING:
            return [_decode(field.parts[i]) for i in field.data]
        if len(field.types) > 2:  # nested arrays: not used by the keys we read
            return None
        values = np.concatenate([field.parts[i] for i in field.data]) if field.data else []
        return _plain_list(values, sub)
    if main == GGUFValueType.STRING:
        return _decode(field.parts[field.data[0]])
    value = field.parts[field.data[0]][0]
    return _plain(value, main)


def _decode(raw: np.ndarray) -> str:
    # Token texts are UTF-8 in practice; never fail a conversion over one bad entry.
    return bytes(raw).decode("utf-8", errors="replace")


def _plain(value: Any, value_type: Any) -> Any:
    from gguf import GGUFValueType

    if value_type == GGUFValueType.BOOL:
        return bool(value)
    if value_type in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        return float(value)
    return int(value)


def _plain_list(values: Any, value_type: Any) -> list[Any]:
    return [_plain(v, value_type) for v in np.asarray(values).tolist()]
