"""Decode EXL3 trellis tiles and rebuild full linear weights (EXL3-FORMAT.md 2-4).

Public API:
- ``decode_tiles(trellis[kb, nb, words], k_bits=None, codebook="mul1")
  -> Tensor[float16, (16*kb, 16*nb)]``: the rotated weight ``Ŵ``, bit-exact with
  ExLlamaV3's kernel. Vectorised over all tiles (processed in bounded chunks).
- ``codebook_from_tensors(tensors) -> str``: ``"mul1"``, ``"mcg"`` or ``"3inst"``.
- ``unpack_sign_bits(packed[int16], length) -> Tensor[float32]``: legacy ``.su``/``.sv``.
- ``dequantize_linear(tensors, in_features, out_features) -> Tensor[float32, (in, out)]``:
  ``W = diag(suh)·Hblk·Ŵ·Hblk·diag(svh)`` trimmed to the logical shape, so that
  ``y = x @ W (+ bias, added by the caller)``.

``tensors`` maps names to the stored tensors of ONE module; only the part after the
last dot counts, so ``{"trellis": t}``, ``{".trellis": t}`` and full keys such as
``{"model.layers.0.mlp.up_proj.trellis": t}`` all work.
"""

from __future__ import annotations

import torch

from exl3cli.codec.bitstream import k_bits_from_words, unpack_states
from exl3cli.codec.codebooks import MARKER_VALUES, codebook_lut
from exl3cli.codec.device_tables import on_device
from exl3cli.codec.hadamard import block_hadamard
from exl3cli.codec.tiles import position_to_step
from exl3cli.errors import ModelLoadError

# Tiles decoded per chunk: bounds the int64 state temporaries (~2 KiB per tile each).
_DECODE_CHUNK_TILES = 8192


def _by_suffix(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name.rsplit(".", 1)[-1]: value for name, value in tensors.items()}


def codebook_from_tensors(tensors: dict[str, torch.Tensor]) -> str:
    """Codebook of a quantized linear from its marker tensor (none means 3INST)."""
    found = _by_suffix(tensors)
    markers = [name for name in ("mul1", "mcg") if name in found]
    if len(markers) > 1:
        raise ModelLoadError("EXL3 linear carries both .mul1 and .mcg markers")
    if not markers:
        return "3inst"
    name = markers[0]
    value = int(found[name].reshape(-1)[0].item())
    if value != MARKER_VALUES[name]:
        raise ModelLoadError(f"EXL3 .{name} marker holds {value}, expected {MARKER_VALUES[name]}")
    return name


def decode_tiles(
    trellis: torch.Tensor, k_bits: float | None = None, codebook: str = "mul1"
) -> torch.Tensor:
    """Decode a packed trellis (kb, nb, words) to the rotated weight (16*kb, 16*nb)."""
    if trellis.dim() != 3:
        raise ValueError(f"trellis must be (kb, nb, words), got {tuple(trellis.shape)}")
    kb, nb, words = trellis.shape
    if k_bits is None:
        k_bits = k_bits_from_words(words)
    lut = on_device(codebook_lut(codebook), trellis.device)
    order = on_device(position_to_step(), trellis.device)
    out = torch.empty(kb, 16, nb, 16, dtype=torch.float16, device=trellis.device)
    rows_per_chunk = max(1, _DECODE_CHUNK_TILES // max(nb, 1))
    for start in range(0, kb, rows_per_chunk):
        part = trellis[start : start + rows_per_chunk]
        states = unpack_states(part, k_bits)[..., order]  # tile (row, col) order
        values = lut[states].view(part.shape[0], nb, 16, 16)
        out[start : start + part.shape[0]] = values.permute(0, 2, 1, 3)
    return out.view(16 * kb, 16 * nb)


def unpack_sign_bits(packed: torch.Tensor, length: int) -> torch.Tensor:
    """Legacy ``.su``/``.sv``: bit i of int16 word j is the sign of element 16*j + i
    (1 = negative). Returns +-1 as float32, ``length`` entries."""
    words = packed.reshape(-1).to(torch.int64) & 0xFFFF
    bits = (words[:, None] >> torch.arange(16, device=packed.device)) & 1
    signs = 1.0 - 2.0 * bits.reshape(-1).to(torch.float32)
    if signs.numel() < length:
        raise ModelLoadError(f"packed sign vector covers {signs.numel()} of {length} entries")
    return signs[:length]


def _side_scale(
    found: dict[str, torch.Tensor], scaled: str, legacy: str, padded: int
) -> torch.Tensor:
    if scaled in found:
        scale = found[scaled].reshape(-1).to(torch.float32)
    elif legacy in found:
        scale = unpack_sign_bits(found[legacy], min(padded, 16 * found[legacy].numel()))
    else:
        raise ModelLoadError(f"EXL3 linear has neither .{scaled} nor .{legacy}")
    if scale.numel() > padded:
        raise ModelLoadError(f".{scaled} has {scale.numel()} entries, trellis covers {padded}")
    # Rows/columns beyond the stored vector are padding: they are trimmed anyway.
    return torch.nn.functional.pad(scale, (0, padded - scale.numel()))


def dequantize_linear(
    tensors: dict[str, torch.Tensor], in_features: int, out_features: int
) -> torch.Tensor:
    """Full float32 weight (in_features, out_features) of one EXL3 quantized linear."""
    found = _by_suffix(tensors)
    if "trellis" not in found:
        raise ModelLoadError("EXL3 linear has no .trellis tensor")
    trellis = found["trellis"]
    if trellis.dim() != 3 or trellis.dtype != torch.int16:
        raise ModelLoadError(
            f".trellis must be int16 (in/16, out/16, words), got {trellis.dtype} "
            f"{tuple(trellis.shape)}"
        )
    try:
        k_bits = k_bits_from_words(trellis.shape[-1])
    except ValueError as exc:
        raise ModelLoadError(f".trellis has {trellis.shape[-1]} words per tile: {exc}") from exc
    codebook = codebook_from_tensors(tensors)
    if codebook != "mul1" and not k_bits.is_integer():
        raise ModelLoadError(f"K={k_bits} needs the mul1 codebook, found {codebook}")
    padded_in, padded_out = 16 * trellis.shape[0], 16 * trellis.shape[1]
    if padded_in % 128 or padded_out % 128:
        raise ModelLoadError(f"trellis covers {padded_in}x{padded_out}, not multiples of 128")
    if in_features > padded_in or out_features > padded_out:
        raise ModelLoadError(
            f"logical shape {in_features}x{out_features} exceeds stored {padded_in}x{padded_out}"
        )
    suh = _side_scale(found, "suh", "su", padded_in)
    svh = _side_scale(found, "svh", "sv", padded_out)
    rotated = decode_tiles(trellis, k_bits, codebook).to(torch.float32)
    weight = block_hadamard(block_hadamard(rotated, dim=0), dim=1)
    weight = weight * suh[:, None] * svh[None, :]
    return weight[:in_features, :out_features].contiguous()
