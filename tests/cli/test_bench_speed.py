"""`exl3 bench MODEL` / `--synthetic`: the speed mode on the CPU (cli/bench_speed.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from exl3cli.cli.bench import bench
from exl3cli.cli.bench_speed import bytes_per_token
from exl3cli.convert.synthetic import write_synthetic_model
from exl3cli.engine.models.loader import load_causal_lm


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_model(tmp_path_factory.mktemp("bench"), "tiny", bits=4.0, seed=1)


def _run(args: list[str]):
    return CliRunner().invoke(bench, args, catch_exceptions=False)


def test_synthetic_json_report_has_every_field():
    result = _run(["--synthetic", "tiny", "-b", "3.5", "--prompt-lengths", "8,20",
                   "--gen-tokens", "5", "--batch", "1,3", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["model"] == "synthetic tiny 3.5 bpw (head 6)"
    assert report["device"] == "cpu" and report["decode_mode"] == "off"  # the general step
    assert report["copy_bandwidth_Bps"] > 0 and report["load_seconds"] > 0
    assert [(r["batch"], r["tokens"]) for r in report["prompt"]] == [
        (1, 8), (1, 20), (3, 8), (3, 20)]
    assert [(r["batch"], r["context"]) for r in report["generation"]] == [
        (1, 8), (1, 20), (3, 8), (3, 20)]
    for row in report["prompt"]:
        assert row["tok_s"] == pytest.approx(row["batch"] * row["tokens"] / row["seconds"])
    for row in report["generation"]:
        assert row["tokens"] == 5 and row["seconds"] > 0
        assert row["tok_s"] == pytest.approx(row["batch"] * 5 / row["seconds"])
        assert row["ms_per_step"] == pytest.approx(1e3 * row["seconds"] / 5)
        if row["batch"] == 1:
            assert row["bytes_per_token"] > 0
        # A bandwidth limit is a GPU figure: on the CPU the weights sit in its caches.
        assert "fraction_of_limit" not in row and "limit_tok_s" not in row
    assert report["memory"] is None and report["peak_memory_bytes"] is None  # CPU
    assert "gen b1@20" in report["summary"] and "gen b3@20" in report["summary"]


def test_folder_argument_prints_a_table_with_the_summary_last(tiny_folder: Path):
    result = _run([str(tiny_folder), "--prompt-lengths", "6", "--gen-tokens", "3",
                   "--batch", "2"])
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert lines[0].split() == ["model", str(tiny_folder)]
    assert lines[-1].startswith(f"{tiny_folder} on cpu; prompt 6x2: ")
    assert "gen b2@6:" in lines[-1]


@pytest.mark.parametrize("args", [[], ["--synthetic", "nope"], ["x", "--batch", "0"],
                                  ["x", "--prompt-lengths", "a,b"]])
def test_bad_speed_arguments_are_usage_errors(args: list[str]):
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 2, result.output


def test_bytes_per_token_counts_the_stored_trellis_and_the_cache(tiny_folder: Path):
    model = load_causal_lm(tiny_folder, device="cpu", dtype=torch.float16,
                           linear_mode="trellis")
    config = model.config
    trellis = scales = 0
    norms = 0
    for path in tiny_folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                if key.endswith(".trellis"):
                    trellis += t.numel() * 2
                elif key.endswith((".suh", ".svh")):
                    scales += t.numel() * 2  # float16 in the model, as loaded
                elif key.endswith("norm.weight"):
                    norms += t.numel() * 2
    element = 2
    per_position = 2 * config.num_layers * config.num_kv_heads * config.head_dim * element
    expected = trellis + scales + norms + config.hidden_size * element + 100 * per_position
    assert bytes_per_token(model, 100) == expected
    assert bytes_per_token(model, 101) - bytes_per_token(model, 100) == per_position


def test_sigterm_removes_the_temporary_synthetic_model(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    command = [sys.executable, "-m", "exl3cli", "bench", "--synthetic", "tiny", "-b", "3.0",
               "--prompt-lengths", "8", "--gen-tokens", "100000", "--batch", "1"]
    proc = subprocess.Popen(command, env={**os.environ, "TMPDIR": str(tmp_path)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not list(tmp_path.glob("exl3-bench-*/tiny/config.json")):
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(1.0)  # well into the measurement
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM
    assert not list(tmp_path.glob("exl3-bench-*"))
