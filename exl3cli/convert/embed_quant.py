"""Quantize a token embedding table to ExLlamaV3's trellis table (``--embed-bits``).

The layout is codec/table.py's. Each row is zero-padded to whole 256-wide groups,
multiplied by one random ±1 vector per group (stored as ``.signs``) and rotated by the
256-point Hadamard, so each group's values are close to Gaussian; a group is scaled
to unit RMS times one multiplier per table (searched on a sample of groups, like a
linear's global scale), encoded by the tail-biting Viterbi over the mul1 codebook,
and stored with the least-squares scale of its decoded values (float16). No Hessian:
every row is read as it is (a lookup, not a product), so the plain squared error of
the row is what a row's use costs.

Public API:
- ``quantize_table(weight[vocab, hidden], k_bits, seed=0, name="")
  -> QuantizedTable(tensors {"trellis", "signs"}, decoded float16 (vocab, hidden),
  error)``: ``error`` is the relative squared error ``|W - Q|² / |W|²`` of the table
  as a loader decodes it.
- ``EMBED_FILE``; ``embed_checkpoint(conv, work_dir, resume, k_bits) -> {"decoded",
  "error"}``: the converter's table, quantized once and kept in the work folder
  (``--resume`` reads it back); its tensors are ``trellis`` and ``signs`` there.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from exl3cli.codec import codebook_lut
from exl3cli.codec.hadamard import hadamard_matrix
from exl3cli.codec.table import TABLE_GROUP, decode_table, pack_rings, table_groups
from exl3cli.convert.work_folder import atomic_save, load_checkpoint
from exl3cli.ops.viterbi import viterbi_states

# Divisors of the unit-RMS group tried for the table's multiplier (as a linear's).
_DIVISORS = (0.94, 1.0, 1.06, 1.12, 1.2)
_SAMPLE_RINGS = 64
_CHUNK_ROWS = 4096
EMBED_FILE = "embed.safetensors"


@dataclass
class QuantizedTable:
    tensors: dict[str, torch.Tensor]
    decoded: torch.Tensor
    error: float


def _signs(groups: int, seed: int, name: str, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device="cpu")
    gen.manual_seed((seed * 1_000_003 + zlib.crc32((name + ".signs").encode())) % (2**63))
    bits = torch.randint(0, 2, (groups, TABLE_GROUP), generator=gen)
    return (1 - 2 * bits).to(device, torch.float16)


def _rotated(rows: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Rows (n, hidden) -> their groups, signed and rotated: (n * groups, 256) float32."""
    groups = signs.shape[0]
    padded = torch.nn.functional.pad(rows.to(torch.float32),
                                     (0, groups * TABLE_GROUP - rows.shape[1]))
    signed = padded.view(-1, groups, TABLE_GROUP) * signs.to(torch.float32)
    return signed.reshape(-1, TABLE_GROUP) @ hadamard_matrix(TABLE_GROUP).to(rows.device)


def _unit(rings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rms = rings.pow(2).mean(1).sqrt()
    rms = torch.where(rms > 1e-12, rms, torch.ones_like(rms))  # an all-zero group
    return rings / rms[:, None], rms


def _multiplier(weight: torch.Tensor, signs: torch.Tensor, k_bits: int,
                lut: torch.Tensor) -> float:
    """The multiplier of the unit-RMS groups with the least squared error on a sample."""
    cb_rms = float(lut.pow(2).mean().sqrt())
    pick = torch.linspace(0, weight.shape[0] - 1, min(_SAMPLE_RINGS, weight.shape[0]))
    unit, _ = _unit(_rotated(weight[pick.round().long()], signs))
    candidates = [cb_rms / d for d in _DIVISORS]
    batch = torch.cat([unit * m for m in candidates])
    values = lut[viterbi_states(batch, k_bits, "mul1")].view(len(candidates), *unit.shape)
    errors = [float((values[i] / m - unit).pow(2).mean()) for i, m in enumerate(candidates)]
    return candidates[min(range(len(errors)), key=errors.__getitem__)]


def quantize_table(weight: torch.Tensor, k_bits: int, seed: int = 0,
                   name: str = "") -> QuantizedTable:
    """Quantize an embedding table (vocab, hidden) to ``k_bits`` (1..8)."""
    if isinstance(k_bits, bool) or int(k_bits) != k_bits or not 1 <= k_bits <= 8:
        raise ValueError(f"embedding bits must be a whole number 1..8, got {k_bits!r}")
    k_bits = int(k_bits)
    device = weight.device
    vocab, hidden = weight.shape
    groups = table_groups(hidden)
    signs = _signs(groups, seed, name, device)
    lut = codebook_lut("mul1").to(device, torch.float32)
    multiplier = _multiplier(weight, signs, k_bits, lut)
    parts = []
    for start in range(0, vocab, _CHUNK_ROWS):
        rings = _rotated(weight[start : start + _CHUNK_ROWS], signs)
        unit, _ = _unit(rings)
        states = viterbi_states(unit * multiplier, k_bits, "mul1")
        values = lut[states]
        # The least-squares scale of the decoded values, in the group's own units.
        scale = (values * rings).sum(1) / values.pow(2).sum(1).clamp_min(1e-30)
        parts.append(pack_rings(states, scale.to(torch.float16), k_bits).view(-1, groups * (
            1 + TABLE_GROUP * k_bits // 16)))
    trellis = torch.cat(parts).contiguous()
    decoded = decode_table(trellis, signs, hidden)
    w = weight.to(torch.float32)
    error = float((decoded.float() - w).pow(2).sum() / w.pow(2).sum().clamp_min(1e-30))
    return QuantizedTable({"trellis": trellis, "signs": signs}, decoded, error)


def embed_checkpoint(conv, work_dir: Path, resume: bool, k_bits: int) -> dict:
    """The embedding of ``conv``'s source at ``k_bits``, from the work folder when a
    resumed run finds it there (module docstring)."""
    path = Path(work_dir) / EMBED_FILE
    name = conv.names.embed.removesuffix(".weight")
    if resume and path.is_file():
        stored, meta = load_checkpoint(path)
        hidden = conv.config.hidden_size
        return {"decoded": decode_table(stored["trellis"], stored["signs"], hidden),
                "error": float(meta["error"])}
    weight = conv.reader.get(conv.names.embed, dtype=torch.float32, device=conv.device)
    table = quantize_table(weight, k_bits, conv.options.seed, name)
    atomic_save(table.tensors, path, {"report": json.dumps({"error": table.error})})
    return {"decoded": table.decoded, "error": table.error}
