"""End to end: `exl3 convert` on a tiny random Llama (CPU), load back, resume after a kill."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner

from exl3cli.cli import main
from exl3cli.cli.convert import convert
from exl3cli.codec.format import read_quantization_config
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.models.weights import WeightReader
from tests.fixtures.convert_checks import eval_ids
from tests.fixtures.tiny_store import write_tiny_chat_model

# Small calibration keeps the CPU conversion short; the head is quantized too.
FAST_ARGS = ["-b", "4.0", "--head-bits", "6", "--calib-rows", "8", "--calib-cols", "128",
             "--scale-search-tiles", "4"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    src = write_tiny_chat_model(root / "src", "llama")
    out = root / "out"
    env = {"EXL3_MODELS": str(root / "store")}
    result = CliRunner().invoke(
        convert, [str(src), *FAST_ARGS, "-o", "tiny-q4", "--out", str(out),
                  "--work", str(root / "work")], env=env, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return {"root": root, "src": src, "out": out, "env": env, "output": result.output}


def test_output_folder_is_exl3_with_spec_tensors(converted):
    out = converted["out"]
    qconfig = read_quantization_config(out)
    assert qconfig["quant_method"] == "exl3" and qconfig["bits"] == 4.0
    assert qconfig["head_bits"] == 6 and qconfig["codebook"] == "mul1"
    reader = WeightReader(out)
    trellis = reader.get("model.layers.1.mlp.down_proj.trellis")
    assert trellis.dtype == torch.int16 and tuple(trellis.shape) == (128 // 16, 128 // 16, 64)
    head = reader.get("lm_head.trellis")
    assert tuple(head.shape) == (128 // 16, 512 // 16, 96)  # vocab 400 padded to 512, K=6
    assert reader.get("model.layers.0.self_attn.k_proj.suh").dtype == torch.float16
    assert not reader.has("model.layers.0.self_attn.q_proj.weight")
    assert (out / "tokenizer.json").is_file()
    assert "wall time" in converted["output"] and "layer 2/2" in converted["output"]


def test_logits_correlate_with_original(converted):
    src, out = converted["src"], converted["out"]
    original = load_causal_lm(src, device="cpu")
    quantized = load_causal_lm(out, device="cpu")
    # Text the model was calibrated on the distribution of (held-out rows).
    ids = eval_ids(src)
    a, b = original(ids).flatten(), quantized(ids).flatten()
    corr = torch.corrcoef(torch.stack([a, b]))[0, 1]
    # 0.9923 at 4.0 bpw on this fixture (hidden 64: every 128-block half padded);
    # 0.9876 before partial blocks got their own scale correction.
    assert corr > 0.99, f"correlation {corr:.4f}"
    # And a different model would not correlate: the check can fail.
    assert torch.corrcoef(torch.stack([a, load_causal_lm(src, "cpu")(ids.flip(1)).flatten()]))[0, 1] < 0.9


def test_registered_model_shows_as_exl3(converted):
    result = CliRunner().invoke(main, ["show", "tiny-q4"], env=converted["env"])
    assert result.exit_code == 0, result.output
    assert "EXL3" in result.output


@pytest.mark.slow
def test_kill_then_resume_gives_identical_files(converted, tmp_path):
    src = converted["src"]
    work, out = tmp_path / "work", tmp_path / "out"
    command = [sys.executable, "-c", "from exl3cli.cli.convert import convert; convert()",
               str(src), *FAST_ARGS, "--out", str(out), "--work", str(work)]
    env = {**os.environ, **converted["env"]}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not (work / "layer-0000.safetensors").is_file():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    assert not (work / "layer-0001.safetensors").exists() and not out.exists()
    resumed = subprocess.run([*command, "--resume"], env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "(resumed)" in resumed.stderr  # layer 1 was not quantized again
    expected = sorted(p.name for p in converted["out"].iterdir())
    assert sorted(p.name for p in out.iterdir()) == expected
    for name in expected:
        assert (out / name).read_bytes() == (converted["out"] / name).read_bytes(), name


def test_progress_says_what_it_does_and_how_long_is_left(converted):
    output = converted["output"]
    assert "quantizing 2 layers to 4.0 bits per weight" in output
    first = next(line for line in output.splitlines() if line.startswith("layer 1/2"))
    assert "ETA " in first  # the last layer needs no estimate
    assert "ETA" not in next(line for line in output.splitlines() if line.startswith("layer 2/2"))


def test_eta_averages_the_quantized_layers_and_skips_resumed_ones():
    from exl3cli.convert.report import LayerClock, LayerReport, format_eta

    clock = LayerClock(5)
    assert clock.remaining(LayerReport(0, {}, {}, 0.0, resumed=True)) is None
    assert clock.remaining(LayerReport(1, {}, {}, 10.0)) == 30.0
    assert clock.remaining(LayerReport(2, {}, {}, 20.0)) == 30.0  # 15 s a layer, 2 left
    assert [format_eta(s) for s in (8, 125, 3725)] == ["8s", "2m05s", "1h02m"]


def test_a_rerun_without_resume_keeps_finished_layers_unless_forced(converted, tmp_path):
    from exl3cli.convert.work_folder import JOB_FILE, prepare_work_dir

    work = tmp_path / "work"
    work.mkdir()
    (work / JOB_FILE).write_text("{}")
    finished = work / "layer-0000.safetensors"
    finished.write_bytes(b"a finished layer")
    result = CliRunner().invoke(main, ["convert", str(converted["src"]), *FAST_ARGS, "--out",
                                       str(tmp_path / "out"), "--work", str(work)],
                                env=converted["env"])
    assert result.exit_code == 1 and finished.read_bytes() == b"a finished layer"
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("Error: ") and "--resume" in error and "--force" in error
    prepare_work_dir(work, {"job": 1}, resume=False, force=True)
    assert not finished.exists() and (work / JOB_FILE).is_file()


def test_an_unsupported_architecture_is_refused_in_one_line(tmp_path):
    src = write_tiny_chat_model(tmp_path / "src", "llama")
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = ["FalconMambaForCausalLM"]
    (src / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(main, ["convert", str(src), *FAST_ARGS, "--out",
                                       str(tmp_path / "out"), "--work", str(tmp_path / "w")],
                                env={"EXL3_MODELS": str(tmp_path / "store")})
    assert result.exit_code == 1 and not (tmp_path / "out").exists()
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output
    assert lines[0].startswith("Error: unsupported model architecture 'FalconMambaForCausalLM'")
    # The supported list names the families, the new ones included.
    for family in ("MixtralForCausalLM", "GptOssForCausalLM", "Ministral3ForCausalLM",
                   "DeepseekV3ForCausalLM"):
        assert family in lines[0]
