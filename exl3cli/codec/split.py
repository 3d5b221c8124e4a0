"""Cutting one stored EXL3 linear into tensor-parallel pieces, without re-quantizing.

``W (in x out) = diag(suh) · Hblk · Ŵ · Hblk · diag(svh)`` (EXL3-FORMAT.md section 4):
the Hadamard rotations are block-diagonal over runs of 128 rows and 128 columns, and
Ŵ is stored as 16 x 16 tiles (``trellis[kb, nb]``). So a run of whole 128-column
blocks of W is exactly the same blocks of Ŵ (``trellis[:, c0/16 : c1/16]``) with the
same ``svh`` entries and the whole ``suh``; rows likewise with ``suh``. A cut that
does not fall on a 128 boundary would need the weight re-rotated (and re-encoded), so
it is refused.

Public API:
- ``BLOCK`` (128): the unit of a cut.
- ``slice_exl3(found, dim, start, end, logical) -> dict[suffix, Tensor]``: the stored
  tensors of module ``found`` (by suffix, as ``format.read_exl3_linear`` gives them)
  restricted to output columns (``dim="out"``) or input rows (``dim="in"``)
  ``[start, end)`` of the logical size ``logical``. ``end == logical`` keeps the
  padding after the last logical column. ``ModelLoadError`` when a cut is off a block
  boundary.
- ``check_cut(start, end, logical, what)``: that refusal on its own.
"""

from __future__ import annotations

import torch

from exl3cli.errors import ModelLoadError

BLOCK = 128


def check_cut(start: int, end: int, logical: int, what: str) -> None:
    """ModelLoadError unless [start, end) of `logical` starts and ends on 128 blocks
    (the end of the logical size counts as one)."""
    if not 0 <= start < end <= logical:
        raise ModelLoadError(f"{what}: cannot cut [{start}, {end}) out of {logical}")
    for edge in (start, end):
        if edge % BLOCK and edge != logical:
            raise ModelLoadError(
                f"{what}: a tensor-parallel cut at {edge} of {logical} does not fall on a "
                f"{BLOCK}-wide Hadamard block (EXL3 weights split only on whole blocks; "
                "use fewer ranks, or a model whose heads/widths per rank are multiples "
                f"of {BLOCK})")


def _padded_end(end: int, logical: int, stored: int) -> int:
    return stored if end == logical else end


def slice_exl3(found: dict[str, torch.Tensor], dim: str, start: int, end: int,
               logical: int, what: str = "EXL3 linear") -> dict[str, torch.Tensor]:
    """`found` cut to columns (dim "out") or rows (dim "in") [start, end); see the module
    docstring. Scales and the bias follow their side; the codebook marker is kept."""
    if dim not in ("in", "out"):
        raise ValueError(f"dim must be 'in' or 'out', got {dim!r}")
    check_cut(start, end, logical, what)
    trellis = found["trellis"]
    axis = 0 if dim == "in" else 1
    stored = 16 * trellis.shape[axis]
    if stored < logical:
        raise ModelLoadError(f"{what}: stored {dim} size {stored} < logical {logical}")
    stop = _padded_end(end, logical, stored)
    out: dict[str, torch.Tensor] = {}
    for suffix, value in found.items():
        if suffix == "trellis":
            index = [slice(None)] * 3
            index[axis] = slice(start // 16, stop // 16)
            out[suffix] = value[tuple(index)].contiguous()
        elif suffix in ("suh", "svh", "su", "sv", "bias"):
            side = "in" if suffix in ("suh", "su") else "out"
            if side != dim:
                out[suffix] = value
            elif suffix in ("su", "sv"):  # legacy packed sign bits: 16 per int16 word
                out[suffix] = value.reshape(-1)[start // 16 : stop // 16].contiguous()
            else:
                flat = value.reshape(-1)
                out[suffix] = flat[start : min(stop, flat.numel())].contiguous()
        else:
            out[suffix] = value
    return out
