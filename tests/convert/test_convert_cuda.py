"""`exl3 convert` on the GPU (`-m cuda`): the calibration passes run the engine's decoder
layers on CUDA, where a layer's forward looks for its fused decode path; the converter's
stand-in modules (convert/engine_layer.py) must not break that (the H200 run of
2026-12-02 failed every conversion with "'_Replayed' object has no attribute 'qkv'")."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from exl3cli.cli.convert import convert
from exl3cli.engine.models.loader import load_causal_lm
from tests.convert.test_pipeline import FAST_ARGS
from tests.fixtures.convert_checks import eval_ids
from tests.fixtures.tiny_store import write_tiny_chat_model

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_convert_on_cuda_loads_and_correlates(tmp_path, arch):
    src = write_tiny_chat_model(tmp_path / "src", arch)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        convert, [str(src), *FAST_ARGS, "--device", "cuda", "--out", str(out),
                  "--work", str(tmp_path / "work")],
        env={"EXL3_MODELS": str(tmp_path / "store")}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    ids = eval_ids(src)
    a = load_causal_lm(src, device="cpu")(ids).flatten()
    b = load_causal_lm(out, device="cpu")(ids).flatten()
    corr = torch.corrcoef(torch.stack([a, b]))[0, 1]
    assert corr > 0.98, f"correlation {corr:.4f}"
