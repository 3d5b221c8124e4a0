"""Tensor parallel on the CPU: two gloo ranks (one spawned process) give the greedy
tokens and, within float32 rounding of the reordered sums, the logits of the one-process
model, through the generator (continuous batching, a prefill chunk next to decoding
rows), for a dense and a mixture-of-experts family, 16-bit checkpoints and EXL3 folders.
A rank killed mid-use stops the model with a clear error and leaves no process."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from exl3cli.engine.generation.tp_launch import load_tensor_parallel
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.errors import ModelLoadError, RankFailure
from tests.engine.parallel.conftest import greedy_texts
from tests.fixtures.tiny_exl3 import random_exl3_folder
from tests.fixtures.tiny_store import write_tiny_chat_model

IDS = torch.tensor([[5, 6, 7, 8, 9, 10]])
# head_dim 128: one KV head per rank is one whole Hadamard block of k_proj / v_proj.
BLOCK_SHAPES = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
                "head_dim": 128, "intermediate_size": 256}


def _same_as_one_process(folder, modes=("off",)) -> None:
    single = load_causal_lm(folder, device="cpu")
    expected_logits = single(IDS)
    expected = greedy_texts(single, folder)
    model = load_tensor_parallel(folder, 2, device="cpu")
    try:
        torch.testing.assert_close(model(IDS), expected_logits, rtol=1e-4, atol=1e-4)
        for mode in modes:  # "static": the fixed-shape decode steps, buffer broadcast
            assert greedy_texts(model, folder, decode_mode=mode) == expected
    finally:
        model.close()
    assert all(len(tokens) == 8 for tokens in expected)


def test_dense_fp32_two_ranks(tmp_path):
    _same_as_one_process(write_tiny_chat_model(tmp_path / "llama", "llama"), ("off", "static"))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_fp16_two_ranks(tmp_path, arch):
    """Experts split across the ranks (expert parallel), float16 checkpoint."""
    _same_as_one_process(write_tiny_chat_model(tmp_path / arch, arch, dtype="float16"))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_exl3_two_ranks(tmp_path, arch):
    """EXL3 projections cut on whole 128 blocks; the head's vocabulary (400, stored
    padded to 512) splits 256 / 144."""
    src = write_tiny_chat_model(tmp_path / "src", arch, **BLOCK_SHAPES)
    _same_as_one_process(random_exl3_folder(src, tmp_path / "exl3"))


def test_exl3_cut_off_a_block_is_refused_before_any_rank_starts(tmp_path):
    src = write_tiny_chat_model(tmp_path / "src", "llama")  # head_dim 16
    folder = random_exl3_folder(src, tmp_path / "exl3")
    with pytest.raises(ModelLoadError, match="does not fall on a 128-wide Hadamard block"):
        load_tensor_parallel(folder, 2, device="cpu")


def test_kv_heads_that_do_not_divide_are_refused(tmp_path):
    folder = write_tiny_chat_model(tmp_path / "llama", "llama")  # 2 KV heads
    with pytest.raises(ModelLoadError, match="2 KV heads do not divide over 3 ranks"):
        load_tensor_parallel(folder, 3, device="cpu")


def test_a_killed_rank_stops_the_model_clearly(tmp_path):
    folder = write_tiny_chat_model(tmp_path / "llama", "llama")
    model = load_tensor_parallel(folder, 2, device="cpu")
    try:
        model(IDS)
        (process,) = model.watch.processes
        os.kill(process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while model.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+\) exited with code -9"):
            model(IDS)
        with pytest.raises(RankFailure):  # and stays stopped
            greedy_texts(model, folder)
        assert not process.is_alive()
    finally:
        model.close()
