"""`exl3 bench --server`: a load run against a real daemon reports every figure."""

from __future__ import annotations

import json
import urllib.request

import pytest
from click.testing import CliRunner

from exl3cli.cli.bench import bench
from exl3cli.cli.bench_load import percentile


def test_percentiles_interpolate_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) is None
    assert percentile(list(map(float, range(101))), 95) == 95.0


@pytest.mark.parametrize("api", ["ollama", "openai"])
def test_load_run_reports_every_figure(daemon, api):
    result = CliRunner().invoke(bench, ["--server", daemon.url, "--concurrency", "3",
                                        "--requests", "6", "--api", api, "--num-predict", "5",
                                        "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # the report is stdout; notices may go to stderr
    assert report["model"] == "tiny:latest" and report["api"] == api  # the server's first
    assert report["requests"] == report["completed"] == 6 and report["errors"] == 0
    assert report["output_tokens"] == 6 * 5 and report["prompt_tokens"] > 0
    assert report["requests_per_s"] > 0 and report["tokens_per_s"] > 0
    for figures in (report["ttft_ms"], report["latency_ms"]):
        assert 0 < figures["p50"] <= figures["p95"] <= figures["p99"]
    assert report["ttft_ms"]["p50"] <= report["latency_ms"]["p99"]
    with urllib.request.urlopen(daemon.url + "/api/stats") as response:
        stats = json.loads(response.read())
    assert stats["completed"] >= 6


def test_errors_are_counted_and_the_table_shows_them(daemon):
    result = CliRunner().invoke(bench, ["--server", daemon.url, "--model", "missing",
                                        "-c", "2", "-n", "3"])
    assert result.exit_code == 1
    assert "0/3 ok, 3 errors" in result.output and "HTTP 404" in result.output
    ok = CliRunner().invoke(bench, ["--server", daemon.url, "--model", "tiny", "-c", "2",
                                    "-n", "2", "--num-predict", "3"])
    assert ok.exit_code == 0, ok.output
    for label in ("requests/s", "tokens/s", "first token", "latency", "p50", "p95", "p99"):
        assert label in ok.output


def test_bench_needs_a_model_or_a_server():
    result = CliRunner().invoke(bench, [])
    assert result.exit_code == 2 and "--server" in result.output
