"""Block LDL of a Hessian and LDLQ: quantize 16-row blocks, feeding errors forward.

With ``W`` (in, out) quantized block by block (rows ``16k .. 16k+15`` in order), LDLQ
quantizes ``W_k + Σ_{j<k} A_kj (W_j - Q_j)`` for a strictly block-lower ``A``. The
errors then satisfy ``(I + A) E = η`` (η: each block's own rounding error), and the
proxy loss ``tr(Eᵀ H E)`` equals ``Σ_k tr(η_kᵀ D_k η_k)`` exactly when
``H = (I + A)ᵀ D (I + A)`` with ``D`` block diagonal. That factorisation is a block LDL
of ``H`` with the block order reversed, computed here from a Cholesky factor.

Public API:
- ``block_ldl_feedback(h, block=16) -> (a, d)``: ``a`` (n, n) strictly block-lower
  feedback matrix, ``d`` (n/block, block, block) diagonal blocks; ``h = (I+a)ᵀ·D·(I+a)``.
  ``block_ldl_diagonal(h, block=16) -> d`` alone (the same values, no solve).
- ``ldlq(target, h, quantize_block, block=16) -> (q, payloads)``: runs the loop with
  any block quantizer ``quantize_block(rows[block, out]) -> (values[block, out],
  payload)``; returns the quantized matrix and the payloads in block order.
- ``trellis_block_quantizer(k_bits, codebook) -> quantize_block`` whose payload is the
  packed trellis row ``(1, out/16, 16*K)`` of that block (Viterbi per tile).
- ``ldlq_parts(targets, hessians, quantize_blocks, block=16) -> [(q, payloads)]``: ``ldlq``
  of independent parts (same rows) in lock step, one ``quantize_blocks(rows[]) ->
  [(values, payload)]`` call per block; ``trellis_parts_quantizer(k_bits[], codebook)``
  is one (part i at K_i, one Viterbi launch for all parts' tiles on a GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from exl3cli.codec import codebook_lut, pack_states
from exl3cli.codec.device_tables import on_device
from exl3cli.codec.tiles import matrix_to_tiles, steps_to_tile, tile_to_steps, tiles_to_matrix
from exl3cli.ops.viterbi import viterbi_states, viterbi_states_segments

BlockQuantizer = Callable[[torch.Tensor], tuple[torch.Tensor, Any]]


def _cholesky_with_retry(h: torch.Tensor) -> torch.Tensor:
    """Cholesky factor; adds growing diagonal damping if h is numerically singular."""
    mean_diag = h.diagonal().mean().clamp_min(1e-30)
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    extra = 0.0
    for _ in range(8):
        factor, info = torch.linalg.cholesky_ex(h + extra * mean_diag * eye)
        if int(info) == 0:
            return factor
        extra = 1e-4 if extra == 0.0 else extra * 10
    raise ValueError("Hessian is not positive definite even after damping")


def _reversed_cholesky(h: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Cholesky factor ``C`` of ``h`` with its order reversed, and its diagonal
    blocks ``C_kk`` (blocks, block, block)."""
    n = h.shape[0]
    if n % block:
        raise ValueError(f"Hessian size {n} is not a multiple of {block}")
    h64 = h.to(torch.float64)
    # Reversing the order turns the needed "U D Uᵀ" into an ordinary lower factorisation.
    reversed_h = h64.flip(0).flip(1)
    chol = _cholesky_with_retry(reversed_h)  # reversed_h = C Cᵀ
    blocks = n // block
    diag_blocks = chol.view(blocks, block, blocks, block).diagonal(dim1=0, dim2=2)
    return chol, diag_blocks.permute(2, 0, 1)  # (blocks, block, block), lower triangular


def block_ldl_diagonal(h: torch.Tensor, block: int = 16) -> torch.Tensor:
    """``block_ldl_feedback(h, block)[1]`` (the same values) without the feedback matrix."""
    _, diag_blocks = _reversed_cholesky(h, block)
    d_rev = diag_blocks @ diag_blocks.transpose(1, 2)
    return d_rev.flip(0).flip(1).flip(2)


def block_ldl_feedback(h: torch.Tensor, block: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, d)`` with ``h = (I + a)ᵀ · blockdiag(d) · (I + a)``, ``a`` strictly block-lower."""
    n = h.shape[0]
    chol, diag_blocks = _reversed_cholesky(h, block)
    # L' = C · blockdiag(C_kk)^-1 has identity diagonal blocks; D'_k = C_kk C_kkᵀ.
    block_diag = torch.block_diag(*diag_blocks)
    unit_lower = torch.linalg.solve_triangular(block_diag, chol, upper=False, left=False)
    d_rev = diag_blocks @ diag_blocks.transpose(1, 2)
    # Undo the reversal: h = (P L'ᵀ P)ᵀ (P D' P) (P L'ᵀ P) with M = P L'ᵀ P block-lower.
    m = unit_lower.T.flip(0).flip(1)
    # Exactly zero on and above the diagonal blocks (the solve leaves ~1e-16 there).
    index = torch.arange(n, device=m.device) // block
    a = torch.where(index[:, None] > index[None, :], m, torch.zeros((), dtype=m.dtype,
                                                                  device=m.device))
    d = d_rev.flip(0).flip(1).flip(2)  # reversed block order; each block reversed too
    return a, d


def ldlq(
    target: torch.Tensor,
    h: torch.Tensor,
    quantize_block: BlockQuantizer,
    block: int = 16,
) -> tuple[torch.Tensor, list[Any]]:
    """Quantize ``target`` (in, out) in ``block``-row blocks with LDLQ error feedback."""
    return ldlq_parts([target], [h], lambda rows: [quantize_block(rows[0])], block)[0]


def ldlq_parts(
    targets: list[torch.Tensor],
    hessians: list[torch.Tensor],
    quantize_blocks: Callable[[list[torch.Tensor]], list[tuple[torch.Tensor, Any]]],
    block: int = 16,
) -> list[tuple[torch.Tensor, list[Any]]]:
    """``ldlq`` of several independent (target, h) pairs with the same number of rows,
    in lock step: ``quantize_blocks`` gets every part's rows of one block at once (one
    Viterbi launch for all of them); each part's result is what ``ldlq`` gives it."""
    feedback = [block_ldl_feedback(h, block)[0].to(device=t.device, dtype=torch.float32)
                for t, h in zip(targets, hessians, strict=True)]
    targets = [t.to(torch.float32) for t in targets]
    quantized = [torch.empty_like(t) for t in targets]
    errors = [torch.zeros_like(t) for t in targets]
    payloads: list[list[Any]] = [[] for _ in targets]
    for start in range(0, targets[0].shape[0], block):
        stop = start + block
        rows = []
        for t, a, e in zip(targets, feedback, errors, strict=True):
            part = t[start:stop]
            rows.append(part + a[start:stop, :start] @ e[:start] if start else part)
        for i, (values, payload) in enumerate(quantize_blocks(rows)):
            quantized[i][start:stop] = values
            errors[i][start:stop] = targets[i][start:stop] - values
            payloads[i].append(payload)
    return list(zip(quantized, payloads, strict=True))


def trellis_block_quantizer(k_bits: float, codebook: str = "mul1") -> BlockQuantizer:
    """A block quantizer for ``ldlq``: one Viterbi search per 16x16 tile of the block."""
    lut_cache: dict[torch.device, torch.Tensor] = {}

    def quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if rows.device not in lut_cache:
            lut_cache[rows.device] = on_device(codebook_lut(codebook), rows.device,
                                                    torch.float32)
        tiles = matrix_to_tiles(rows)  # (1, nb, 16, 16)
        targets = tile_to_steps(tiles).reshape(-1, 256)
        states = viterbi_states(targets, k_bits, codebook)
        values = steps_to_tile(lut_cache[rows.device][states]).reshape(tiles.shape)
        packed = pack_states(states, k_bits).reshape(1, tiles.shape[1], -1)
        return tiles_to_matrix(values), packed

    return quantize


def trellis_parts_quantizer(k_bits: list[float], codebook: str = "mul1") -> Callable:
    """A ``quantize_blocks`` for ``ldlq_parts``: part ``i`` at ``k_bits[i]``, the tiles of
    all parts searched in one ``viterbi_states_segments`` call; per part the values and
    packed row ``trellis_block_quantizer(k_bits[i])`` gives."""
    lut_cache: dict[torch.device, torch.Tensor] = {}

    def quantize(rows: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        device = rows[0].device
        if device not in lut_cache:
            lut_cache[device] = on_device(codebook_lut(codebook), device, torch.float32)
        widths = [r.shape[1] // 16 for r in rows]
        # Tiles run along the columns, so the joined block's tiles are the parts' in turn.
        tiles = matrix_to_tiles(torch.cat(rows, dim=1))  # (1, sum nb, 16, 16)
        states = viterbi_states_segments(tile_to_steps(tiles).reshape(-1, 256), k_bits,
                                         widths, codebook)
        values = tiles_to_matrix(steps_to_tile(lut_cache[device][states]).reshape(tiles.shape))
        out = []
        for s, v, k, n in zip(torch.split(states, widths), torch.split(values, [16 * w for w in widths], dim=1),
                              k_bits, widths, strict=True):
            out.append((v, pack_states(s, k).reshape(1, n, -1)))
        return out

    return quantize
