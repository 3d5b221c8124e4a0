"""Quantize the linears that share one input (q/k/v, gate/up, or a single one) to EXL3.

Steps (EXL3-FORMAT.md section 5): per-column then per-row RMS scales, random ±1 signs
and the 128-point block Hadamard on both sides make ``Ŵ`` close to i.i.d. Gaussian;
one global scale per tensor is searched on a sample of tiles; the Hessian is damped
and rotated like the weights; LDLQ with 16-row blocks runs over all tensors of the
group at once (they share the input side, so one pass serves them all), calling the
tail-biting Viterbi on each 16x16 tile.

Everything random comes from generators seeded by ``(seed, name)``: the same inputs
give the same bits, which is what lets ``--resume`` reproduce an uninterrupted run.

Public API:
- ``QuantSettings(k_bits, codebook="mul1", damping=0.02, scale_search_tiles=16, seed=0,
  fisher_strength=1.0, refit_rounds=0)``: ``refit_rounds`` > 0 refits each tensor's
  suh/svh to its searched trellis (scale_refit.py, on the damped Hessian, output
  channels weighed by their Fisher information when given), so the tensors of a group
  then carry suh vectors of their own.
- ``QuantizedLinear``: ``name``, ``tensors`` (suffix -> stored tensor: trellis int16,
  suh/svh float16, codebook marker, bias), ``weight`` (float32 (in, out), the stored
  tensors dequantized exactly as a loader sees them), ``proxy_error``.
- ``quantize_group(names, weights[(in, out_i)], biases, hessian, settings)
  -> list[QuantizedLinear]``; ``quantize_mixed(..., settings, k_bits[per tensor])``:
  the same with bits per tensor (tensors of one K quantized together).
- ``group_scales(names, weights, seed, out_weights=None) -> GroupScales(suh, sides)``:
  the scales and signs ``quantize_group`` uses (the allocation's error estimate needs
  them). ``out_weights[i]`` (optional, per output channel of tensor ``i``): how much an
  error in that channel costs the model (the Fisher information ``sensitivity.py``
  measures); given, the output scales are ``fisher_out_scales`` instead of the RMS.
- ``fisher_out_scales(col_rms, fisher, strength=1.0) -> Tensor``: the output-channel
  scales that minimise the expected cost of a codec error spread evenly in the rotated
  domain (``strength`` < 1: geometrically part-way from the RMS scales to those).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field, replace
from functools import cache

import torch

from exl3cli.codec import MARKER_VALUES, block_hadamard, codebook_lut, dequantize_linear
from exl3cli.codec.device_tables import on_device
from exl3cli.codec.format import padded_size
from exl3cli.codec.tiles import matrix_to_tiles, tile_to_steps
from exl3cli.convert.hessian import damp_hessian, pad_hessian, proxy_error, rotate_hessian
from exl3cli.convert.ldlq import (
    ldlq,
    ldlq_parts,
    trellis_block_quantizer,
    trellis_parts_quantizer,
)
from exl3cli.convert.scale_refit import refit_scales
from exl3cli.ops.viterbi import viterbi_states

# Divisors of the unit-RMS rotated weight tried by the global scale search; the codec's
# measurements put the best one between 1.0 (2 bits) and ~1.15 (4 bits).
_SCALE_DIVISORS = (0.94, 1.0, 1.06, 1.12, 1.2)


@dataclass(frozen=True)
class QuantSettings:
    k_bits: int
    codebook: str = "mul1"
    damping: float = 0.02
    scale_search_tiles: int = 16
    seed: int = 0
    fisher_strength: float = 1.0  # fisher_out_scales' strength, when out_weights are given
    refit_rounds: int = 0  # scale_refit.refit_scales rounds after the search (0: none)


@dataclass
class QuantizedLinear:
    name: str
    tensors: dict[str, torch.Tensor]
    weight: torch.Tensor
    proxy_error: float
    extra: dict[str, float] = field(default_factory=dict)


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    # crc32, not hash(): stable across processes, so a resumed run draws the same signs.
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return gen


def _random_signs(size: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    bits = torch.randint(0, 2, (size,), generator=gen, device=device)
    return (1 - 2 * bits).to(torch.float32)


def _rms(x: torch.Tensor, dim: int) -> torch.Tensor:
    rms = x.pow(2).mean(dim=dim).sqrt()
    # All-zero rows/columns (padding, dead channels) keep scale 1: nothing to scale.
    return torch.where(rms > 1e-10, rms, torch.ones_like(rms))


def _block_fill(size: int, device: torch.device) -> torch.Tensor:
    """Per index of a padded axis, sqrt(real indices in its 128-block / 128).

    The block Hadamard spreads a partly padded block's energy over all 128 positions,
    so its rotated values come out smaller than a full block's and the one global scale
    would quantize them at too low an amplitude (k/v projections of 64 or 192 columns
    lost half their precision this way). Dividing a partial block's scales by this
    factor gives every rotated block the same RMS."""
    padded = padded_size(size)
    fill = torch.full((padded // 128,), 128.0, device=device)
    if size % 128:
        fill[-1] = size % 128
    return (fill / 128).sqrt().repeat_interleave(128)[:size]


def _pad(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(w, (0, cols - w.shape[1], 0, rows - w.shape[0]))


def _codebook_rms(codebook: str, device: torch.device) -> float:
    return _codebook_rms_on(codebook, torch.device(device))


@cache
def _codebook_rms_on(codebook: str, device: torch.device) -> float:
    # Reduced on the device as before (same rounding), once: float() syncs.
    return float(on_device(codebook_lut(codebook), device, torch.float32).pow(2).mean().sqrt())


def _sample_tiles(rotated: torch.Tensor, count: int) -> torch.Tensor:
    """Evenly spaced tiles of a matrix, in step order: (count, 256)."""
    steps = tile_to_steps(matrix_to_tiles(rotated)).reshape(-1, 256)
    if steps.shape[0] <= count:
        return steps
    index = torch.linspace(0, steps.shape[0] - 1, count, device=steps.device).round().long()
    return steps[index]


def _search_scales(
    rotated: list[torch.Tensor], settings: QuantSettings, cb_rms: float
) -> list[float]:
    """Per tensor, the multiplier m (quantize ``Ŵ·m``) with the least tile MSE."""
    if settings.scale_search_tiles <= 0:
        return [cb_rms / 1.06] * len(rotated)
    samples = [_sample_tiles(r, settings.scale_search_tiles) for r in rotated]
    candidates = [cb_rms / d for d in _SCALE_DIVISORS]
    # One Viterbi call for every tensor and candidate: small calls waste the machine.
    batch = torch.cat([s * m for s in samples for m in candidates])
    states = viterbi_states(batch, settings.k_bits, settings.codebook)
    lut = on_device(codebook_lut(settings.codebook), batch.device, torch.float32)
    mse_per_tile = (lut[states] - batch).pow(2).mean(dim=1)
    means, offset = [], 0
    for s in samples:
        for _ in candidates:
            means.append(mse_per_tile[offset : offset + s.shape[0]].mean())
            offset += s.shape[0]
    means = torch.stack(means).tolist()  # one sync for all
    chosen = []
    for t in range(len(samples)):
        # Error measured back in Ŵ units, so candidates compare fairly.
        errors = [means[t * len(candidates) + c] / m**2 for c, m in enumerate(candidates)]
        chosen.append(candidates[min(range(len(errors)), key=errors.__getitem__)])
    return chosen


@dataclass
class GroupScales:
    """The input-side scale of a group (``suh``: signs x row RMS, float16-rounded) and
    each tensor's output-side factor before the global multiplier (signs x column RMS)."""
    suh: torch.Tensor
    sides: list[torch.Tensor]


# Added to the mean-normalised Fisher information before it sets output scales, so that
# a channel the calibration rows barely exercised does not take an unbounded scale.
FISHER_FLOOR = 0.02


def fisher_out_scales(col_rms: torch.Tensor, fisher: torch.Tensor,
                      strength: float = 1.0) -> torch.Tensor:
    """Output-channel scales ``t_j ∝ (σ_j² / F_j)^¼`` (σ: the column RMS, F: the Fisher
    information of the channel, floored), rescaled to the mean of ``col_rms``.

    The trellis error is about even in the rotated domain, so channel ``j`` gets an
    error energy ``∝ t_j²`` and the whole tensor, quantized at the amplitude its
    rotated values have, ``∝ Σ_j σ_j²/t_j²``: the expected cost ``(Σ F_j t_j²) ·
    (Σ σ_j²/t_j²)`` is least at the ``t`` above (Cauchy-Schwarz). Plain RMS scales are
    that optimum only when ``F_j ∝ 1/σ_j²``. ``strength`` a: ``σ^(1-a) · t^a``, a hedge
    against a noisy estimate of F."""
    f = fisher.to(col_rms.device, torch.float64).clamp_min(0)
    mean = float(f.mean())
    if not torch.isfinite(f).all() or mean <= 0:
        return col_rms
    sigma = col_rms.to(torch.float64)
    t = (sigma.pow(2) / (f / mean + FISHER_FLOOR)).pow(0.25)
    t = sigma.pow(1 - strength) * t.pow(strength)
    return (t * (sigma.mean() / t.mean())).to(col_rms.dtype)


def group_scales(names: list[str], weights: list[torch.Tensor], seed: int,
                 out_weights: list[torch.Tensor | None] | None = None,
                 strength: float = 1.0) -> GroupScales:
    """Row/column scales and random signs of linears sharing an input (``weights[i]``
    (in, out_i) float32), exactly as ``quantize_group`` draws them; ``out_weights``:
    per tensor, its output channels' Fisher information (or None: RMS scales)."""
    device = weights[0].device
    in_features = weights[0].shape[0]
    in_pad = padded_size(in_features)
    gen = _generator(seed, names[0], device)
    input_signs = _random_signs(in_pad, gen, device)
    # Column (output) scales first, then the row (input) RMS of the column-normalised group.
    col_rms = [_rms(w, dim=0) for w in weights]
    if out_weights is not None:
        col_rms = [c if f is None else fisher_out_scales(c, f, strength)
                   for c, f in zip(col_rms, out_weights, strict=True)]
    normalised = torch.cat([w / c for w, c in zip(weights, col_rms, strict=True)], dim=1)
    row_rms = _rms(normalised, dim=1) * _block_fill(in_features, device)
    row_rms = torch.nn.functional.pad(row_rms, (0, in_pad - in_features), value=1.0)
    col_rms = [c * _block_fill(c.numel(), device) for c in col_rms]
    suh = (input_signs * row_rms).to(torch.float16).to(torch.float32)
    sides = []
    for name, w, c in zip(names, weights, col_rms, strict=True):
        out_pad = padded_size(w.shape[1])
        signs = _random_signs(out_pad, _generator(seed, name + ".out", device), device)
        sides.append(signs * torch.nn.functional.pad(c, (0, out_pad - w.shape[1]), value=1.0))
    return GroupScales(suh, sides)


def quantize_mixed(
    names: list[str],
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    hessian: torch.Tensor,
    settings: QuantSettings,
    k_bits: list[int],
    out_weights: list[torch.Tensor | None] | None = None,
) -> list[QuantizedLinear]:
    """``quantize_group`` with bits per tensor: the tensors of each distinct K are
    quantized together (in their order), results come back in the order given. The
    parts' LDLQ passes run in lock step (one Viterbi launch per block for all of them:
    ldlq.ldlq_parts); each part's result is the same as ``quantize_group`` of it alone."""
    if len(set(k_bits)) == 1:
        return quantize_group(names, weights, biases, hessian, replace(settings, k_bits=k_bits[0]),
                              out_weights)
    ks = sorted(set(k_bits))
    parts = []
    for k in ks:
        index = [i for i, b in enumerate(k_bits) if b == k]
        parts.append(_prepare([names[i] for i in index], [weights[i] for i in index],
                              [biases[i] for i in index], hessian, replace(settings, k_bits=k),
                              None if out_weights is None else [out_weights[i] for i in index]))
    solved = ldlq_parts([p.target for p in parts], [p.h_rot for p in parts],
                        trellis_parts_quantizer(ks, settings.codebook))
    results: dict[str, QuantizedLinear] = {}
    for part, (_, payloads) in zip(parts, solved, strict=True):
        results.update({q.name: q for q in _finish(part, torch.cat(payloads, dim=0))})
    return [results[n] for n in names]


@dataclass
class _Prepared:
    """A group before its LDLQ pass: the rotated target and Hessian, and the scales."""
    names: list[str]
    weights: list[torch.Tensor]
    biases: list[torch.Tensor | None]
    hessian: torch.Tensor
    settings: QuantSettings
    out_weights: list[torch.Tensor | None] | None
    suh: torch.Tensor
    svh: list[torch.Tensor]
    target: torch.Tensor
    h_rot: torch.Tensor


def quantize_group(
    names: list[str],
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    hessian: torch.Tensor,
    settings: QuantSettings,
    out_weights: list[torch.Tensor | None] | None = None,
) -> list[QuantizedLinear]:
    """Quantize linears sharing an input; ``weights[i]`` is (in, out_i), ``y = x W``;
    ``out_weights``: see ``group_scales``."""
    part = _prepare(names, weights, biases, hessian, settings, out_weights)
    _, payloads = ldlq(part.target, part.h_rot,
                       trellis_block_quantizer(settings.k_bits, settings.codebook))
    return _finish(part, torch.cat(payloads, dim=0))


def _prepare(names: list[str], weights: list[torch.Tensor], biases: list[torch.Tensor | None],
             hessian: torch.Tensor, settings: QuantSettings,
             out_weights: list[torch.Tensor | None] | None) -> _Prepared:
    """Scales, the global scale search, the rotated target and Hessian of one group."""
    device = weights[0].device
    in_features = weights[0].shape[0]
    in_pad = padded_size(in_features)
    weights = [w.to(torch.float32) for w in weights]
    scales = group_scales(names, weights, settings.seed, out_weights, settings.fisher_strength)
    suh = scales.suh

    cb_rms = _codebook_rms(settings.codebook, device)
    out_signs, unit_rotated, padded = [], [], []
    for w, side in zip(weights, scales.sides, strict=True):
        wp = _pad(w, in_pad, side.numel())
        rotated = block_hadamard(block_hadamard(wp / suh[:, None] / side[None, :], 0), 1)
        out_signs.append(side)
        unit_rotated.append(rotated)
        padded.append(wp)
    multipliers = _search_scales(unit_rotated, settings, cb_rms)

    svh_list, targets = [], []
    for wp, side, m in zip(padded, out_signs, multipliers, strict=True):
        svh = (side / m).to(torch.float16).to(torch.float32)
        # The target uses the float16-rounded scales a loader will multiply by.
        targets.append(block_hadamard(block_hadamard(wp / suh[:, None] / svh[None, :], 0), 1))
        svh_list.append(svh)
    target = torch.cat(targets, dim=1)

    h = damp_hessian(pad_hessian(hessian.to(device, torch.float64), in_pad), settings.damping)
    return _Prepared(names, weights, biases, hessian, settings, out_weights, suh, svh_list,
                     target, rotate_hessian(h, suh))


def _finish(part: _Prepared, trellis: torch.Tensor) -> list[QuantizedLinear]:
    """The stored tensors of a group from its searched trellis (in_pad/16, out/16, words)."""
    settings, suh, device = part.settings, part.suh, part.weights[0].device
    fisher_of = {} if part.out_weights is None else dict(zip(part.names, part.out_weights,
                                                             strict=True))
    results, col_start = [], 0
    for name, w, b, svh in zip(part.names, part.weights, part.biases, part.svh, strict=True):
        tiles = svh.numel() // 16
        tensors = {
            "trellis": trellis[:, col_start : col_start + tiles].contiguous(),
            "suh": suh.to(torch.float16),
            "svh": svh.to(torch.float16),
        }
        col_start += tiles
        if settings.codebook in MARKER_VALUES:
            tensors[settings.codebook] = torch.tensor(
                MARKER_VALUES[settings.codebook], dtype=torch.int32, device=device
            )
        if b is not None:
            tensors["bias"] = b.to(torch.float16)
        dense = dequantize_linear(tensors, w.shape[0], w.shape[1])
        if settings.refit_rounds > 0:
            tensors, dense = _refit(tensors, w, dense, part.hessian, settings,
                                    fisher_of.get(name))
        results.append(QuantizedLinear(
            name=name, tensors=tensors, weight=dense,
            proxy_error=proxy_error(part.hessian.to(device), w, dense),
        ))
    return results


def _refit(tensors: dict[str, torch.Tensor], w: torch.Tensor, dense: torch.Tensor,
           hessian: torch.Tensor, settings: QuantSettings,
           fisher: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The tensors with suh/svh refitted to the searched trellis (scale_refit.py), on the
    damped Hessian; the output channels weighed by their Fisher information, as
    hedged as the output scales are (``fisher_strength``)."""
    weights = None
    if fisher is not None:
        f = fisher.to(w.device, torch.float64).clamp_min(0)
        if torch.isfinite(f).all() and float(f.mean()) > 0:
            weights = (f / f.mean() + FISHER_FLOOR).pow(settings.fisher_strength)
    h = damp_hessian(hessian.to(w.device, torch.float64), settings.damping)
    r, c = refit_scales(w, dense, h, settings.refit_rounds, weights)
    suh, svh = tensors["suh"].float(), tensors["svh"].float()
    r = torch.nn.functional.pad(r, (0, suh.numel() - r.numel()), value=1.0)
    c = torch.nn.functional.pad(c, (0, svh.numel() - c.numel()), value=1.0)
    refitted = {**tensors, "suh": (suh * r).to(torch.float16),
                "svh": (svh * c).to(torch.float16)}
    return refitted, dequantize_linear(refitted, w.shape[0], w.shape[1])
