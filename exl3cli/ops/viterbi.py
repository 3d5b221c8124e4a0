"""Tail-biting Viterbi encoder for EXL3 trellis tiles (EXL3-FORMAT.md section 5).

Given target values for tiles (in step order), find for each tile the tail-biting
walk of 256 16-bit states whose codebook values minimise the squared error, then
pack it. Step ``i`` enters state ``s`` from any state whose low ``16 - k_i`` bits
equal the high ``16 - k_i`` bits of ``s`` (the "node" ``s >> k_i``), so one step is:
minimum over the ``2^k`` predecessors of each node, then add each state's error.

Tail-biting is handled by two passes: first an unconstrained search over the ring
rotated by half a tile, whose path through step 255 (far from both loose ends) picks
the entry node; then a search of steps 0..255 that starts from that node and must
end on a state that closes the ring.

``viterbi_states`` dispatches: CUDA tensors to the CUDA kernel
(``exl3cli.ops.cuda_viterbi``) when it builds, else to the PyTorch reference on the GPU;
CPU tensors to the C++ kernel (``exl3cli.ops.cpu_kernels``) when it builds, else to the
PyTorch reference. The kernels use the same float arithmetic and tie-breaking, so
every path returns the same states. ``EXL3_NO_EXT=1`` forces the reference.

The reference is vectorised over tiles in torch; tiles are processed in chunks so
that the stored node costs (4 bytes per node per step per tile) stay bounded. On the
CPU chunks run in parallel on as many worker threads as ``torch.get_num_threads()``;
on a GPU they run one after another, each as large as the memory budget allows.

Public API:
- ``viterbi_states(targets[N, 256], k_bits, codebook) -> states[N, 256]`` (int64)
- ``viterbi_states_segments(targets, k_bits[list], counts[list], codebook)``: consecutive
  segments of tiles at their own K, one launch on a GPU; the same states as a call each.
- ``viterbi_states_reference(targets, k_bits, codebook)``: the PyTorch path alone.
- ``encode_tiles(values, k_bits, codebook) -> trellis int16 (kb, nb, 16*K)``;
  ``values`` is a tile grid ``(kb, nb, 16, 16)`` or a matrix ``(16*kb, 16*nb)``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from exl3cli.codec.bitstream import STEPS, bits_per_step, pack_states
from exl3cli.codec.codebooks import codebook_lut_float32
from exl3cli.codec.tiles import matrix_to_tiles, tile_to_steps

# Budget for the stored per-step node costs of one chunk of tiles, in bytes.
_STORED_COST_BYTES = 128 * 2**20
# Tiles per chunk at most: keeps the per-step (tiles, 65536) cost arrays cache-sized.
_MAX_CHUNK = 32
# On a GPU: one large chunk per launch sequence, bounded by this many bytes of stored
# node costs (plus ~3 (tiles, 65536) float32 temporaries per step).
_GPU_STORED_COST_BYTES = 2 * 2**30
_GPU_MAX_CHUNK = 4096


def _search(
    targets: torch.Tensor,
    steps: list[int],
    per_step: list[int],
    lut: torch.Tensor,
    lut_sq: torch.Tensor,
    start_node: torch.Tensor | None,
    keep_from: int,
) -> torch.Tensor:
    """One Viterbi pass over ``steps`` (step indices in walk order).

    With ``start_node`` the walk enters the first step from that node and must end on
    a state whose low bits are that node (closing the ring); without it both ends are
    free. The path is traced back to walk position ``keep_from - 1`` (0 at least);
    returns the states (N, positions) from there to the end.
    """
    n_tiles = targets.shape[0]
    device = targets.device
    first_kept = max(keep_from - 1, 0)
    cost = None
    # entering[p]: best cost of each node that walk position p is entered from.
    # Keeping these (instead of arg-min back-pointers, which torch computes ~50x
    # slower than the plain minimum) lets the trace-back recompute the choice.
    entering: dict[int, torch.Tensor] = {}
    for position, step in enumerate(steps):
        k = per_step[step]
        nodes = 1 << (16 - k)
        if cost is None:
            node_cost = torch.zeros(n_tiles, nodes, device=device)
            if start_node is not None:
                node_cost.fill_(float("inf"))
                node_cost.scatter_(1, start_node[:, None], 0.0)
        else:
            node_cost = cost.view(n_tiles, 1 << k, nodes).amin(dim=1)
        if position >= first_kept:
            entering[position] = node_cost
        # Squared error minus the per-step constant target^2, which changes no choice.
        cost = torch.addcmul(lut_sq, targets[:, step : step + 1], lut, value=-2.0)
        cost.view(n_tiles, nodes, 1 << k).add_(node_cost[:, :, None])

    if start_node is None:
        state = cost.argmin(dim=1)
    else:
        k_first = per_step[steps[0]]
        heads = torch.arange(1 << k_first, device=device) << (16 - k_first)
        closing = heads[None, :] | start_node[:, None]
        state = closing.gather(1, cost.gather(1, closing).argmin(dim=1, keepdim=True))[:, 0]

    path = [state]
    for position in range(len(steps) - 1, first_kept, -1):
        k = per_step[steps[position]]
        heads = torch.arange(1 << k, device=device) << (16 - k)
        candidates = heads[None, :] | (state >> k)[:, None]
        previous_step = steps[position - 1]
        k_prev = per_step[previous_step]
        candidate_cost = torch.addcmul(
            lut_sq[candidates],
            targets[:, previous_step : previous_step + 1],
            lut[candidates],
            value=-2.0,
        ) + entering[position - 1].gather(1, candidates >> k_prev)
        state = candidates.gather(1, candidate_cost.argmin(dim=1, keepdim=True))[:, 0]
        path.append(state)
    path.reverse()
    return torch.stack(path, dim=1)


def _viterbi_chunk(
    targets: torch.Tensor, per_step: list[int], lut: torch.Tensor, lut_sq: torch.Tensor
) -> torch.Tensor:
    half = STEPS // 2
    rotated = list(range(half, STEPS)) + list(range(half))
    # Pass 1: free ends on the rotated ring; read off the state of step 255, which
    # sits at walk position half - 1.
    partial = _search(targets, rotated, per_step, lut, lut_sq, None, keep_from=half)
    last_state = partial[:, 0]
    start_node = last_state & ((1 << (16 - per_step[0])) - 1)
    # Pass 2: the real ring, entered from that node and closed on it.
    return _search(targets, list(range(STEPS)), per_step, lut, lut_sq, start_node, 0)


def _check_args(targets: torch.Tensor, k_bits: float, codebook: str) -> None:
    if targets.dim() != 2 or targets.shape[1] != STEPS:
        raise ValueError(f"targets must have shape (N, {STEPS}), got {tuple(targets.shape)}")
    bits_per_step(k_bits)  # raises on an unsupported K
    if codebook != "mul1" and not float(k_bits).is_integer():
        raise ValueError("half-integer bits per weight need the mul1 codebook")
    codebook_lut_float32(codebook)  # raises on an unknown codebook


def viterbi_states(targets: torch.Tensor, k_bits: float, codebook: str = "mul1") -> torch.Tensor:
    """Best tail-biting state sequence (N, 256) for target values (N, 256) in step order,
    on the fastest path available for ``targets``' device (same states on every path)."""
    _check_args(targets, k_bits, codebook)
    if targets.shape[0] == 0:
        return torch.empty(0, STEPS, dtype=torch.int64, device=targets.device)
    if targets.is_cuda:
        from exl3cli.ops import cuda_viterbi

        if cuda_viterbi.available():
            return cuda_viterbi.viterbi_states_cuda(targets, k_bits, codebook)
    elif targets.device.type == "cpu":
        from exl3cli.ops import cpu_kernels

        if cpu_kernels.available():
            return cpu_kernels.viterbi_states_cpu(targets, k_bits, codebook)
    return viterbi_states_reference(targets, k_bits, codebook)


def viterbi_states_segments(targets: torch.Tensor, k_bits: list[float], counts: list[int],
                            codebook: str = "mul1") -> torch.Tensor:
    """``viterbi_states`` of consecutive segments of ``targets``: ``counts[i]`` tiles at
    ``k_bits[i]``. One CUDA launch for all (a chain of small launches, as in LDLQ,
    leaves most of a GPU idle); elsewhere one call per segment. Same states either way."""
    if sum(counts) != targets.shape[0] or len(counts) != len(k_bits):
        raise ValueError(f"segments {counts} do not cover the {targets.shape[0]} tiles given")
    for k in k_bits:
        _check_args(targets, k, codebook)
    if targets.is_cuda and 1 < len(k_bits):
        from exl3cli.ops import cuda_viterbi

        if cuda_viterbi.available() and len(k_bits) <= cuda_viterbi.MAX_SEGMENTS:
            return cuda_viterbi.viterbi_states_segments_cuda(targets, k_bits, counts, codebook)
    parts = torch.split(targets, list(counts))
    return torch.cat([viterbi_states(t, k, codebook) for t, k in zip(parts, k_bits, strict=True)])


def viterbi_states_reference(
    targets: torch.Tensor, k_bits: float, codebook: str = "mul1"
) -> torch.Tensor:
    """The PyTorch search on ``targets``' device (the reference for the kernels)."""
    _check_args(targets, k_bits, codebook)
    per_step = bits_per_step(k_bits)
    device = targets.device
    lut = codebook_lut_float32(codebook).to(device)
    lut_sq = lut * lut
    targets = targets.to(torch.float32)
    n_tiles = targets.shape[0]
    if n_tiles == 0:
        return torch.empty(0, STEPS, dtype=torch.int64, device=device)
    per_tile_bytes = 4 * STEPS * (1 << (16 - min(per_step)))
    if device.type != "cpu":
        # A GPU wants few large launches: chunks in sequence, each as big as allowed.
        chunk = max(1, min(_GPU_MAX_CHUNK, _GPU_STORED_COST_BYTES // per_tile_bytes))
        out = [_viterbi_chunk(targets[start : start + chunk], per_step, lut, lut_sq)
               for start in range(0, n_tiles, chunk)]
        return torch.cat(out, dim=0)
    # Parallel over chunks of tiles, one single-threaded torch worker per thread the
    # caller allows: the per-step ops are small, and intra-op threads waiting on each
    # other at every step are many times slower on a busy machine.
    workers = max(1, min(torch.get_num_threads(), n_tiles))
    chunk = min(
        _MAX_CHUNK, _STORED_COST_BYTES // (workers * per_tile_bytes), -(-n_tiles // workers)
    )
    chunk = max(1, chunk)

    def run(start: int) -> torch.Tensor:
        torch.set_num_threads(1)  # per OS thread: the caller's setting is untouched
        return _viterbi_chunk(targets[start : start + chunk], per_step, lut, lut_sq)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        out = list(pool.map(run, range(0, n_tiles, chunk)))
    return torch.cat(out, dim=0)


def encode_tiles(values: torch.Tensor, k_bits: float, codebook: str = "mul1") -> torch.Tensor:
    """Quantize values (already scaled to the codebook's range) to a packed trellis.

    ``values`` is ``(kb, nb, 16, 16)`` or an ``(in, out)`` matrix with both sides
    multiples of 16; returns int16 ``(kb, nb, 16*K)``.
    """
    if values.dim() == 2:
        values = matrix_to_tiles(values)
    if values.dim() != 4 or tuple(values.shape[2:]) != (16, 16):
        raise ValueError(f"expected (kb, nb, 16, 16) tiles or a matrix, got {tuple(values.shape)}")
    kb, nb = values.shape[:2]
    targets = tile_to_steps(values.to(torch.float32)).reshape(kb * nb, STEPS)
    states = viterbi_states(targets, k_bits, codebook)
    return pack_states(states, k_bits).reshape(kb, nb, -1)
