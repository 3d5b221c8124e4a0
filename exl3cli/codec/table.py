"""Trellis-quantized token embedding tables (ExLlamaV3 1.6.5's ``--embed_bits``).

ExLlamaV3 stores a quantized embedding as two tensors next to nothing else (no
``.weight``) under the embedding's module name (``model.embed_tokens``):

| tensor | dtype | shape | meaning |
|---|---|---|---|
| ``.trellis`` | int16 | ``(vocab, groups * (1 + 16*K))`` | per row, ``groups`` rings back to back |
| ``.signs`` | float16 | ``(groups, 256)`` | ±1 per position of a group |

A row of ``hidden`` values is zero-padded to ``groups * 256`` (``groups =
ceil(hidden / 256)``) and cut into 256-wide groups. Each group is one tail-biting
trellis ring over the mul1 codebook (always mul1: no marker tensor), ``1 + 16*K``
int16 words: word 0 is the ring's float16 scale (its bit pattern), words 1.. are the
``256*K``-bit ring as little-endian uint16 words, stream bit ``b`` = bit ``b & 15``
of word ``b >> 4``. Position ``i``'s symbol is stream bits ``[i*K, (i+1)*K)`` (the
first of them its lowest bit), and its 16-bit state stacks the symbols of positions
``i, i-1, i-2, ...`` (mod 256) from bit 0 up: ``state_i = ((state_{i-1} << K) |
symbol_i) & 0xFFFF``, the linear tiles' trellis (EXL3-FORMAT.md 3.1) with another
bit order on disk and no tile permutation. The group decodes to

    group = signs[g] * H256(mul1(state) * scale)

with ``H256`` the normalised 256-point Sylvester Hadamard; the row is the groups
concatenated, trimmed to ``hidden``. K is 1..8 (``(words / groups - 1) / 16``).

Public API:
- ``TABLE_GROUP`` (256), ``table_words(k_bits)``, ``table_groups(hidden)``.
- ``pack_rings(states[N, 256], scales[N]) -> int16 (N, 1 + 16*K)`` and
  ``unpack_rings(packed, k_bits) -> (states int64 (N, 256), scales float16 (N,))``.
- ``table_k_bits(trellis, signs) -> int`` (ModelLoadError on shapes that disagree).
- ``decode_table(trellis, signs, hidden, rows=None) -> float16 (rows, hidden)``:
  the whole table (or the rows given), decoded in chunks.
"""

from __future__ import annotations

import torch

from exl3cli.codec.codebooks import codebook_lut
from exl3cli.codec.hadamard import hadamard_matrix
from exl3cli.errors import ModelLoadError

TABLE_GROUP = 256
_DECODE_CHUNK_RINGS = 16384


def table_words(k_bits: int) -> int:
    """int16 words of one ring (one 256-wide group) at ``k_bits``."""
    return 1 + TABLE_GROUP * k_bits // 16


def table_groups(hidden: int) -> int:
    return -(-hidden // TABLE_GROUP)


def pack_rings(states: torch.Tensor, scales: torch.Tensor, k_bits: int) -> torch.Tensor:
    """Rings (N, 256) of consistent states and their scales -> packed int16 words."""
    n, steps = states.shape
    symbols = states.to(torch.int64) & ((1 << k_bits) - 1)
    shifts = torch.arange(k_bits, device=states.device)
    bits = ((symbols[:, :, None] >> shifts) & 1).reshape(n, steps * k_bits // 16, 16)
    words = (bits << torch.arange(16, device=states.device)).sum(-1)
    words = torch.where(words >= 0x8000, words - 0x10000, words).to(torch.int16)
    scale_words = scales.to(torch.float16).view(torch.int16).reshape(n, 1)
    return torch.cat((scale_words, words), dim=1)


def unpack_rings(packed: torch.Tensor, k_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed rings (N, 1 + 16*K) -> states (N, 256) int64 and scales (N,) float16."""
    n = packed.shape[0]
    scales = packed[:, 0].contiguous().view(torch.float16)
    words = packed[:, 1:].to(torch.int64) & 0xFFFF
    bits = (words[:, :, None] >> torch.arange(16, device=packed.device)) & 1
    bits = bits.reshape(n, TABLE_GROUP, k_bits)
    symbols = (bits << torch.arange(k_bits, device=packed.device)).sum(-1)
    states = torch.zeros_like(symbols)
    for back in range(-(-16 // k_bits)):  # symbols of positions i, i-1, ... from bit 0 up
        states |= torch.roll(symbols, back, dims=1) << (back * k_bits)
    return states & 0xFFFF, scales


def table_k_bits(trellis: torch.Tensor, signs: torch.Tensor) -> int:
    """Bits per weight of a stored table, checked against its sign vectors."""
    if trellis.dim() != 2 or trellis.dtype != torch.int16:
        raise ModelLoadError(f"a quantized embedding's .trellis must be int16 (vocab, words), "
                             f"got {trellis.dtype} {tuple(trellis.shape)}")
    if signs.dim() != 2 or signs.shape[1] != TABLE_GROUP or signs.shape[0] < 1:
        raise ModelLoadError(f"a quantized embedding's .signs must be (groups, {TABLE_GROUP}), "
                             f"got {tuple(signs.shape)}")
    groups = signs.shape[0]
    per_group, rest = divmod(trellis.shape[1], groups)
    k_bits, odd = divmod(per_group - 1, 16)
    if rest or odd or not 1 <= k_bits <= 8:
        raise ModelLoadError(f"a quantized embedding's .trellis has {trellis.shape[1]} words per "
                             f"row, not {groups} rings of 1 + 16*K words (K = 1..8)")
    return k_bits


def decode_table(trellis: torch.Tensor, signs: torch.Tensor, hidden: int,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
    """The decoded table (or ``rows`` of it), float16 (rows, hidden), on trellis' device."""
    k_bits = table_k_bits(trellis, signs)
    groups = signs.shape[0]
    if groups * TABLE_GROUP < hidden:
        raise ModelLoadError(f"a quantized embedding of {groups} groups cannot hold "
                             f"{hidden} values per row")
    if rows is not None:
        trellis = trellis[rows]
    device = trellis.device
    lut = codebook_lut("mul1").to(device, torch.float32)
    had = hadamard_matrix(TABLE_GROUP).to(device)
    sign = signs.to(device, torch.float32)
    vocab = trellis.shape[0]
    out = torch.empty(vocab, hidden, dtype=torch.float16, device=device)
    step = max(1, _DECODE_CHUNK_RINGS // groups)
    for start in range(0, vocab, step):
        part = trellis[start : start + step]
        rings = part.reshape(-1, table_words(k_bits))
        states, scales = unpack_rings(rings, k_bits)
        values = lut[states] * scales.to(torch.float32)[:, None]
        decoded = (values @ had).view(part.shape[0], groups, TABLE_GROUP) * sign
        out[start : start + part.shape[0]] = decoded.reshape(part.shape[0], -1)[:, :hidden]
    return out
