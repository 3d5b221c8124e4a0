"""Progress lines and the closing summary of a conversion.

Public API:
- ``LayerReport(layer, bits: dict[group, int], errors: dict[group, float], seconds,
  resumed, expert_tokens=None)``; ``.line(num_layers) -> str`` (one progress line; a
  mixture-of-experts layer lists the calibration tokens each expert received).
- ``ConversionSummary(layers, head_bits, head_error, average_bits, seconds, out_dir)``;
  ``.table() -> str``: bits and mean proxy error per layer group, wall time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .allocation import GROUPS


@dataclass
class LayerReport:
    layer: int
    bits: dict[str, int]
    errors: dict[str, float]
    seconds: float
    resumed: bool = False
    # Mixture-of-experts layers: the calibration rows each routed expert received.
    expert_tokens: list[int] | None = None

    def line(self, num_layers: int) -> str:
        parts = "  ".join(
            f"{g} {self.bits[g]}b {self.errors[g]:.2e}" for g in GROUPS if g in self.bits
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
        return data

    @classmethod
    def from_dict(cls, data: dict, resumed: bool = True) -> LayerReport:
        tokens = data.get("expert_tokens")
        return cls(int(data["layer"]), dict(data["bits"]), dict(data["errors"]),
                   float(data["seconds"]), resumed,
                   [int(n) for n in tokens] if tokens is not None else None)


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
            errors = [r.errors[group] for r in self.layers if group in r.errors]
            if not bits:
                continue
            rows.append(f"{group:<8} {f'{min(bits)}-{max(bits)}':>15} "
                        f"{sum(errors) / len(errors):>17.3e} {max(errors):>10.3e}")
        head = "16 (not quantized)" if self.head_error is None else (
            f"{self.head_bits}  error {self.head_error:.3e}")
        rows.append(f"head     {head}")
        counts = [n for r in self.layers for n in (r.expert_tokens or [])]
        if counts:
            rows.append(f"expert calibration tokens: min {min(counts)}  max {max(counts)}  "
                        f"(experts with fewer than their inputs are topped up, pooled)")
        rows.append(f"average bits per weight (layers): {self.average_bits:.3f}")
        rows.append(f"wall time: {self.seconds:.1f}s")
        return "\n".join(rows)
