"""Progress lines and the closing summary of a conversion.

Public API:
- ``LayerReport(layer, bits: dict[group, int], errors: dict[group, float], seconds,
  resumed, expert_tokens=None, tensor_bits=None)``; ``.line(num_layers) -> str`` (one
  progress line; a mixture-of-experts layer lists the calibration tokens each expert
  received; ``tensor_bits``, by short module name, shows mixed bits inside a group).
- ``ConversionSummary(layers, head_bits, head_error, average_bits, seconds, out_dir,
  extra)``; ``.table() -> str``: bits and mean proxy error per layer group, the bits of
  every tensor (one line per layer), how they were chosen and where the recipe is
  (``extra["allocation"]``, ``extra["recipe"]``), wall time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from exl3cli.convert.allocation import GROUPS

# Short module names of each group, in the order the summary prints them.
_GROUP_TENSORS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
                  "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
_TENSOR_ORDER = [n for names in _GROUP_TENSORS.values() for n in names]


@dataclass
class LayerReport:
    layer: int
    bits: dict[str, int]
    errors: dict[str, float]
    seconds: float
    resumed: bool = False
    # Mixture-of-experts layers: the calibration rows each routed expert received.
    expert_tokens: list[int] | None = None
    # Bits by short module name (q_proj, ...) of the layer's dense linears.
    tensor_bits: dict[str, int] | None = None

    def group_bits(self, group: str) -> str:
        """'4' or, when the group's tensors differ, '5/4/4' (in module order)."""
        names = _GROUP_TENSORS.get(group, ())
        found = [self.tensor_bits[n] for n in names if n in (self.tensor_bits or {})]
        if len(set(found)) > 1:
            return "/".join(str(b) for b in found)
        return str(self.bits[group])

    def line(self, num_layers: int) -> str:
        parts = "  ".join(
            f"{g} {self.group_bits(g)}b {self.errors[g]:.2e}" for g in GROUPS if g in self.bits
        )
        if self.expert_tokens:
            parts += f"  expert tokens {' '.join(str(n) for n in self.expert_tokens)}"
        how = "resumed" if self.resumed else f"{self.seconds:.1f}s"
        return f"layer {self.layer + 1}/{num_layers}  {parts}  ({how})"

    def line_with_eta(self, num_layers: int, remaining_seconds: float | None) -> str:
        """`line` plus the time left (None: not known yet, e.g. only resumed layers)."""
        line = self.line(num_layers)
        if remaining_seconds is None or self.layer + 1 >= num_layers:
            return line
        return f"{line}  ETA {format_eta(remaining_seconds)}"

    def to_dict(self) -> dict:
        data = {"layer": self.layer, "bits": self.bits, "errors": self.errors,
                "seconds": self.seconds}
        if self.expert_tokens is not None:
            data["expert_tokens"] = self.expert_tokens
        if self.tensor_bits is not None:
            data["tensor_bits"] = self.tensor_bits
        return data

    @classmethod
    def from_dict(cls, data: dict, resumed: bool = True) -> LayerReport:
        tokens = data.get("expert_tokens")
        tensor_bits = data.get("tensor_bits")
        return cls(int(data["layer"]), dict(data["bits"]), dict(data["errors"]),
                   float(data["seconds"]), resumed,
                   [int(n) for n in tokens] if tokens is not None else None,
                   dict(tensor_bits) if tensor_bits is not None else None)


def format_eta(seconds: float) -> str:
    """125 -> '2m05s', 3725 -> '1h02m', 8 -> '8s'."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class LayerClock:
    """Estimates the time left from the layers quantized so far (resumed ones, which
    take no time, are left out of the average)."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self._seconds: list[float] = []

    def remaining(self, report: LayerReport) -> float | None:
        if not report.resumed:
            self._seconds.append(report.seconds)
        if not self._seconds:
            return None
        return sum(self._seconds) / len(self._seconds) * (self.num_layers - report.layer - 1)


@dataclass
class ConversionSummary:
    layers: list[LayerReport]
    head_bits: int
    head_error: float | None
    average_bits: float
    seconds: float
    out_dir: Path | None = None
    extra: dict = field(default_factory=dict)

    def table(self) -> str:
        rows = [f"{'group':<8} {'bits (min-max)':>15} {'mean proxy error':>17} {'max':>10}"]
        for group in GROUPS:
            bits = [r.bits[group] for r in self.layers if group in r.bits]
            bits += [b for r in self.layers for n, b in (r.tensor_bits or {}).items()
                     if n in _GROUP_TENSORS[group]]
            bits = [b for b in bits if b <= 8] or bits  # 16: kept, shown only if all are
            errors = [r.errors[group] for r in self.layers if group in r.errors]
            if not bits:
                continue
            rows.append(f"{group:<8} {f'{min(bits)}-{max(bits)}':>15} "
                        f"{sum(errors) / len(errors):>17.3e} {max(errors):>10.3e}")
        head = "16 (not quantized)" if self.head_error is None else (
            f"{self.head_bits}  error {self.head_error:.3e}")
        rows.append(f"head     {head}")
        if "embed_bits" in self.extra:
            rows.append(f"embed    {self.extra['embed_bits']}  error "
                        f"{self.extra['embed_error']:.3e}")
        counts = [n for r in self.layers for n in (r.expert_tokens or [])]
        if counts:
            rows.append(f"expert calibration tokens: min {min(counts)}  max {max(counts)}  "
                        f"(experts with fewer than their inputs are topped up, pooled)")
        rows.extend(self.tensor_lines())
        rows.append(f"average bits per weight (layers): {self.average_bits:.3f}")
        if "allocation" in self.extra:
            rows.append(f"bits chosen by: {self.extra['allocation']}")
        if "recipe" in self.extra:
            rows.append(f"recipe (edit, then --recipe FILE): {self.extra['recipe']}")
        rows.append(f"wall time: {self.seconds:.1f}s")
        return "\n".join(rows)

    def tensor_lines(self) -> list[str]:
        """Bits of every tensor, one line per layer (16: kept unquantized)."""
        names = [n for n in _TENSOR_ORDER if any(n in (r.tensor_bits or {}) for r in self.layers)]
        if not names:
            return []
        short = [n.removesuffix("_proj") for n in names]
        lines = ["bits per tensor:  layer " + " ".join(f"{s:>4}" for s in short)]
        for r in self.layers:
            tb = r.tensor_bits or {}
            lines.append(f"{'':18}{r.layer:>5} " + " ".join(
                f"{tb[n] if n in tb else '-':>4}" for n in names))
        return lines
