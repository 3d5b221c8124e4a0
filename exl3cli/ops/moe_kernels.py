"""The mixture-of-experts decode step on EXL3 experts (``csrc/ops/cuda/moe_decode.cu``,
``moe_gemm_*.cu``), with its pure-PyTorch twin (the path on CPU, and what the ``cuda``
tests compare with).

For R rows and their top-k experts (ids and weights stay on the device: nothing is read
back, every shape is fixed by R and k, so a CUDA graph captures the step), seven launches:

    route   ids -> plan: the R*k (row, expert) pairs sorted by expert ("slots"), the
            experts that received pairs, their first slot and count
    in      x[row] * suh_gate[e] and * suh_up[e] + input Hadamard, per slot
    GEMM    gate | up: one block row per (active expert, part); the expert's trellis comes
            from a device array of per-expert pointers and its rows are its slots, so
            each chosen expert's weights are read once whatever the rows that chose it
    glu     H(split sums) * svh[e] (gate, up), act(g) * u, * suh_down[e] + H
    GEMM    down
    out     H(split sums) * svh_down[e], times the routing weights, summed per row

Each step rounds to the activation dtype where ``MoEMLP``'s per-expert path (EXL3
``GatedMLP`` experts, engine/layers/moe.py) rounds; the weighted sum is float32 with one
rounding (as ``StackedExperts`` sums).

Public API:
- ``ExpertTables.build(gates, ups, downs, activation, hidden) -> ExpertTables | None``:
  the stacked suh/svh and the per-expert trellis pointers of the experts' EXL3 linears
  (trellis mode, one K, codebook and padded shape, no biases; SiLU or tanh-GELU;
  gate/up columns past the logical width are padding and read as 0); None
  otherwise. The linears' own float32 suh/svh copies become views of the stacked
  tables (no second copy). ``engine/layers/moe_decode.py`` builds them from experts.
- ``moe_experts(x[R, H], weights[R, k] float32, chosen[R, k] int64, tables, out=None)
  -> [R, H]`` in x's dtype: the CUDA kernels for R <= 64 on CUDA, else the twin;
  ``runs_on_kernels(x, tables)`` says which.
- ``moe_experts_routed(x, logits[R, E], top_k, normalize, scale, tables, out=None)
  -> (out, weights, chosen)``: the router's softmax / top-k / renormalisation fused into
  the routing kernel (E <= 256; one launch instead of seven), then the same steps.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from exl3cli.codec import block_hadamard, decode_tiles
from exl3cli.ops import cuda_kernels as kernels

_ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1}
_DTYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


class ExpertTables(NamedTuple):
    """Everything the kernels read of one MoE block's experts (module docstring)."""

    trellises: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]  # gate/up/down
    pointers: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # int64 (experts,) each
    suh: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # float32 (experts, padded in)
    svh: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # float32 (experts, padded out)
    k2: int
    codebook: str
    activation: str  # "silu" or "gelu_pytorch_tanh"
    hidden: int  # output columns (the model's hidden size)
    inter: int  # the experts' logical width (gate/up columns past it are padding)
    splits: dict[tuple[int, int], int]  # (pairs, projection) -> splits, filled on first use

    @property
    def num_experts(self) -> int:
        return len(self.trellises[0])

    @staticmethod
    def build(gates: list[Any], ups: list[Any], downs: list[Any], activation: str,
              hidden: int) -> ExpertTables | None:
        """From the experts' EXL3 linears in trellis mode (engine/layers/linear.py's
        Exl3Linear: trellis, suh, svh, k, codebook, padded_in/out, bias), or None when
        the kernels cannot run them (module docstring)."""
        linears = (gates, ups, downs)
        if not gates or _ACTIVATIONS.get(activation) is None:
            return None
        every = [layer for group in linears for layer in group]
        if any(layer.bias is not None for layer in every):
            return None
        if len({kernels._k2(layer.k) for layer in every}) != 1:
            return None
        if len({layer.codebook for layer in every}) != 1:
            return None
        for group in linears:
            if len({(layer.padded_in, layer.padded_out, layer.in_features, layer.out_features)
                    for layer in group}) != 1:
                return None
        gate, up, down = gates[0], ups[0], downs[0]
        if (gate.padded_in != down.padded_out or gate.padded_out != down.padded_in
                or (up.padded_in, up.padded_out) != (gate.padded_in, gate.padded_out)
                or not gate.out_features == up.out_features == down.in_features):
            return None
        device = gate.trellis.device
        trellises = tuple([layer.trellis.contiguous() for layer in group] for group in linears)
        pointers = tuple(torch.tensor([t.data_ptr() for t in group], dtype=torch.int64,
                                      device=device) for group in trellises)
        suh = tuple(_stack_into(group, "suh") for group in linears)
        svh = tuple(_stack_into(group, "svh") for group in linears)
        return ExpertTables(trellises, pointers, suh, svh,  # type: ignore[arg-type]
                            kernels._k2(gate.k), gate.codebook, activation, hidden,
                            gate.out_features, {})


def _stack_into(layers: list[Any], name: str) -> torch.Tensor:
    """Stack the layers' float32 `name` vectors; on CUDA each layer's own copy (the
    kernels' `suh32`/`svh32`) becomes a view of its row."""
    own = [getattr(layer, f"{name}32", None) for layer in layers]
    stacked = torch.stack([o if o is not None else getattr(layer, name).float()
                           for o, layer in zip(own, layers, strict=True)]).contiguous()
    for row, (o, layer) in enumerate(zip(own, layers, strict=True)):
        if o is not None:
            setattr(layer, f"{name}32", stacked[row])
    return stacked


def runs_on_kernels(x: torch.Tensor, tables: ExpertTables) -> bool:
    """Whether ``moe_experts(x, ...)`` runs the CUDA kernels (else the PyTorch twin)."""
    return _use_kernels(x, tables) is not None


def _use_kernels(x: torch.Tensor, tables: ExpertTables) -> Any:
    ext = kernels._use_ext(x, tables.pointers[0])
    if ext is None or not hasattr(ext, "moe_route") or x.dtype not in _DTYPES:
        return None
    if not 1 <= x.shape[0] <= kernels.FUSED_MAX_ROWS or tables.num_experts > 1024:
        return None
    return ext


def moe_experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                tables: ExpertTables, out: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring; `out` ([R, H], unit column stride) receives the result."""
    ext = _use_kernels(x, tables)
    if ext is None:
        result = reference_moe_experts(x, weights, chosen, tables)
        return result if out is None else out.copy_(result)
    rows, top_k = chosen.shape
    plan = _new_plan(rows * top_k, tables, x.device)
    ext.moe_route(chosen.contiguous(), tables.num_experts, plan)
    return _run(ext, x, weights.float().contiguous(), top_k, plan, tables, out)


def moe_experts_routed(x: torch.Tensor, logits: torch.Tensor, top_k: int, normalize: bool,
                       scale: float, tables: ExpertTables, out: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's softmax top-k over `logits` [R, E] (renormalised when `normalize`,
    times `scale`: engine/layers/moe.py's Router with scoring "softmax", no score bias,
    one group) fused into the routing kernel, then the experts: (out [R, H], weights
    [R, k] float32, chosen [R, k] int64). Ties go to the lower expert."""
    ext = _use_kernels(x, tables)
    if ext is None or logits.shape[1] > ROUTER_MAX_EXPERTS or logits.dtype not in _DTYPES:
        probs = torch.softmax(logits.float(), dim=-1)
        weights, chosen = torch.topk(probs, top_k, dim=-1)
        if normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights * scale
        return moe_experts(x, weights, chosen, tables, out), weights, chosen
    rows = x.shape[0]
    plan = _new_plan(rows * top_k, tables, x.device)
    weights = torch.empty(rows, top_k, dtype=torch.float32, device=x.device)
    chosen = torch.empty(rows, top_k, dtype=torch.int64, device=x.device)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    ext.moe_route_logits(logits, top_k, normalize, float(scale), weights, chosen, plan)
    return _run(ext, x, weights, top_k, plan, tables, out), weights, chosen


ROUTER_MAX_EXPERTS = 256  # csrc/ops/cuda/moe_route.cuh kRouterMax


def _new_plan(pairs: int, tables: ExpertTables, device: torch.device) -> torch.Tensor:
    slots = min(tables.num_experts, pairs)
    return torch.empty(1 + 3 * pairs + 3 * slots, dtype=torch.int32, device=device)


COMBINE_MAX_PAIRS = 16  # moe_gemm_combine: one warp per 128 columns sums every pair


def _run(ext: Any, x: torch.Tensor, weights: torch.Tensor, top_k: int, plan: torch.Tensor,
         tables: ExpertTables, out: torch.Tensor | None,
         residual: torch.Tensor | None = None,
         counters: torch.Tensor | None = None) -> torch.Tensor:
    """The launches after the routing plan (module docstring); `residual` [R, H] in x's
    dtype is added by the last one (``moe_out``) as ``residual + result`` rounds. With
    `counters` (int32, >= padded hidden / 128, zero before the first call) and at most
    COMBINE_MAX_PAIRS pairs, the down GEMM does moe_out's work itself
    (``moe_gemm_combine``: one launch fewer)."""
    rows = x.shape[0]
    pairs = rows * top_k
    slots = min(tables.num_experts, pairs)
    device = x.device
    gate_t, _, down_t = (group[0] for group in tables.trellises)
    kb_h, nb_i, kb_i, nb_h = gate_t.shape[0], gate_t.shape[1], down_t.shape[0], down_t.shape[1]
    pad_h, pad_i = 16 * kb_h, 16 * nb_i
    cb = kernels._codebook_id(tables.codebook, tables.k2)
    if x.stride(-1) != 1:
        x = x.contiguous()
    xg = torch.empty(pairs, pad_h, dtype=torch.float16, device=device)
    xu = torch.empty_like(xg)
    ext.moe_in(x, plan, top_k, [tables.suh[0], tables.suh[1]], [xg, xu])
    splits = _splits(tables, pairs, slots, 0, kb_h, 2 * nb_i, device)
    pg = torch.empty(splits, pairs, pad_i, dtype=torch.float32, device=device)
    pu = torch.empty_like(pg)
    ext.moe_gemm(plan, [tables.pointers[0], tables.pointers[1]], [xg, xu], [pg, pu],
                 [nb_i, nb_i], kb_h, tables.k2, cb, rows, slots)
    xd = torch.empty(pairs, pad_i, dtype=torch.float16, device=device)
    ext.moe_glu(pg, pu, tables.inter, tables.svh[0], tables.svh[1],
                _ACTIVATIONS[tables.activation],
                tables.suh[2], plan, xd, _DTYPES[x.dtype])
    splits = _splits(tables, pairs, slots, 1, kb_i, nb_h, device)
    pd = torch.empty(splits, pairs, pad_h, dtype=torch.float32, device=device)
    if out is None:
        out = torch.empty(rows, tables.hidden, dtype=x.dtype, device=device)
    if counters is not None and pairs <= COMBINE_MAX_PAIRS and rows <= 8:
        ext.moe_gemm_combine(plan, tables.pointers[2], xd, pd, nb_h, kb_i, tables.k2, cb,
                             slots, tables.svh[2], weights, top_k, out, residual, counters)
        return out
    ext.moe_gemm(plan, [tables.pointers[2]], [xd], [pd], [nb_h], kb_i, tables.k2, cb, rows,
                 slots)
    ext.moe_out(pd, tables.svh[2], weights, plan, top_k, out, residual)
    return out


def _splits(tables: ExpertTables, pairs: int, slots: int, projection: int, kb: int, nb: int,
            device: torch.device) -> int:
    """Splits of one projection's GEMM, as the dense GEMM chooses them for the tile
    columns of every expert slot at the mean rows per expert."""
    key = (pairs, projection)
    if key not in tables.splits:
        tables.splits[key] = kernels.choose_splits(kb, nb * slots, device,
                                                   rows=-(-pairs // slots))
    return tables.splits[key]


def _project(x: torch.Tensor, tables: ExpertTables, index: int, expert: int,
             dtype: torch.dtype, decoded: dict[tuple[int, int], torch.Tensor]) -> torch.Tensor:
    """Projection `index` (gate, up, down) of `expert` on a padded float32 row, rounded
    to `dtype` (float32 result): H(H(x * suh) in float16 @ Ŵ) * svh (Ŵ decoded once per
    call into `decoded`)."""
    xh = block_hadamard(x * tables.suh[index][expert], dim=-1).half().float()
    key = (index, expert)
    if key not in decoded:
        decoded[key] = decode_tiles(tables.trellises[index][expert], tables.k2 / 2,
                                    tables.codebook).float()
    y = block_hadamard(xh @ decoded[key], dim=-1) * tables.svh[index][expert]
    return y.to(dtype).float()


def reference_moe_experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                          tables: ExpertTables) -> torch.Tensor:
    """The kernels' steps in PyTorch (any device; reads the expert ids back)."""
    rows, top_k = chosen.shape
    dtype = x.dtype
    pad_h = 16 * tables.trellises[0][0].shape[0]
    xs = F.pad(x.float(), (0, pad_h - x.shape[1]))
    ids = chosen.reshape(-1).tolist()
    w = weights.reshape(-1).float().to(dtype).float()
    out = torch.zeros(rows, pad_h, dtype=torch.float32, device=x.device)
    decoded: dict[tuple[int, int], torch.Tensor] = {}
    for pair, e in enumerate(ids):
        g = _project(xs[pair // top_k], tables, 0, e, dtype, decoded)
        u = _project(xs[pair // top_k], tables, 1, e, dtype, decoded)
        act = (F.silu(g.to(dtype)) if _ACTIVATIONS[tables.activation] == 0
               else F.gelu(g.to(dtype), approximate="tanh")).float()
        a = (act.to(dtype).float() * u).to(dtype).float()
        a[tables.inter :] = 0  # padding columns of gate/up
        y = _project(a, tables, 2, e, dtype, decoded)
        out[pair // top_k] += (y * w[pair]).to(dtype).float()
    return out[:, : tables.hidden].to(dtype)
