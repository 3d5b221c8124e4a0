"""`exl3 bench --plot DIR`: PNG charts of bench reports (matplotlib, an optional extra).

Three kinds of report, told apart by their fields: speed (`prompt` and `generation`
rows, cli/bench_speed.py), quality (`perplexity`, cli/bench_quality.py) and server load
(`ttft_ms`, cli/bench_load.py). Speed and server reports get one PNG each; all quality
reports share one chart, perplexity (and KL) against bits per weight when every report
names its bpw, else one bar per model.

Public API: ``report_kind(report) -> str``, ``load_reports(paths) -> list[dict]``,
``require_matplotlib() -> None``, ``write_plots(reports, out_dir) -> list[Path]``.
Every user-facing failure is an ``Exl3Error`` with a one-line message.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from exl3cli.errors import Exl3Error

MISSING = "exl3 bench --plot needs matplotlib: pip install 'exl3[plot]'"


def require_matplotlib() -> Any:
    """pyplot on the Agg backend (no display needed), or a one-line error."""
    try:
        import matplotlib
    except ImportError:
        raise Exl3Error(MISSING) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def report_kind(report: Any) -> str:
    """'speed', 'quality' or 'server'; an Exl3Error for anything else."""
    if isinstance(report, dict):
        if isinstance(report.get("generation"), list) and isinstance(report.get("prompt"), list):
            return "speed"
        if isinstance(report.get("perplexity"), (int, float)):
            return "quality"
        if isinstance(report.get("ttft_ms"), dict) and "tokens_per_s" in report:
            return "server"
    raise Exl3Error("not an exl3 bench report (expected the --json output of a speed, "
                    "--ppl or --server run)")


def load_reports(paths: list[str | Path]) -> list[dict[str, Any]]:
    """The reports in the JSON files `paths`, each checked to be a bench report."""
    reports = []
    for path in paths:
        try:
            report = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as error:
            raise Exl3Error(f"cannot read {path}: {error.strerror or error}") from None
        except ValueError as error:
            raise Exl3Error(f"{path} is not JSON: {error}") from None
        try:
            report_kind(report)
        except Exl3Error as error:
            raise Exl3Error(f"{path}: {error}") from None
        reports.append(report)
    return reports


def write_plots(reports: list[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """Draw every report into PNG files under `out_dir` (created if missing)."""
    plt = require_matplotlib()
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise Exl3Error(f"cannot create {out}: {error.strerror or error}") from None
    kinds = [report_kind(r) for r in reports]
    written: list[Path] = []

    def save(figure: Any, name: str) -> None:
        path = out / name
        scratch = out / f".{name}.tmp"
        try:
            figure.savefig(scratch, format="png", dpi=80)
            os.replace(scratch, path)
        except OSError as error:
            scratch.unlink(missing_ok=True)
            raise Exl3Error(f"cannot write {path}: {error.strerror or error}") from None
        finally:
            plt.close(figure)
        written.append(path)

    for kind, draw in (("speed", _speed_figure), ("server", _server_figure)):
        chosen = [r for r, k in zip(reports, kinds, strict=True) if k == kind]
        for index, report in enumerate(chosen):
            suffix = f"-{index + 1}" if len(chosen) > 1 else ""
            save(draw(plt, report), f"bench-{kind}{suffix}.png")
    quality = [r for r, k in zip(reports, kinds, strict=True) if k == "quality"]
    if quality:
        save(_quality_figure(plt, quality), "bench-quality.png")
    return written


def _speed_figure(plt: Any, report: dict[str, Any]) -> Any:
    figure, (lines, bars) = plt.subplots(1, 2, figsize=(10, 4))
    figure.suptitle(f"{report.get('model', '?')} on {report.get('device', '?')}", fontsize=10)
    generation = report["generation"]
    for context in sorted({row["context"] for row in generation}):
        rows = sorted((r for r in generation if r["context"] == context), key=lambda r: r["batch"])
        lines.plot([r["batch"] for r in rows], [r["tok_s"] for r in rows], marker="o",
                   label=f"context {context}")
    lines.set_xlabel("concurrent jobs (batch)")
    lines.set_ylabel("generation tok/s (all jobs)")
    lines.set_title("generation tok/s vs concurrent jobs", fontsize=10)
    batches = sorted({row["batch"] for row in generation})
    if len(batches) > 1 and batches[-1] / batches[0] >= 8:
        lines.set_xscale("log", base=2)
    lines.set_xticks(batches, [str(b) for b in batches])
    lines.grid(alpha=0.3)
    lines.legend(fontsize=8)

    prompt_rate = {(r["batch"], r["tokens"]): r["tok_s"] for r in report["prompt"]}
    keys = [(r["batch"], r["context"]) for r in generation]
    where = range(len(keys))
    width = 0.4
    bars.bar([x - width / 2 for x in where], [prompt_rate.get(k, 0.0) for k in keys], width,
             label="prompt (prefill)")
    bars.bar([x + width / 2 for x in where], [r["tok_s"] for r in generation], width,
             label="generation")
    bars.set_xticks(list(where), [f"b{b}\n{c} tok" for b, c in keys], fontsize=8)
    bars.set_yscale("log")
    bars.set_ylim(top=bars.get_ylim()[1] * 6)  # headroom for the legend above the bars
    bars.set_ylabel("tok/s (log scale)")
    bars.set_title("prompt vs generation tok/s", fontsize=10)
    bars.grid(axis="y", alpha=0.3)
    bars.legend(fontsize=8)
    figure.tight_layout()
    return figure


def _bits(report: dict[str, Any]) -> float | None:
    bits = report.get("bits")
    return float(bits) if isinstance(bits, (int, float)) else None


def _quality_figure(plt: Any, reports: list[dict[str, Any]]) -> Any:
    has_kl = any(isinstance(r.get("kl"), (int, float)) for r in reports)
    figure, axes = plt.subplots(1, 2 if has_kl else 1, figsize=(10 if has_kl else 5.5, 4),
                                squeeze=False)
    series = [("perplexity", "perplexity")] + ([("kl", "KL divergence vs reference")]
                                               if has_kl else [])
    by_bits = len(reports) > 1 and all(_bits(r) is not None for r in reports)
    ordered = sorted(reports, key=lambda r: _bits(r) or 0.0) if by_bits else reports
    for axis, (key, title) in zip(axes[0], series, strict=True):
        rows = [r for r in ordered if isinstance(r.get(key), (int, float))]
        values = [r[key] for r in rows]
        if by_bits:
            axis.plot([_bits(r) for r in rows], values, marker="o")
            axis.set_xlabel("bits per weight")
            axis.set_title(f"{title} vs bits per weight", fontsize=10)
        else:
            names = [str(r.get("model") or r.get("text", "?")) for r in rows]
            axis.bar(range(len(rows)), values)
            axis.set_xticks(range(len(rows)), [Path(n).name or n for n in names], fontsize=8)
            axis.set_title(title, fontsize=10)
        axis.set_ylabel(key if key == "perplexity" else "KL (nats/token)")
        axis.grid(alpha=0.3)
    text = reports[0].get("text")
    if text:
        figure.suptitle(f"on {Path(str(text)).name}, {reports[0].get('tokens', '?')} tokens",
                        fontsize=10)
    figure.tight_layout()
    return figure


def _server_figure(plt: Any, report: dict[str, Any]) -> Any:
    figure, (rate, times) = plt.subplots(1, 2, figsize=(10, 4),
                                         gridspec_kw={"width_ratios": [1, 2]})
    figure.suptitle(f"{report.get('model', '?')} at {report.get('server', '?')}, "
                    f"{report.get('concurrency', '?')} concurrent, "
                    f"{report.get('completed', '?')}/{report.get('requests', '?')} done",
                    fontsize=10)
    rate.bar(["output tok/s", "requests/s"],
             [report.get("tokens_per_s") or 0.0, report.get("requests_per_s") or 0.0])
    rate.set_title("throughput", fontsize=10)
    rate.grid(axis="y", alpha=0.3)
    labels = ["p50", "p95", "p99", "mean"]
    width = 0.4
    for offset, key, name in ((-width / 2, "ttft_ms", "time to first token"),
                              (width / 2, "latency_ms", "whole request")):
        figures = report.get(key) or {}
        times.bar([i + offset for i in range(len(labels))],
                  [figures.get(label) or 0.0 for label in labels], width, label=name)
    times.set_xticks(range(len(labels)), labels)
    times.set_ylabel("milliseconds")
    times.set_title("time to first token and latency", fontsize=10)
    times.grid(axis="y", alpha=0.3)
    times.legend(fontsize=8)
    figure.tight_layout()
    return figure
