"""`exl3 bench --plot DIR` (cli/bench_plot.py): real PNG charts of real bench reports."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from click.testing import CliRunner

from exl3cli.cli import main
from exl3cli.cli.bench_load import LoadReport

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _bench(*args: str):
    return CliRunner().invoke(main, ["bench", *args])


def _check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), path
    assert 5_000 < len(data) < 300_000, (path, len(data))
    try:
        from PIL import Image
    except ImportError:  # the signature and the size are all we can check
        return
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.size[0] >= 300 and image.size[1] >= 200
        colors = image.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colors is None or len(colors) > 20  # drawn on, not a blank canvas


def _quality_report(path: Path, bits: float, perplexity: float, kl: float) -> Path:
    path.write_text(json.dumps({
        "model": f"smollm2:{bits}bpw", "bits": bits, "text": "wiki.test.txt", "windows": 2,
        "window": 2048, "tokens": 4094, "perplexity": perplexity, "reference": "smollm2",
        "kl": kl, "top1_agreement": 0.9}))
    return path


def test_speed_run_writes_its_charts_and_names_them_on_stderr(tmp_path: Path):
    out = tmp_path / "charts" / "new"  # created, parents too
    result = _bench("--synthetic", "tiny", "-b", "3.0", "--prompt-lengths", "8,16",
                    "--gen-tokens", "4", "--batch", "1,2", "--device", "cpu", "--json",
                    "--plot", str(out))
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # stdout stays the report alone
    assert len(report["generation"]) == 4
    assert result.stderr.strip().splitlines() == [f"wrote {out / 'bench-speed.png'}"]
    assert sorted(p.name for p in out.iterdir()) == ["bench-speed.png"]  # no temp files left
    _check_png(out / "bench-speed.png")


def test_earlier_reports_become_one_perplexity_vs_bpw_chart_and_a_server_chart(
        tmp_path: Path):
    low = _quality_report(tmp_path / "q3.json", 3.0, 14.2, 0.12)
    high = _quality_report(tmp_path / "q5.json", 5.0, 12.1, 0.03)
    server = tmp_path / "server.json"
    server.write_text(json.dumps(LoadReport(
        server="http://127.0.0.1:11435", api="ollama", model="tiny", concurrency=4,
        requests=32, completed=32, errors=0, duration_s=8.0, requests_per_s=4.0,
        output_tokens=2048, prompt_tokens=640, tokens_per_s=256.0,
        ttft_ms={"p50": 40.0, "p95": 90.0, "p99": 120.0, "mean": 50.0},
        latency_ms={"p50": 900.0, "p95": 1300.0, "p99": 1500.0, "mean": 1000.0}).as_dict()))
    out = tmp_path / "plots"
    # As a shell glob gives them: one --from-json, the rest following it.
    result = _bench("--plot", str(out), "--from-json", str(high), str(low), str(server))
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["bench-quality.png", "bench-server.png"]
    assert f"wrote {out / 'bench-quality.png'}" in result.stderr
    for path in out.iterdir():
        _check_png(path)


def test_a_json_that_is_not_a_bench_report_is_a_one_line_error(tmp_path: Path):
    other = tmp_path / "config.json"
    other.write_text(json.dumps({"hidden_size": 64}))
    result = _bench("--plot", str(tmp_path / "out"), "--from-json", str(other))
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"Error: {other}: not an exl3 bench report (expected the --json output of a speed, "
        "--ppl or --server run)"]
    assert not (tmp_path / "out").exists()
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    result = _bench("--plot", str(tmp_path / "out"), "--from-json", str(broken))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.startswith(f"Error: {broken} is not JSON")


def test_from_json_without_plot_or_with_a_run_is_refused(tmp_path: Path):
    report = _quality_report(tmp_path / "q.json", 4.0, 13.0, 0.05)
    assert _bench("--from-json", str(report)).exit_code == 2
    mixed = _bench("--plot", str(tmp_path), "--from-json", str(report), "--synthetic", "tiny")
    assert mixed.exit_code == 2 and "runs nothing" in mixed.output


def test_without_matplotlib_plot_fails_at_once_with_one_line(tmp_path: Path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    result = _bench("--synthetic", "tiny", "--device", "cpu", "--plot", str(tmp_path / "p"))
    assert result.exit_code == 1
    assert result.output.strip() == (
        "Error: exl3 bench --plot needs matplotlib: pip install 'exl3[plot]'")
    assert "model" not in result.output  # refused before running anything


def test_help_describes_plot():
    text = _bench("--help").output
    assert "--plot DIR" in text and "--from-json" in text and "exl3[plot]" in text
